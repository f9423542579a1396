"""quantize: W4A8. int4 group-wise weights for the MLP blocks, int8 per-channel weights for the attention
projections, int8 per-token dynamic activations. Rounding is GPTQ on calibration activations from
curated SFT conversations, layer by layer (each layer calibrated on the outputs of the already
quantized layers before it). Exported with compressed-tensors (mixed-precision: pack-quantized MLP,
int-quantized attention, bf16 scales): the format vLLM loads as CompressedTensorsW4A8Int and
CompressedTensorsW8A8Int8. Our own evaluation runs it on CPU through posttrain/quant/int_linear.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import apply_quantization_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import environments
from posttrain.chat import render_ids
from posttrain.config import PipelineConfig, QuantizeConfig
from posttrain import replay
from posttrain.data import load_tasks
from posttrain.models import moe, mtp
from posttrain.models.glm5 import is_glm5
from posttrain.models.preset import load_checkpoint, seed_all
from posttrain.pipeline.artifacts import TIMINGS
from posttrain.pipeline.console import kv
from posttrain.quant.gptq import HessianTracker, gptq, rtn
from posttrain.quant.int_linear import load_compressed
from posttrain.quant import smooth
from posttrain.quant.layerwise import layer_inputs, through
from posttrain.quant.scheme import SCALE_DTYPE, scheme, targets
from posttrain.tools import loadcheck


def calibration_rows(cfg: PipelineConfig, curate_dir: str, tok) -> torch.Tensor:
    """`calib_samples` SFT conversations (domains interleaved, thinking on) and `calib_everyday` everyday
    instructions (thinking off), concatenated and cut into rows."""
    per = [load_tasks(curate_dir, "sft", d) for d in environments.names(cfg.world.environments)]
    tasks = [t for group in zip(*per) for t in group][: cfg.quantize.calib_samples]
    convs = [render_ids(tok, t.messages() + t.demo) for t in tasks]
    everyday = [render_ids(tok, [{"role": "user", "content": p}], add_generation_prompt=True, enable_thinking=False)
                for p in replay.PROMPTS[:cfg.quantize.calib_everyday]]
    every, mixed = max(1, len(convs) // max(1, len(everyday))), []
    for i, conv in enumerate(convs):  # spread through the stream, not a block at its end
        mixed.append(conv)
        if i % every == 0 and i // every < len(everyday):
            mixed.append(everyday[i // every])
    stream = [i for ids in mixed for i in ids]
    L = min(cfg.quantize.calib_seq_len, len(stream))
    return torch.tensor(stream[: len(stream) // L * L]).reshape(-1, L)


@torch.no_grad()
def calibrate(model, rows: torch.Tensor, qcfg: QuantizeConfig, batch: int = 8,
              smoothing: list[dict] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantize every target layer by layer; returns name -> (int8 q, float32 scales). The model's weights
    are left at their quantized values, and each layer is calibrated on its quantized predecessors' outputs:
    the calibration activations pass through one decoder layer at a time (a whole forward per layer made the
    forwards quadratic in depth). With `quantize.smooth`, each layer's scales are searched and folded in first
    (posttrain/quant/smooth.py); their records are appended to `smoothing`."""
    found, result, glm = targets(model, qcfg), {}, is_glm5(model)
    layerwise = qcfg.method == "gptq" or qcfg.smooth
    hidden, kwargs = layer_inputs(model, rows, batch) if layerwise else ([], [])
    for li, layer in enumerate(tqdm(model.model.layers, desc=qcfg.method + (" + smooth" if qcfg.smooth else ""))):
        if qcfg.smooth:
            records = smooth.smooth_layer(layer, li, found, glm, hidden, kwargs, qcfg.act_bits)
            if smoothing is not None:
                smoothing.extend(records)
        mine = {n: m for n, (m, _, _) in found.items() if any(m is x for x in layer.modules())}
        if qcfg.method == "gptq":
            tracker = HessianTracker(mine)
            for h, kw in zip(hidden, kwargs):
                through(layer, h, kw[li])
            hessians = tracker.close()
        for name, m in mine.items():
            _, bits, g = found[name]
            # an expert no calibration token was routed to has no Hessian to round against: GPTQ would zero it
            seen = qcfg.method == "gptq" and bool(torch.diag(hessians[name]).any())
            q, s = (gptq(m.weight, hessians[name], bits, g, SCALE_DTYPE, qcfg.dampening) if seen
                    else rtn(m.weight, bits, g, SCALE_DTYPE))
            m.weight.copy_((q.float().reshape(q.shape[0], -1, g) * s[..., None]).reshape(q.shape))
            result[name] = (q, s)
        if layerwise:
            hidden = [through(layer, h, kw[li]) for h, kw in zip(hidden, kwargs)]  # the next layer's inputs
    return result


def export(model, tok, ints: dict[str, tuple[torch.Tensor, torch.Tensor]], qcfg: QuantizeConfig, out: Path) -> None:
    """Attach the scales to the compressed-tensors scheme, let it pack and save; check the ints survive."""
    apply_quantization_config(model, scheme(qcfg, is_glm5(model)))
    for name, (q, s) in ints.items():
        m = model.get_submodule(name)
        m.weight_scale.data = s.reshape(m.weight_scale.shape).to(m.weight_scale.dtype)
        m.weight_zero_point.data.zero_()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.to(SCALE_DTYPE)
    for _, router in moe.routers(model):  # GLM-5's balancing bias stays fp32, as GLM-5 stores it
        router.e_score_correction_bias.data = router.e_score_correction_bias.float()
    model.save_pretrained(out)
    if is_glm5(model) and mtp.get(model) is not None:  # the draft layer (unquantized) where GLM-5 keeps it
        tensors = mtp.glm5_state(model, load_file(str(out / "model.safetensors")))
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(str(out))
    tok.save_pretrained(out)
    reloaded, _ = load_compressed(out)
    for name, (q, _) in ints.items():
        if not torch.equal(reloaded.get_submodule(name).qweight_t.t(), q):
            raise RuntimeError(f"{out}: {name}'s integers changed in the export")


def linear_bytes(path: Path, names: list[str]) -> int:
    """Bytes the named layers take in the export: packed integers, scales, shapes."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys() if k.rsplit(".", 1)[0] in names)


def load_checks(paths: list[str | Path], prompt: str) -> list[dict]:
    """Load each of `paths` in a fresh Python process, generate, and report its memory (posttrain/tools/loadcheck.py;
    imported here so that its code is part of this stage's cache key). The processes run at once: each measures
    only itself, and most of their time is their imports."""
    procs = [subprocess.Popen([sys.executable, "-m", loadcheck.__name__, str(p), prompt], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for p in paths]
    out = []
    try:
        for path, proc in zip(paths, procs):
            try:
                stdout, stderr = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"loading {path} in a fresh process took over 600 s") from None
            if proc.returncode:
                raise RuntimeError(f"loading {path} in a fresh process failed:\n{stderr[-2000:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:  # a failed check leaves none of the others running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    seed_all(cfg.seed)
    model, tok = load_checkpoint(inputs["opd"])
    moe.unfuse_experts(model)  # GLM-5: each routed expert its own Linears, calibrated on the tokens routed to it
    rows = calibration_rows(cfg, inputs["curate"], tok)
    bf16_bytes = sum(m.weight.numel() * 2 for m, _, _ in targets(model, cfg.quantize).values())
    smoothing: list[dict] = []
    ints = calibrate(model, rows, cfg.quantize, smoothing=smoothing)
    export(model, tok, ints, cfg.quantize, out)
    prompt = load_tasks(inputs["curate"], "test", environments.names(cfg.world.environments)[0])[0].prompt
    fresh, fresh_fp = load_checks([out, inputs["opd"]], prompt)
    q_bytes = linear_bytes(out, list(ints))
    metrics = {
        "format": (f"compressed-tensors mixed-precision: routed experts pack-quantized int4 (group "
                   f"{cfg.quantize.group_size}), attention, dense MLP and shared expert int-quantized int8 per "
                   f"channel, int8 per-token activations" if is_glm5(model) else
                   f"compressed-tensors mixed-precision: MLP pack-quantized int4 (group {cfg.quantize.group_size}), "
                   f"attention int-quantized int8 per channel, int8 per-token activations"),
        "method": cfg.quantize.method + (" + smooth" if cfg.quantize.smooth else ""),
        **({"smoothing": smooth.summary(smoothing)} if cfg.quantize.smooth else {}),
        "calibration_tokens": rows.numel(), "quantized_linears": len(ints),
        "linear_weight_bytes": q_bytes, "linear_weight_bytes_bf16": bf16_bytes,
        "bytes_ratio_vs_bf16": round(q_bytes / bf16_bytes, 4),
        "disk_bytes": (out / "model.safetensors").stat().st_size,
        "disk_bytes_unquantized": (Path(inputs["opd"]) / "model.safetensors").stat().st_size,
        "model_memory_bytes": fresh["model_bytes"], "model_memory_bytes_unquantized": fresh_fp["model_bytes"],
        "fresh_process_generated_tokens": fresh["generated_tokens"], "fresh_process_text": fresh["text"],
    }
    (out / "quantization.json").write_text(json.dumps(metrics, indent=1))  # report.json's "quantization"
    if smoothing:  # each fold's alpha and rounded-output error, for whoever wants the layer-by-layer picture
        (out / "smoothing.json").write_text(json.dumps(smoothing, indent=1))
    # what the process measured changes from run to run: beside the digest, not in it (posttrain.pipeline.artifacts)
    measured = {"rss_growth_bytes": fresh["rss_growth_bytes"], "rss_growth_bytes_unquantized": fresh_fp["rss_growth_bytes"],
                "peak_rss_bytes": fresh["peak_rss_bytes"], "peak_rss_bytes_unquantized": fresh_fp["peak_rss_bytes"]}
    (out / TIMINGS).write_text(json.dumps(measured, indent=1))
    metrics |= measured
    print(f"[quantize] {kv({k: v for k, v in metrics.items() if k != 'fresh_process_text'})}", flush=True)
    return {"metrics": metrics}
