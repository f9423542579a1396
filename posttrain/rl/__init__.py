"""Reinforcement learning and distillation: the loop (loop.py) and its update (step.py), losses, batches,
rollout episodes and workers, the critic, teachers, and the nodes built on the loop: the specialists
(specialist.py), multi-teacher OPD (opd.py), the GLM-5 cross-stage chains (cross_stage.py) and their
comparison (consolidation.py)."""
