"""bench/quant_sensitivity: where W4A8's error comes from on a run's generalist, to choose `quantize.int8_layers`.

The peer is the unquantized generalist itself: its greedy answers (48 new tokens) to the run's held-out prompts are
the reference, and each variant is scored on them teacher-forced, by the mean KL(generalist || variant) per answer
token and the share of positions where both pick the same next token. Variants:
- each part of W4A8 alone, rounded to nearest: int8 activations per token, int8 attention weights, int4 MLP weights
  (GLM-5: its routed experts) at `quantize.group_size`;
- the whole scheme rounded to nearest, and the run's own GPTQ export (the quantize stage's artifact);
- each decoder layer's int4 weights alone (`per_layer`): the layers to keep at int8 are those with the largest KL.

Prompts: the held-out everyday questions and IFBench prompts where the run scored them (a real chat model), else
each domain's test tasks.

    python -m bench.quant_sensitivity [--run RUN_ID]     (make bench B=quant_sensitivity, after a run)

BENCH_SMALL=1: the smoke run's checkpoints, 2 prompts, 8 new tokens.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from bench import mark, out_dir, size, small, smoke_report, threads
from bench._quant import act_int8, agreement, answer_logps

SMOKE_RUN = True
PROMPTS, NEW = size(16, 2), size(48, 8)  # per prompt set


def _prompt_sets(report: dict, tok) -> dict[str, list[list[int]]]:
    import environments
    from posttrain.chat import render_ids
    from posttrain.data import load_tasks
    gen = report["eval"].get("generalist", {})
    if "chat" in gen or "ifbench" in gen:
        sets = {"chat": environments.get("chat").generate()[:2 * PROMPTS]}
        if "ifbench" in gen:
            sets["ifbench"] = environments.get("ifbench").generate("test", PROMPTS)
        thinking = False
    else:
        curate = report["stages"]["curate"]["artifact"]
        sets = {d: load_tasks(curate, "test", d)[:PROMPTS] for d in gen if d.isidentifier()}  # the domain suites
        thinking = True
    return {k: [render_ids(tok, t.messages(), add_generation_prompt=True, enable_thinking=thinking) for t in ts]
            for k, ts in sets.items()}


def main(argv: list[str] | None = None) -> None:
    from posttrain.chat import chat_format
    from posttrain.config import QuantizeConfig
    from posttrain.engines.torch_rollout import sample
    from posttrain.models import moe
    from posttrain.pipeline.run import load_run
    from posttrain.quant.gptq import rtn
    from posttrain.quant.int_linear import load_any
    from posttrain.quant.scheme import SCALE_DTYPE, targets

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="latest", help="the run whose generalist and W4A8 export are compared")
    run = p.parse_args(argv if argv is not None else []).run  # `python -m bench` calls main() bare
    if small():
        path = smoke_report()
        report, group = json.loads(path.read_text()), json.loads((path.parent / "config.json").read_text())
        group = group["quantize"]["group_size"]
    else:
        report, cfg = load_run(run)
        group = cfg.quantize.group_size
    torch.set_num_threads(threads(2))
    model, tok = load_any(report["stages"]["opd"]["artifact"])
    moe.unfuse_experts(model.eval())
    qcfg = QuantizeConfig(group_size=group)
    fmt = chat_format(tok)
    sets = _prompt_sets(report, tok)
    t0 = time.perf_counter()
    rows = {k: [(pr, g.ids) for pr, g in zip(ps, sample(model, ps, max_new_tokens=NEW, temperature=0.0,
                                                        stop_ids=set(fmt.stop_ids), pad_id=fmt.pad_id))]
            for k, ps in sets.items()}
    ref = answer_logps(model, rows)

    def score(m) -> dict[str, dict[str, float]]:
        return agreement(ref, answer_logps(m, rows))

    def variant(parts: set[str], layer: int | None = None):
        m = copy.deepcopy(model)
        for name, (lin, bits, g) in targets(m, qcfg).items():
            part = "int4" if bits == 4 else "int8_weights"
            if part in parts and (layer is None or f"layers.{layer}." in name):
                q, s = rtn(lin.weight, bits, g, SCALE_DTYPE)
                lin.weight.data = (q.float().reshape(q.shape[0], -1, g) * s[..., None]).reshape(lin.weight.shape)
            if "act" in parts:
                lin.register_forward_pre_hook(act_int8)
        return m

    parts = {"int8 activations only": {"act"}, "int8 attention weights only": {"int8_weights"},
             f"int4 weights only (groups of {qcfg.group_size})": {"int4"},
             "W4A8 rounded to nearest": {"act", "int8_weights", "int4"}}
    fig = {k: score(variant(v)) for k, v in parts.items()}
    fig["W4A8 export (the run's GPTQ)"] = score(load_any(report["stages"]["quantize"]["artifact"])[0])
    for k, v in fig.items():
        print(f"bench/quant_sensitivity: {k}: {v}", flush=True)
    per_layer = {}
    for i in range(model.config.num_hidden_layers):
        per_layer[i] = score(variant({"int4"}, i))
        print(f"bench/quant_sensitivity: layer {i} int4 alone: {per_layer[i]}", flush=True)
    first = next(iter(ref))
    ranked = sorted(per_layer, key=lambda i: -per_layer[i][first]["kl"])
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_sensitivity.json").write_text(json.dumps(mark({
        "run": report["run_id"], "peer": "the unquantized generalist (its own greedy answers, teacher-forced)",
        "prompts": {k: len(v) for k, v in rows.items()}, "new_tokens": NEW, "group_size": qcfg.group_size,
        "parts": fig, "per_layer": per_layer, f"layers_by_{first}_kl": ranked,
        "seconds": round(time.perf_counter() - t0, 1)}), indent=1))
    print(f"bench/quant_sensitivity: layers by {first} KL, worst first: {ranked[:8]}; wrote "
          f"{out / 'quant_sensitivity.json'}")


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
