"""bench/retention_merge: averaging the generalist's weights with the base's, against the generalist alone.

Model averaging of the model before and after post-training (Lin et al. 2023, "Mitigating the alignment tax of RLHF";
WiSE-FT, Wortsman et al. 2022) trades what post-training added against what it cost, without training: the weights
(1 - w) * generalist + w * base for a few w. On `small`, sft costs SmolLM2 about half of its everyday answers and
nothing after it brings them back (docs/small.md). The peer is the generalist itself (w = 0); w = 1 is the base.

Each mix is scored as evaluate scores a chat checkpoint (greedy, thinking on for the domain suites, off for the
everyday questions) on the run's own test splits, in this process; the table gives what it keeps of the base's
everyday answers and of each specialist's gain over sft (the run's own evaluate figures for base, sft and the
specialists).

    python -m bench.retention_merge [--run RUN] [--weights 0,0.25,0.5]

BENCH_SMALL=1: the smoke run, 4 tasks a suite, weights 0 and 0.5.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import mark, out_dir, size, small, smoke_report, threads

SMOKE_RUN = True  # small mode starts from the smoke run (bench/__main__)
WEIGHTS, N = size("0,0.15,0.3,0.5", "0,0.5"), size(0, 4)
SUITES = ("reasoning", "agentic", "general", "chat")


def mixed(generalist: Path, base: Path, w: float, into: Path, only: str = "") -> Path:
    """A copy of the generalist's folder (config, tokenizer, template) averaged with the base (posttrain/merge.py)."""
    from posttrain.merge import average_with_base
    shutil.copytree(generalist, into, ignore=shutil.ignore_patterns("manifest.json", "*.png", "history.json"))
    try:
        average_with_base(into, base, w, only)
    except ValueError as e:
        raise SystemExit(f"retention_merge: {e}") from None
    return into


def main(argv: list[str] | None = None) -> None:
    from posttrain.config import load_config
    from posttrain.pipeline.run import load_run
    from posttrain.stages.evaluate import evaluate_checkpoint, suites
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="latest", help="the run whose base, generalist and test splits are used")
    p.add_argument("--weights", default=WEIGHTS, help="the base's shares w to score, comma-separated")
    p.add_argument("--only", default="", help="average only the tensors whose names this regular expression finds")
    p.add_argument("--tag", default="", help="written to retention_merge-TAG.json instead of retention_merge.json")
    a = p.parse_args(argv if argv is not None else [])
    if small():
        report, cfg = json.loads(smoke_report().read_text()), load_config("smoke-dense")
    else:
        report, cfg = load_run(a.run)
    torch.set_num_threads(threads(2))
    art = {s: Path(report["stages"][s]["artifact"]) for s in ("base", "opd", "curate")}
    tok = AutoTokenizer.from_pretrained(art["opd"])
    chosen = {k: v for k, v in suites(cfg, str(art["curate"]), tok).items() if k in SUITES}
    if N:
        chosen = {k: (v[0][:N], *v[1:]) for k, v in chosen.items()}
    ref = report["eval"]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for w in (float(x) for x in a.weights.split(",")):
            t = time.perf_counter()
            path = mixed(art["opd"], art["base"], w, Path(d) / f"w{w}", a.only)
            scores, tokens, _, _ = evaluate_checkpoint(cfg, str(path), chosen)
            shutil.rmtree(path)
            row = {"w": w, "scores": scores, "tokens": tokens, "seconds": round(time.perf_counter() - t, 1)}
            if "chat" in scores and ref.get("base", {}).get("chat"):
                row["chat_kept"] = round(scores["chat"] / ref["base"]["chat"], 3)
            for dom in ("reasoning", "agentic", "general"):
                gain = ref.get(f"specialist/{dom}", {}).get(dom, 0) - ref.get("sft", {}).get(dom, 0)
                if dom in scores and gain > 0:
                    row[f"{dom}_gain_kept"] = round((scores[dom] - ref["sft"][dom]) / gain, 3)
            rows.append(row)
            print(f"w={w}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
                  + "".join(f", {k} {row[k]}" for k in row if k.endswith("kept")) + f" ({row['seconds']} s)", flush=True)
    fig = mark({"run": report["run_id"], "profile": cfg.profile, "only": a.only, "suites": list(chosen),
                "tasks_per_suite": {k: len(v[0]) for k, v in chosen.items()},
                "reference": {ck: {s: ref.get(ck, {}).get(s) for s in SUITES} for ck in
                              ("base", "sft", "specialist/reasoning", "specialist/agentic", "specialist/general",
                               "generalist")},
                "rows": rows})
    out = out_dir() / f"retention_merge{'-' + a.tag if a.tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fig, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
