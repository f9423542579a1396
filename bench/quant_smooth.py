"""bench/quant_smooth: what `quantize.smooth` (activation-aware scales folded in before W4A8 rounding,
posttrain/quant/smooth.py) does to a real chat model, side by side with the same W4A8 without it.

The peer is the quantize stage's W4A8 at the profile's own settings (group size, int8 layers, calibration), without
smoothing. Every variant is calibrated in this process on the same calibration rows, from a copy of one checkpoint,
and scored against that checkpoint unquantized:
- KL(unquantized || variant) per answer token and the share of positions where both pick the same next token,
  teacher-forced on the unquantized model's own greedy answers (48 new tokens) to the held-out everyday questions
  (environments/chat.py) and 16 IFBench prompts;
- the held-out everyday questions' greedy score, thinking off: the suite W4A8 cost most on `small` (docs/small.md);
  with the share of questions answered token for token as unquantized, and how many right answers were lost and
  gained (at 47 questions one answer is 2 points).
Variants: round to nearest and GPTQ, each without and with smoothing, bf16 storage alone (what the export does to
the tensors it does not quantize: embeddings, head, norms), and the embedding and head at int8 besides (per row, as
an 8-bit export of them would store them; the export keeps them at 16 bits). A variant runs as the export computes on the integer
kernels (weights at their rounded values, int8 activations per token by hooks, the rest in bf16;
tests/test_quantize.py checks the kernels against that arithmetic).

    python -m bench.quant_smooth --checkpoint DIR --curate DIR [--profile small]
    python -m bench.quant_smooth [--run RUN]     (a run's generalist, calibrated on its curate artifact; default:
                                                 the latest run)

BENCH_SMALL=1: the smoke run's generalist, 4 questions, 8 new tokens, no IFBench.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from bench import mark, out_dir, size, small, smoke_report, threads
from bench._quant import act_int8, agreement, answer_logps, int8_rows

QUESTIONS, IFBENCH, NEW = size(47, 4), size(16, 0), size(48, 8)


def _inputs(argv: list[str]):
    from posttrain.config import load_config
    from posttrain.pipeline.run import load_run
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="latest", help="a run whose generalist (opd artifact) and curate artifact are used")
    p.add_argument("--checkpoint", help="a checkpoint folder to quantize (e.g. the small profile's base)")
    p.add_argument("--curate", help="the curate artifact the calibration conversations come from")
    p.add_argument("--profile", default="small", help="whose quantize settings and environments (with --checkpoint)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override the profile's config (with --checkpoint), e.g. quantize.calib_everyday=32")
    p.add_argument("--methods", default="rtn,gptq",
                   help="the rounding methods compared, each without and with smoothing ('' for none)")
    p.add_argument("--tag", default="", help="written to quant_smooth-TAG.json instead of quant_smooth.json")
    a = p.parse_args(argv)
    if small():
        report = json.loads(smoke_report().read_text())
        cfg = load_config("smoke-dense")
        return cfg, report["stages"]["opd"]["artifact"], report["stages"]["curate"]["artifact"], "smoke run", a
    if a.checkpoint or a.curate:
        if not (a.checkpoint and a.curate):
            p.error("--checkpoint and --curate go together (the calibration conversations come from --curate)")
        return load_config(a.profile, a.set), a.checkpoint, a.curate, a.checkpoint, a
    report, cfg = load_run(a.run)
    return cfg, report["stages"]["opd"]["artifact"], report["stages"]["curate"]["artifact"], report["run_id"], a


def main(argv: list[str] | None = None) -> None:
    import environments
    from posttrain.chat import chat_format, render_ids
    from posttrain.engines.torch_rollout import sample
    from posttrain.models.preset import load_checkpoint
    from posttrain.quant import smooth
    from posttrain.quant.scheme import SCALE_DTYPE
    from posttrain.stages.quantize import calibrate, calibration_rows, targets

    cfg, ckpt, curate, source, args = _inputs(argv if argv is not None else [])
    torch.set_num_threads(threads(2))
    model, tok = load_checkpoint(ckpt)
    model.eval()
    fmt = chat_format(tok)
    chat = environments.get("chat").generate()[:QUESTIONS]
    sets = {"chat": chat, **({"ifbench": environments.get("ifbench").generate("test", IFBENCH)} if IFBENCH else {})}
    prompts = {k: [render_ids(tok, t.messages(), add_generation_prompt=True, enable_thinking=False) for t in ts]
               for k, ts in sets.items()}
    rows = calibration_rows(cfg, curate, tok)

    def greedy(m, ps):
        return [g.ids for g in sample(m, ps, max_new_tokens=NEW, temperature=0.0, stop_ids=set(fmt.stop_ids),
                                      pad_id=fmt.pad_id)]

    def verdicts(answers) -> list[float]:
        verify = environments.get("chat").verify
        return [verify(t, tok.decode(a, skip_special_tokens=True))[0] for t, a in zip(chat, answers)]

    def chat_score(answers) -> float:
        return sum(verdicts(answers)) / len(chat)

    t0 = time.perf_counter()
    with torch.no_grad():
        answers = {k: greedy(model, ps) for k, ps in prompts.items()}
    answered = {k: list(zip(prompts[k], answers[k])) for k in prompts}
    ref = answer_logps(model, answered)

    def score(m) -> dict:
        out = agreement(ref, answer_logps(m, answered))
        with torch.no_grad():
            mine = greedy(m, prompts["chat"])
            ref_v, got_v = verdicts(answers["chat"]), verdicts(mine)
            out["chat_score"] = round(sum(got_v) / len(chat), 4)
            # which questions moved: a 47-question score cannot resolve 2 points, the answers themselves can
            out["chat_same_answer"] = round(sum(a == b for a, b in zip(mine, answers["chat"])) / len(chat), 4)
            out["chat_lost"] = sum(r > g for r, g in zip(ref_v, got_v))
            out["chat_gained"] = sum(g > r for r, g in zip(ref_v, got_v))
        return out

    def as_exported(m, quantized: set[int]) -> None:
        """The export's storage of everything it does not quantize (embeddings, head, norms): bf16."""
        for p in m.parameters():
            if id(p) not in quantized:
                p.data = p.data.to(SCALE_DTYPE).float()

    def embed_int8(m) -> None:
        """The input embedding and the head (one tensor where tied) rounded to int8 per row."""
        for w in {id(w): w for w in (m.get_input_embeddings().weight, m.get_output_embeddings().weight)}.values():
            w.data = int8_rows(w.data)

    fig = {"unquantized": {"chat_score": round(chat_score(answers["chat"]), 4)}}
    print(f"bench/quant_smooth: unquantized: {fig['unquantized']}", flush=True)
    m = copy.deepcopy(model)
    as_exported(m, set())
    fig["bf16 storage only (no W4A8)"] = score(m)
    print(f"bench/quant_smooth: bf16 storage only: {fig['bf16 storage only (no W4A8)']}", flush=True)
    embed_int8(m)
    fig["int8 embedding and head, the rest bf16 (no W4A8)"] = score(m)
    print(f"bench/quant_smooth: int8 embedding and head: {fig['int8 embedding and head, the rest bf16 (no W4A8)']}",
          flush=True)
    for method in filter(None, args.methods.split(",")):
        for smoothed in (False, True):
            name = f"{method}{' + smooth' if smoothed else ''}"
            qcfg = cfg.quantize.model_copy(update={"method": method, "smooth": smoothed})
            m = copy.deepcopy(model)
            t = time.perf_counter()
            records: list[dict] = []
            calibrate(m, rows, qcfg, smoothing=records)
            seconds = time.perf_counter() - t
            linears = [lin for lin, _, _ in targets(m, qcfg).values()]
            as_exported(m, {id(lin.weight) for lin in linears})
            for lin in linears:
                lin.register_forward_pre_hook(act_int8)
            fig[name] = {**score(m), "calibrate_s": round(seconds, 1),
                         **({"smoothing": smooth.summary(records)} if smoothed else {})}
            print(f"bench/quant_smooth: {name}: {fig[name]}", flush=True)
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"quant_smooth{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(mark({
        "checkpoint": source, "peer": "the same W4A8 without smoothing, calibrated alike in this process",
        "overrides": args.set,
        "quantize": cfg.quantize.model_dump(exclude={"smooth", "method"}), "calibration_tokens": rows.numel(),
        "prompts": {k: len(v) for k, v in prompts.items()}, "new_tokens": NEW, "threads": threads(2),
        "variants": fig, "seconds": round(time.perf_counter() - t0, 1)}), indent=1))
    print(f"bench/quant_smooth: wrote {path}")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
