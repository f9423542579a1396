"""bench/judge: the guard's model judge on the tiny world, measured on its labelled calls and in RL.

The tiny profile's dense ramped model (bench/dsa's, seed 0) is fine-tuned with the judge's questions in the
agentic sft data (world.agentic_judge_share), once. That sft model is then the judge: precision and recall of
blocking on the 50 + 50 labelled test calls (environments.agentic.judge_cases), against an sft model trained
without judge questions (bench/compaction's, when present). Then a short agentic PPO run with the judge in the
guard gives its cost: judge tokens read per episode.

    python -m bench.judge [--share 0.3] [--sft-steps 2000] [--rl-steps 10]

Writes .posttrain/bench/judge.json.

BENCH_SMALL=1 (bench/__init__.py): the smoke profile, from the smoke run's curated data and ramped model; sft 4
steps, PPO 2 steps, 8 labelled calls per class.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from bench import mark, out_dir, size, small, smoke_stages

OUT = out_dir()
WORK = OUT / "judge-work"
SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
PROFILE = size("tiny-dense", "smoke-dense")
COMPACTION_SFT_STEPS = size(1200, 4)  # bench/compaction's sft without judge questions, when present
SHARE = 0.3  # share of judge questions in the agentic sft data (0.15 over 1000 steps: precision 0.56)


def _cfg(share: float, extra: list[str]):
    from posttrain.config import load_config
    return load_config(PROFILE, [f"world.agentic_judge_share={share}", *extra])


def judge_data(share: float) -> Path:
    """The tiny curated data with the agentic splits regenerated with judge questions in the training split."""
    import environments
    from bench.dsa import tiny_inputs
    from posttrain.stages.curate import _write_splits
    cur = WORK / f"curate-{share}"
    if not (cur / "done").exists():
        src, _ = tiny_inputs(0)
        shutil.rmtree(cur, ignore_errors=True)
        shutil.copytree(src, cur)
        cfg = _cfg(share, [])
        test = environments.get("agentic").generate("test", cfg.world.n_test, cfg.world.seed, **cfg.world.knobs())
        _write_splits(cfg, {"agentic": test}, cur, [])
        (cur / "done").touch()
    return cur


def sft_model(cur: Path, share: float, steps: int) -> Path:
    from posttrain.stages import sft
    from posttrain.pipeline.raysupport import ensure_ray
    out = WORK / f"sft-{share}-{steps}"
    if not (out / "done").exists():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        cfg = _cfg(share, [f"sft.steps={steps}"])
        ensure_ray(cfg.runtime)
        ramped = Path(smoke_stages()["ramp"]) if small() else Path(".posttrain/bench/dsa-work/ramp-0-dense")
        if not (ramped / "model.safetensors").exists():
            raise SystemExit(f"{ramped} is missing: run `python -m bench.dsa evidence --seeds 0` first (its dense ramp)")
        sft.run(cfg, {"ramp": str(ramped.resolve()), "curate": str(cur.resolve())}, out,
                scratch=str((WORK / f"sft-{share}-{steps}-scratch").resolve()))
        (out / "done").touch()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.judge", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft-steps", type=int, default=size(2000, 4))
    ap.add_argument("--share", type=float, default=SHARE, help="world.agentic_judge_share for the sft data")
    ap.add_argument("--rl-steps", type=int, default=size(10, 2))
    args = ap.parse_args(argv if argv is not None else [])  # `python -m bench` calls main() bare
    from environments import agentic
    from posttrain.data import load_tasks
    from posttrain.judge import ModelJudge, measure
    from posttrain.rl.loop import train_policy
    cur = judge_data(args.share)
    sft = sft_model(cur, args.share, args.sft_steps)
    cfg = _cfg(args.share, [])
    cases = agentic.judge_cases("test", size(cfg.rl.judge.labelled_per_class, 8), cfg.world.seed)
    fig: dict = {"judge_share": args.share, "sft_steps": args.sft_steps, "machine": "cpu (2 cores)",
                 "judge_examples_in_sft": sum("judge_case" in t.meta for t in load_tasks(cur, "sft", "agentic"))}
    trained = measure(ModelJudge(str(sft.resolve())), cases)
    print(f"trained judge: {trained}", flush=True)
    fig.update({k: trained[k] for k in ("precision", "recall", "labelled_calls", "judge_tokens_per_call")},
               accuracy_by_kind=trained["accuracy_by_kind"])
    untrained = OUT / "compaction-work" / f"sft-{COMPACTION_SFT_STEPS}"
    if (untrained / "model.safetensors").exists():
        fig["without_judge_data"] = measure(ModelJudge(str(untrained.resolve())), cases)
        print(f"sft without judge questions: {fig['without_judge_data']}", flush=True)
    r = cfg.rl.for_domain("agentic").model_copy(update={"steps": args.rl_steps, "val_every": 0,
                                                        "checkpoint_every": 0})
    pool = load_tasks(cur, "rl", "agentic")
    _, _, st = train_policy(r, str(sft.resolve()), pool, load_tasks(cur, "val", "agentic")[:16], seed=0,
                            label="ppo-judge", judge=str(sft.resolve()))
    per_step = st.history["judge_tokens_per_episode"]
    fig["judge_tokens_per_episode"] = round(sum(per_step) / len(per_step), 3)
    fig["judge_tokens_per_episode_per_step"] = [round(x, 3) for x in per_step]
    fig["rl_steps"], fig["rl_episodes_per_step"] = args.rl_steps, r.prompts_per_step * r.group_size
    fig["blocked_by_judge"] = sum(a["stage"] == "judge" for a in st.attempts)
    OUT.mkdir(parents=True, exist_ok=True)
    fig = mark(fig)
    (OUT / "judge.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
