"""Reinforcement learning and distillation: the loop (loop.py), its trained models and their update (trainer.py,
step.py; over several ranks: ranks.py), losses, batches, rollout episodes and workers, the critic and the teachers.
The nodes built on the loop (the specialists, multi-teacher OPD, the GLM-5 cross-stage chains and their comparison)
are in posttrain/stages/."""
