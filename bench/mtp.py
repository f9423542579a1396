"""bench/mtp: speculative decoding with the model's own MTP layer against plain decoding, on the same model.

The tiny profile with `mtp.depth=3` (`--set` of the same name): ramp and sft train the MTP layer as their auxiliary
loss (the curated data and the base model are bench/dsa's). Then, on the sft checkpoint, one rollout engine decodes
with and without its drafts (`engine.speculative`), alternating, `REPEATS` times each:
- evaluation: greedy episodes on every domain's test split, thinking on, at `eval.batch_size` and one at a time
  (a single stream, where drafting matters most); the outputs must be identical;
- RL rollouts: `rl.prompts_per_step` prompts x `rl.group_size` samples at `rl.temperature`, as the rollout workers
  generate them (speculative sampling keeps the distribution, not the draws).
Generated tokens/s count every emitted token over the episodes' wall time (environment steps included, the same in
both modes); acceptance length is tokens per model forward after the first token (at most depth + 1).

    python -m bench.mtp [--seed 0]     (make bench B=mtp)
    python -m bench.mtp --checkpoint DIR --curate DIR     (an existing MTP checkpoint, e.g. on a GPU machine)
    python -m bench.mtp ... --sweep     (also greedy evaluation at batch sizes 1-64, plain and with drafts)
    BENCH_MTP_REPEATS=N     (default 2)

BENCH_SMALL=1 (bench/__init__.py): the smoke profile's ramp and sft with MTP from the smoke run's curated data and
base model, one repeat, 2 batch-1 episodes per domain, one thread; the sweep (--sweep) at batch sizes 1 and 2.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from statistics import mean

from bench import mark, out_dir, size, threads
from bench.dsa import WORK, tiny_inputs

OUT = out_dir()
SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
PROFILE = size("tiny-dense", "smoke-dense")
DEPTH = 3
REPEATS = int(os.environ.get("BENCH_MTP_REPEATS", size(2, 1)))
SINGLE = size(8, 2)  # batch-1 episodes per domain


def trained(seed: int) -> tuple[Path, Path, dict]:
    """The sft checkpoint of the tiny ramp + sft with MTP (resumable per stage), and their MTP metrics."""
    from posttrain.stages import ramp
    from posttrain.stages import sft
    from posttrain.config import load_config
    from posttrain.pipeline.raysupport import ensure_ray
    cfg = load_config(PROFILE, [f"seed={seed}", f"mtp.depth={DEPTH}"])
    ensure_ray(cfg.runtime)  # sft trains on Ray Train
    cur, base = (p.resolve() for p in tiny_inputs(seed))  # Ray Train's workers run elsewhere
    work = WORK.resolve()
    metrics = {}
    for name, fn, inputs in (("ramp", ramp.run, {"base": str(base), "curate": str(cur)}),
                             ("sft", sft.run, {"ramp": str(work / f"mtp-{seed}-ramp"), "curate": str(cur)})):
        out = work / f"mtp-{seed}-{name}"
        if not (out / "result.json").exists():
            t = time.time()
            res = fn(cfg, inputs, out, scratch=str(work / f"mtp-{seed}-{name}-scratch"))
            m = {k: v for k, v in res["metrics"].items() if isinstance(v, (int, float))}
            (out / "result.json").write_text(json.dumps({**m, "seconds": round(time.time() - t, 1)}, indent=1))
        m = json.loads((out / "result.json").read_text())
        metrics.update({f"{name}.{k}": v for k, v in m.items() if "mtp" in k or k == "seconds"})
    return work / f"mtp-{seed}-sft", cur, metrics


def _measure(engine, tok, tasks, **kw) -> tuple[list, float, int, dict]:
    from posttrain.rl.rollout import run_episodes
    engine.stats = {}
    t = time.perf_counter()
    eps = run_episodes(engine, tok, tasks, **kw)
    return eps, time.perf_counter() - t, sum(e.n_generated for e in eps), dict(engine.stats)


def compare(engine, tok, tasks, **kw) -> dict:
    """Plain and speculative decoding of `tasks`, alternating after a warm-up of each; tokens/s (mean of the
    repeats), acceptance, and whether every episode's tokens matched (meaningful for greedy decoding)."""
    import torch

    def once(spec: bool) -> tuple:
        engine.speculative = spec
        gen = torch.Generator().manual_seed(0) if kw.get("temperature", 0) > 0 else None
        return _measure(engine, tok, tasks, generator=gen, **kw)

    for spec in (False, True):  # a warm-up of each, not counted: a GPU's first calls pay for loading kernels
        once(spec)
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(REPEATS):
        for spec in (False, True):
            runs[spec].append(once(spec))
    engine.speculative = True
    plain, mtp = (mean(n / s for _, s, n, _ in runs[b]) for b in (False, True))
    st = runs[True][-1][3]
    return {"tokens_per_s_plain": round(plain, 1), "tokens_per_s_mtp": round(mtp, 1),
            "speedup": round(mtp / plain, 3), "acceptance_length": round(st["accepted"] / st["verifications"], 3),
            # greedy must match token for token; sampled runs draw differently by design
            "identical": all(a.ids == b.ids for a, b in zip(runs[False][0][0], runs[True][0][0]))
            if kw.get("temperature", 0) <= 0 else None,
            "episodes": len(tasks), "generated_tokens": runs[True][0][2]}


SWEEP = size((1, 2, 4, 8, 16, 32, 64), (1, 2))


def sweep(engine, tok, tasks, **kw) -> list[dict]:
    """Greedy tokens/s plain and with drafts at each batch size of SWEEP over `tasks`: where drafting pays on this
    device (best of two alternating runs each; episodes' environment steps included, as in `compare`)."""
    rows = []
    for bs in SWEEP:
        best = {False: 0.0, True: 0.0}
        for spec in (True, False, True, False):
            engine.speculative = spec
            _, s, n, _ = _measure(engine, tok, tasks, temperature=0.0, batch_size=bs, **kw)
            best[spec] = max(best[spec], n / s)
        rows.append({"batch_size": bs, "tokens_per_s_plain": round(best[False], 1),
                     "tokens_per_s_mtp": round(best[True], 1), "speedup": round(best[True] / best[False], 3)})
        print("sweep", rows[-1], flush=True)
    engine.speculative = True
    return rows


def measure(seed: int, checkpoint: Path | None = None, curate: Path | None = None, batch_sweep: bool = False
            ) -> dict:
    """Plain against speculative decoding on the tiny sft checkpoint trained with MTP for `seed`, or on
    `checkpoint` (an MTP checkpoint, e.g. bench/mtp's own carried to a GPU machine) with `curate`'s test tasks."""
    import torch

    from posttrain.config import load_config
    from posttrain.data import load_tasks
    from posttrain.device import device
    from posttrain.engines import rollout_engine
    torch.set_num_threads(threads(2))
    cfg = load_config(PROFILE, [f"seed={seed}", f"mtp.depth={DEPTH}"])
    path, cur, metrics = (checkpoint, curate, {}) if checkpoint else trained(seed)
    engine = rollout_engine("torch", path)
    tok = engine.tokenizer
    domains = cfg.rl.domains
    test = [t for d in domains for t in load_tasks(cur, "test", d)]
    single = [t for d in domains for t in load_tasks(cur, "test", d)[:SINGLE]]
    prompts = [t for d in domains for t in load_tasks(cur, "rl", d)[:max(1, cfg.rl.prompts_per_step // len(domains))]]
    common = {"max_new_tokens": cfg.eval.max_new_tokens, "max_turns": cfg.rl.max_turns}
    dev = device()
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    fig = {"profile": PROFILE, "device": where, "checkpoint": str(path), "seed": seed, "depth": DEPTH,
           "repeats": REPEATS, **metrics}
    fig["evaluate"] = compare(engine, tok, test, temperature=0.0, batch_size=cfg.eval.batch_size, **common)
    fig["evaluate_batch_1"] = compare(engine, tok, single, temperature=0.0, batch_size=1, **common)
    fig["rl_rollouts"] = compare(engine, tok, [t for t in prompts for _ in range(cfg.rl.group_size)],
                                 temperature=cfg.rl.temperature, batch_size=len(prompts) * cfg.rl.group_size,
                                 **{**common, "max_new_tokens": cfg.rl.max_new_tokens})
    if batch_sweep:
        fig["batch_sweep"] = sweep(engine, tok, test, **common)
    e = fig["evaluate"]
    fig.update(acceptance_length=e["acceptance_length"], tokens_per_s_plain=e["tokens_per_s_plain"],
               tokens_per_s_mtp=e["tokens_per_s_mtp"],
               greedy_identical=e["identical"] and fig["evaluate_batch_1"]["identical"])
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.mtp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", type=Path, help="measure this MTP checkpoint instead of training one")
    ap.add_argument("--curate", type=Path, help="with --checkpoint: the curated data whose test tasks it decodes")
    ap.add_argument("--sweep", action="store_true",
                    help=f"also greedy evaluation at batch sizes {', '.join(map(str, SWEEP))}: where drafting pays")
    args = ap.parse_args(argv if argv is not None else [])
    if bool(args.checkpoint) != bool(args.curate):
        ap.error("--checkpoint and --curate go together")
    fig = mark(measure(args.seed, args.checkpoint, args.curate, args.sweep))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mtp.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
