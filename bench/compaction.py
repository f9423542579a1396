"""bench/compaction: critic PPO on agentic episodes longer than the context budget, with compaction against
truncation (GLM-5.2's compaction-aware training).

The task-world variant spreads each task's numbers over 4 files (world.agentic_files=4), one read per turn, so a
whole episode does not fit `--budget` tokens of context. The tiny profile's dense ramped model (bench/dsa's, seed
0) is fine-tuned once on the variant (its training split holds resumed forms: notes of the files read so far, as
a compaction writes them). Then, per RL seed, PPO from that sft model with the same budget twice: episodes that
compact (every sub-trace trained) and episodes truncated at the budget (reward 0). Test score of the variant,
greedy, before and after, each under the setting it trained with and under the other.

    python -m bench.compaction [--seeds 0 1 2] [--steps 40] [--budget 120] [--summary policy]

Writes .posttrain/bench/compaction.json (same keys as report.json's `compaction`, over seeds) and its curves plot.
`--summary policy`: the policy writes the notes (rl.compaction_summary: policy) after an sft whose data answers the
summary request on a share of the variant's tasks (world.agentic_summary_share); compaction only (truncation is
the same either way); `compaction_policy.json`, with `notes_exact`: the share of the policy's notes that are the
rule-based note word for word.

BENCH_SMALL=1 (bench/__init__.py): the smoke profile with the variant, from the smoke run's curated data and ramped
model; sft 4 steps, PPO 2 steps, seed 0, a budget of 96 tokens, 8 new tokens a turn.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from statistics import mean, stdev

from bench import mark, out_dir, size, small, smoke_stages

OUT = out_dir()
WORK = OUT / "compaction-work"
SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
PROFILE = size("tiny-dense", "smoke-dense")
# four files of one number each; a lazy teacher on a fifth of the demonstrations: RL's headroom
VARIANT = ["world.agentic_files=4", "world.agentic_numbers=1",
           "sft.shortcut_share={reasoning: 0.4, agentic: 0.2, general: 0.6}"]
SETTINGS = {"compaction": True, "truncation": False}
SUMMARY_SHARE = 0.3  # --summary policy: the share of the variant's training split answering the summary request
SUMMARY: list[str] = []  # world settings of the summary mode (set by main)


def _cfg(extra: list[str]):
    from posttrain.config import load_config
    return load_config(PROFILE, [*VARIANT, *SUMMARY, *extra])


def variant_data() -> Path:
    """The tiny curated data with the agentic splits replaced by the 3-file variant's."""
    import environments
    from bench.dsa import tiny_inputs
    from posttrain.stages.curate import _write_splits
    cur = WORK / "curate"
    if not (cur / "done").exists():
        src, _ = tiny_inputs(0)
        shutil.rmtree(cur, ignore_errors=True)
        shutil.copytree(src, cur)
        cfg = _cfg([])
        test = environments.get("agentic").generate("test", cfg.world.n_test, cfg.world.seed, **cfg.world.knobs())
        _write_splits(cfg, {"agentic": test}, cur, [])
        (cur / "done").touch()
    return cur


def sft_model(cur: Path, steps: int) -> Path:
    from posttrain.stages import sft
    from posttrain.pipeline.raysupport import ensure_ray
    out = WORK / f"sft-{steps}"
    if not (out / "done").exists():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        cfg = _cfg([f"sft.steps={steps}"])
        ensure_ray(cfg.runtime)
        ramped = Path(smoke_stages()["ramp"]) if small() else Path(".posttrain/bench/dsa-work/ramp-0-dense")
        if not (ramped / "model.safetensors").exists():
            raise SystemExit(f"{ramped} is missing: run `python -m bench.dsa evidence --seeds 0` first (its dense ramp)")
        res = sft.run(cfg, {"ramp": str(ramped.resolve()), "curate": str(cur.resolve())}, out,
                      scratch=str((WORK / f"sft-{steps}-scratch").resolve()))
        (out / "sft_metrics.json").write_text(json.dumps(res["metrics"], indent=1, default=float))
        (out / "done").touch()
    return out


def test_scores(model, tok, tasks, r) -> dict[str, float]:
    """Greedy test score under the budget, compacting and truncating, and with no budget; and the policy's own
    (sampled, temperature 1) score with compaction, mean of 4 samples per task: RL sharpens what it samples
    first, so this is where a short run shows, even where the greedy answer was already the likeliest."""
    import torch

    from environments.base import compaction_note
    from posttrain.rl.rollout import run_episodes
    g = torch.Generator().manual_seed(1234)
    eps = run_episodes(model, tok, tasks * 4, temperature=1.0, max_new_tokens=r.max_new_tokens, max_turns=r.max_turns,
                       context_budget=r.context_budget, compaction=True, summary=r.compaction_summary, generator=g)
    out = {"compaction_sampled": round(sum(e.reward for e in eps) / len(eps), 4)}
    for name, kw in {**{k: {"context_budget": r.context_budget, "compaction": v} for k, v in SETTINGS.items()},
                     "no_budget": {"context_budget": 0}}.items():
        eps = run_episodes(model, tok, tasks, temperature=0.0, max_new_tokens=r.max_new_tokens, max_turns=r.max_turns,
                           summary=r.compaction_summary, **kw)
        out[name] = round(sum(e.reward for e in eps) / len(eps), 4)
        if name == "compaction":
            out["subtraces_per_episode"] = round(mean(len(e.traces()) for e in eps), 3)
            notes = [(n, compaction_note(e.calls[:k])) for e in eps for n, k in zip(e.summaries, e.summary_calls)]
            if notes:
                out["notes_exact"] = round(mean(a == b for a, b in notes), 4)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.compaction", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=size([0, 1, 2], [0]))
    ap.add_argument("--steps", type=int, default=size(40, 2), help="PPO steps per run")
    ap.add_argument("--sft-steps", type=int, default=size(1200, 4))
    ap.add_argument("--budget", type=int, default=size(120, 96), help="rl.context_budget (tokens)")
    ap.add_argument("--summary", choices=["rules", "policy"], default="rules", help="rl.compaction_summary")
    ap.add_argument("--max-new-tokens", type=int, default=size(32, 8),
                    help="rl.max_new_tokens: a turn's budget, the policy's notes included (notes on 3 files: ~35)")
    args = ap.parse_args(argv if argv is not None else [])  # `python -m bench` calls main() bare
    global WORK, SUMMARY
    policy = args.summary == "policy"
    if policy:  # its own data and sft: the variant's training split answers the summary request on a share
        WORK, SUMMARY = OUT / "compaction-policy-work", [f"world.agentic_summary_share={SUMMARY_SHARE}"]
    settings = {"compaction": True} if policy else SETTINGS
    import torch

    from posttrain.data import load_tasks
    from posttrain.models.preset import load_checkpoint
    from posttrain.rl.loop import train_policy
    cur = variant_data()
    sft = sft_model(cur, args.sft_steps)
    pool, val = load_tasks(cur, "rl", "agentic"), load_tasks(cur, "val", "agentic")[:32]
    test = load_tasks(cur, "test", "agentic")
    base = _cfg([]).rl.for_domain("agentic")
    common = {"loss_agg": "token", "max_turns": 5, "max_new_tokens": args.max_new_tokens, "context_budget": args.budget,
              "steps": args.steps, "val_every": 0, "checkpoint_every": 0, "compaction_summary": args.summary}
    model, tok = load_checkpoint(str(sft))
    r0 = base.model_copy(update=common)
    before = test_scores(model, tok, test, r0)
    print(f"sft: {before}", flush=True)
    runs: dict[str, dict[int, dict]] = {s: {} for s in settings}
    for seed in args.seeds:
        for setting, compaction in settings.items():
            new = "" if args.max_new_tokens == 32 else f"-new{args.max_new_tokens}"  # the rules runs' names kept
            path = WORK / f"ppo-{setting}-{seed}-{args.steps}-{args.budget}{new}-sft{args.sft_steps}.json"
            if path.exists():
                runs[setting][seed] = json.loads(path.read_text())
                continue
            r = type(base).model_validate({**base.model_dump(), **common, "compaction": compaction})
            t = time.time()
            torch.manual_seed(seed)
            policy, tok, st = train_policy(r, str(sft.resolve()), pool, val, seed=seed, label=f"ppo-{setting}")
            h = st.history
            res = {"after": test_scores(policy, tok, test, r), "seconds": round(time.time() - t, 1),
                   **{k: h[k] for k in ("reward", "subtraces_per_episode", "subtrace_tokens", "subtrace_tokens_max",
                                        "truncated_share", "value_loss", "explained_variance")}}
            path.write_text(json.dumps(res))
            runs[setting][seed] = res
            print(f"seed {seed} {setting}: {res['after']} ({res['seconds']} s)", flush=True)

    fig: dict = {"seeds": args.seeds, "steps": args.steps, "budget": args.budget, "sft_steps": args.sft_steps,
                 "variant": VARIANT + SUMMARY, "summary": args.summary, "test_tasks": len(test), "before": before,
                 "rl": {k: v for k, v in common.items() if k != "steps"} | {"algorithm": base.algorithm,
                                                                            "prompts_per_step": base.prompts_per_step}}
    for setting in settings:
        gains = [runs[setting][s]["after"][setting] - before[setting] for s in args.seeds]
        fig[f"gain_{'with' if setting == 'compaction' else 'without'}_per_seed"] = [round(g, 4) for g in gains]
        fig[f"gain_{'with' if setting == 'compaction' else 'without'}"] = round(mean(gains), 4)
        fig[f"gain_{'with' if setting == 'compaction' else 'without'}_std"] = round(stdev(gains), 4) \
            if len(gains) > 1 else None
        fig[f"{setting}_runs"] = {s: runs[setting][s]["after"] for s in args.seeds}
    sampled = [runs["compaction"][s]["after"]["compaction_sampled"] - before["compaction_sampled"] for s in args.seeds]
    fig["gain_with_sampled_per_seed"] = [round(g, 4) for g in sampled]
    fig["gain_with_sampled"] = round(mean(sampled), 4)
    fig["gain_with_sampled_std"] = round(stdev(sampled), 4) if len(sampled) > 1 else None
    fig["subtraces_per_episode"] = round(mean(x for s in args.seeds
                                              for x in runs["compaction"][s]["subtraces_per_episode"]), 3)
    if "truncation" in settings:
        fig["truncated_share_without"] = round(mean(x for s in args.seeds
                                                    for x in runs["truncation"][s]["truncated_share"]), 3)
    name = "compaction_policy" if policy else "compaction"
    _plot(runs, args.seeds, OUT / f"{name}.png")
    OUT.mkdir(parents=True, exist_ok=True)
    fig = mark(fig)
    (OUT / f"{name}.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))


def _plot(runs: dict, seeds: list[int], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for setting, color in (("compaction", "C0"), ("truncation", "C3")):
        if setting not in runs:
            continue
        for i, s in enumerate(seeds):
            label = setting if i == 0 else None
            a.plot(runs[setting][s]["reward"], color=color, alpha=0.7, label=label)
            if setting == "compaction":
                b.plot(runs[setting][s]["subtraces_per_episode"], color=color, alpha=0.7, label=f"seed {s}")
    a.set(xlabel="PPO step", ylabel="train reward", title="same context budget: compaction vs truncation")
    b.set(xlabel="PPO step", ylabel="sub-traces per episode", title="compaction: sub-traces per episode")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
