"""The GLM-5 cross-stage recipe: RL stages in sequence (rl.domains in order: reasoning, agentic, general by
default), each starting from the
previous stage's checkpoint and distilling, on-policy, from the earlier stages' checkpoints on their
domains' prompts so it does not forget them. The baseline (`seq`) is the same chain without distillation.

Both chains share their first stage with the main DAG: the first domain's specialist (`rl-reasoning`)."""
from __future__ import annotations

import json
from pathlib import Path

from posttrain.config import PipelineConfig
from posttrain.data import load_tasks
from posttrain.engines import lora_options, rollout_options, train_options
from posttrain.models.preset import save_checkpoint
from posttrain.pipeline.nodes import stage_name
from posttrain.rl import alarms
from posttrain.rl.loop import Distill, train_policy
from posttrain.stages.specialist import plot_curves


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path, domain: str, chain: str, scratch: str = "") -> dict:
    r = cfg.rl.for_domain(domain)
    x = cfg.cross_stage
    order = cfg.rl.domains
    earlier = order[:order.index(domain)]
    start = inputs[stage_name(chain, earlier[-1], order)]
    pool = load_tasks(inputs["curate"], "rl", domain)
    seen = (*earlier, domain)  # validated on every domain trained so far: forgetting shows on the curves
    val = [t for d in seen for t in load_tasks(inputs["curate"], "val", d)]
    distill = None
    if chain == "xs":
        distill = Distill({d: inputs[stage_name(chain, d, order)] for d in earlier},
                          [t for d in earlier for t in load_tasks(inputs["curate"], "rl", d)],
                          x.distill_prompts_per_step, mode=x.loss, coef=x.distill_coef,
                          teacher_cpus=cfg.opd.teacher_cpus, teacher_placement=cfg.opd.teacher_placement)
    policy, tok, st = train_policy(r, start, pool, val, seed=cfg.seed, label=f"{chain}-{domain}", moe=cfg.moe,
                                 scratch=scratch, distill=distill,
                                 engine=(cfg.runtime.train_engine, train_options(cfg) | lora_options(cfg, "rl")),
                                 **rollout_options(cfg))
    save_checkpoint(policy, tok, out)
    hist = st.history
    (out / "history.json").write_text(json.dumps(hist))
    plot_curves({**hist, "val_score": hist[f"val_score/{domain}"]}, out / "rl_curves.png",
                f"{chain} stage {domain} ({r.algorithm}{', distilling ' + '+'.join(earlier) if distill else ''})")
    metrics = {"wall_s": st.wall_s, "student_tokens": hist["student_tokens"][-1],
               "teacher_tokens": hist["teacher_tokens"][-1], **{f"val_score_before_{d}": hist[f"val_score/{d}"][0][1]
                                                                for d in seen},
               **{f"val_score_after_{d}": hist[f"val_score/{d}"][-1][1] for d in seen}}
    found = alarms.publish(st.alarms, out, f"{chain}-{domain}", hist)  # reward-hacking alarms, tagged on the MLflow run
    return {"metrics": {**metrics, **found["metrics"]}, "tags": found["tags"], "history": hist,
            "params": {"domain": domain, "chain": chain, "start": earlier[-1]}}
