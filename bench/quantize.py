"""bench/quantize: the W4A8 export of the latest run against its unquantized generalist, and the run's
HTML report rendered in headless Chromium.

- bytes: linear-layer weights vs bf16, checkpoint on disk, model in memory (from the run's report);
- quality: greedy test score per suite, quantized minus generalist (from the run's report);
- speed: greedy generation tokens/s, integer kernels (posttrain/quant/int_linear.py) vs the fp32 model, the same
  prompts in the same process (batch 32 and batch 1), and prefill tokens/s (one forward over 8 prompts of 256
  tokens: what scoring long prompts, IFBench's or long context's, costs);
- rendering: a Chromium screenshot of report.html, with the share of the page that is ink (text, plots).
Run it after `make run`. BENCH_SMALL=1 (bench/__init__.py): the smoke run's checkpoints, 4 prompts, 8 new tokens;
without Chromium, the screenshot is skipped with a note."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench import mark, out_dir, size, small, smoke_report

OUT = out_dir()
SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
PROMPTS, NEW_TOKENS = size(32, 4), size(48, 8)
PREFILL_ROWS, PREFILL_LEN = size(8, 2), size(256, 32)


def _tokens_per_s(model, tok, prompts: list[list[int]], n_new: int) -> float:
    from posttrain.engines import as_rollout_engine
    engine = as_rollout_engine(model, tok)
    engine.generate(prompts[:2], max_new_tokens=4, temperature=0.0, stop_ids=set())  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=n_new, temperature=0.0, stop_ids=set())
    return sum(len(g.ids) for g in outs) / (time.perf_counter() - t0)


def _prefill_tokens_per_s(model, prompts: list[list[int]]) -> float:
    ids = torch.tensor([(p * (PREFILL_LEN // len(p) + 1))[:PREFILL_LEN] for p in prompts[:PREFILL_ROWS]])
    with torch.no_grad():
        model(ids[:1, :8])  # warm-up
        t0 = time.perf_counter()
        model(ids)
    return ids.numel() / (time.perf_counter() - t0)


def main() -> None:
    import matplotlib.image as mpimg

    from posttrain.pipeline import report_html
    from posttrain.chat import render_ids
    from posttrain.data import load_tasks
    from posttrain.quant.int_linear import load_any
    from posttrain.pipeline.run import load_run
    report = json.loads(smoke_report().read_text()) if small() else load_run("latest")[0]
    if "quantization" not in report or "report_html" not in report:
        raise SystemExit("bench/quantize needs a finished `make run` (report with quantization and report_html)")
    q, stages = report["quantization"], report["stages"]
    torch.set_num_threads(2)
    fp, tok = load_any(stages["opd"]["artifact"])
    qm, _ = load_any(stages["quantize"]["artifact"])
    tasks = load_tasks(stages["curate"]["artifact"], "test", "reasoning")[:PROMPTS]
    prompts = [render_ids(tok, t.messages(), add_generation_prompt=True) for t in tasks]
    speed = {}
    for label, batch in (("", prompts), ("_b1", prompts[:1])):
        speed[f"int_tokens_per_s{label}"] = _tokens_per_s(qm, tok, batch, NEW_TOKENS)
        speed[f"fp32_tokens_per_s{label}"] = _tokens_per_s(fp, tok, batch, NEW_TOKENS)
        speed[f"speed_ratio_vs_fp32{label}"] = speed[f"int_tokens_per_s{label}"] / speed[f"fp32_tokens_per_s{label}"]
    speed |= {"int_prefill_tokens_per_s": _prefill_tokens_per_s(qm, prompts),
              "fp32_prefill_tokens_per_s": _prefill_tokens_per_s(fp, prompts)}
    speed["prefill_ratio_vs_fp32"] = speed["int_prefill_tokens_per_s"] / speed["fp32_prefill_tokens_per_s"]
    ev = report["eval"]
    drop = {s: round(ev["generalist"][s] - ev["quantized"][s], 4) for s in ev["generalist"]}
    OUT.mkdir(parents=True, exist_ok=True)
    if small() and report_html.chromium() is None:
        print("bench/quantize: no Chromium on this machine: the report's screenshot is skipped in small mode",
              flush=True)
        shot = img = None
    else:
        shot = report_html.screenshot(Path(report["report_html"]), OUT / "report.png")
        img = mpimg.imread(shot)
    fig = {"run_id": report["run_id"], **{k: q[k] for k in ("linear_weight_bytes", "linear_weight_bytes_bf16",
                                                            "bytes_ratio_vs_bf16", "disk_bytes", "disk_bytes_unquantized",
                                                            "model_memory_bytes", "model_memory_bytes_unquantized",
                                                            "rss_growth_bytes", "rss_growth_bytes_unquantized",
                                                            "peak_rss_bytes", "peak_rss_bytes_unquantized")},
           "score_drop_vs_generalist": drop, "max_score_drop_vs_generalist": max(drop.values()),
           **{k: round(v, 3) for k, v in speed.items()},
           "report_screenshot": str(shot) if shot else None, "screenshot_px": list(img.shape[:2]) if shot else None,
           "screenshot_ink_share": round(float((img[..., :3].mean(-1) < 0.5).mean()), 4) if shot else None}
    fig = mark(fig)
    (OUT / "quantize.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    main()
