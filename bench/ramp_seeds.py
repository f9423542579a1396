"""bench/ramp_seeds: does the ramp's first rung form retrieval on every seed? (issue 68, item 4)

Per seed: the profile's curated data and that seed's base model (made once, shared by every variant but those
with `base.*` sets, which train their own), then the profile's first ramp rung alone, once per variant
(`--variant NAME=SET;SET...`, `--set`s on top of the profile); long_context accuracy at the rung's length after it,
the held-out short-text loss, and the training loss curve (`history`, for when retrieval formed: the long rows'
answer tokens weigh `ramp.long_loss_weight` in it).

    python -m bench.ramp_seeds --profile tiny --seeds 0 1 2 3 4 [--jobs 2] \
        [--variant 'lr2e-3=ramp.stages=[{seq_len: 256, tokens: 2048000, lr: 2.0e-3, rope_theta: 20000.0}]']

`--jobs 2` runs two rungs at once, one torch thread each (small matmuls: more throughput than two threads on one).
Results: .posttrain/bench/ramp_seeds.json, each rung cached under .posttrain/bench/ramp-seeds-work-PROFILE/.
BENCH_SMALL=1: the smoke-dense profile's first rung from the smoke run's base, seed 0 (wiring only).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean

from bench import out_dir, size

OUT = out_dir()


def first_rung(profile: str, extra: list[str]) -> list[str]:
    """`--set`s that keep only the profile's first rung (after `extra`, which may change it)."""
    from posttrain.config import load_config
    r = load_config(profile, extra).ramp
    st = r.stages[0]
    rung = [f"ramp.stages=[{json.dumps(st.model_dump(mode='json', exclude_defaults=True))}]"]
    # a profile that adopts DSA at a later rung trains its first one dense (tiny: sdpa, DSA at 512)
    return rung + (["ramp.attention=sdpa"] if r.attention == "dsa" and r.dsa_start() > st.seq_len else [])


def one(profile: str, seed: int, name: str, sets: list[str], work: Path) -> dict:
    """The first rung from `seed`'s base under variant `name`: its result (cached in work/)."""
    import torch

    from bench.dsa import tiny_inputs
    from posttrain.config import load_config
    from posttrain.stages import ramp
    out = work / f"ramp-{seed}-{name}"
    if (out / "result.json").exists():
        return json.loads((out / "result.json").read_text())
    torch.set_num_threads(int(os.environ.get("RAMP_SEEDS_THREADS", "2")))
    # a variant that sets base.* trains its own base model for the seed
    base_sets = [s for s in sets if s.startswith("base.")]
    cur, base = tiny_inputs(seed, profile, work, base_sets, name)
    cfg = load_config(profile, [f"seed={seed}", *sets, *first_rung(profile, sets)])
    L = cfg.ramp.stages[0].seq_len
    t = time.time()
    res = ramp.run(cfg, {"base": str(base), "curate": str(cur)}, out)
    m = {k: v for k, v in res["metrics"].items() if isinstance(v, (int, float))}
    m |= {"seconds": round(time.time() - t, 1), "loss_every_10": res["history"].get(f"loss@{L}", [])[::10]}
    (out / "result.json").write_text(json.dumps(m, indent=1))
    return m


def by_repeats(checkpoint: Path, seq_len: int, n: int = 256) -> dict:
    """long_context at `seq_len` of a rung's checkpoint on `n` test tasks, split by whether the code repeats a digit
    (a circuit that copies only the token after the last match would miss those)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from environments import long_context
    from posttrain.completion_eval import completion_scores
    from posttrain.stages.ramp import prose_lens
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tasks = long_context.fit_to_length("test", n, 0, seq_len, lambda ts: prose_lens(tok, ts, 24))
    with torch.no_grad():
        rewards, _ = completion_scores(model, tok, tasks, max_new_tokens=48, batch_size=32)
    out = {}
    for name, repeats in (("repeats", True), ("distinct", False)):
        xs = [r for r, t in zip(rewards, tasks) if (len(set(t.answer)) < len(t.answer)) == repeats]
        out[name] = {"tasks": len(xs), "long_context": round(sum(xs) / len(xs), 4)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ramp_seeds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=size("tiny", "smoke-dense"))
    ap.add_argument("--seeds", type=int, nargs="+", default=size([0, 1, 2, 3, 4], [0]))
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=SET;SET... (--set overrides for the rung); none: the profile's rung as it is "
                         "('profile=' names that among others)")
    ap.add_argument("--jobs", type=int, default=1, help="rungs at once (one torch thread each when > 1)")
    ap.add_argument("--repeats", action="store_true",
                    help="also score each rung on 256 test tasks, split by whether the code repeats a digit")
    ap.add_argument("--one", nargs=3, metavar=("SEED", "NAME", "SETS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv if argv is not None else [])  # `python -m bench` calls main() bare
    work = OUT / f"ramp-seeds-work-{args.profile}"
    work.mkdir(parents=True, exist_ok=True)
    if args.one:
        one(args.profile, int(args.one[0]), args.one[1], json.loads(args.one[2]), work)
        return
    variants = {v.split("=", 1)[0]: [s for s in v.split("=", 1)[1].split(";") if s] for v in args.variant} \
        or {"profile": []}
    from bench.dsa import tiny_inputs
    for seed in args.seeds:  # the seeds' bases first, alone: variants running at once would each build theirs
        for name, sets in variants.items():
            tiny_inputs(seed, args.profile, work, [s for s in sets if s.startswith("base.")], name)
    env = {"RAMP_SEEDS_THREADS": "1" if args.jobs > 1 else "2"} | os.environ

    def launch(job: tuple[int, str]) -> int:
        seed, name = job
        return subprocess.run([sys.executable, "-m", "bench.ramp_seeds", "--profile", args.profile, "--one",
                               str(seed), name, json.dumps(variants[name])], env=env).returncode
    todo = [(s, n) for s in args.seeds for n in variants]
    with ThreadPoolExecutor(args.jobs) as pool:
        failed = [j for j, rc in zip(todo, pool.map(launch, todo)) if rc]
    if failed:
        print(f"failed (seed, variant): {failed}", file=sys.stderr)
    from posttrain.config import load_config
    L = load_config(args.profile).ramp.stages[0].seq_len
    fig = {"profile": args.profile, "seq_len": L, "seeds": args.seeds, "variants": variants, "machine": os.uname().machine,
           "cpus": os.cpu_count(), "jobs": args.jobs}
    for name in variants:
        res = {}
        for s in args.seeds:
            p = work / f"ramp-{s}-{name}" / "result.json"
            if p.exists():
                res[s] = json.loads(p.read_text())
        acc = [round(r[f"ramp@{L}.long_context@{L}"], 4) for r in res.values()]
        fig[name] = {"long_context": acc, "mean": round(mean(acc), 4) if acc else None,
                     "formed": sum(a >= 0.7 for a in acc), "short_val_loss": [r[f"ramp@{L}.short_val_loss"]
                                                                            for r in res.values()],
                     "steps": [r[f"ramp@{L}.steps"] for r in res.values()],  # where a rung's early stop ended it
                     "seconds": [r["seconds"] for r in res.values()]}
        print(f"{name}: long_context@{L} per seed {acc}, formed (>= 0.7) on {fig[name]['formed']} of {len(acc)}")
        if args.repeats:
            fig[name]["by_repeats"] = {s: by_repeats(work / f"ramp-{s}-{name}", L) for s in res}
            print(f"{name}: by codes that repeat a digit or not, per seed: {fig[name]['by_repeats']}")
    path = OUT / "ramp_seeds.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(old | {args.profile: fig}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
