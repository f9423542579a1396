"""bench/sft: our SFT loop against TRL's SFTTrainer: same tiny model and initial weights, same batches in
the same order (TRL gets a sequential sampler over our batch order), same optimizer settings and schedule,
assistant-only loss on both, no validation on either side. Each side runs in its own process so peak RSS
is its own.

Settings on each side: ours fp32, no activation checkpointing (the pipeline's SFT). TRL at its best on
this machine, set explicitly (TRL 1.16 defaults to bf16 and gradient checkpointing; bf16 is ~3x slower on
this CPU and checkpointing recomputes activations): `bf16=False`, `gradient_checkpointing=False`, recorded
as `trl_config`. On the unpacked batches TRL runs twice, padded and with `padding_free=True` (one flat row
per batch; its sdpa then builds a block-diagonal mask over the whole row; `max_length=None` there, as TRL asks,
the inputs being truncated already), and the faster is its figure (`trl_padding_free` says which; both kept as
`tokens_per_s_trl_padded`, `_padding_free`). Beside it, labelled `_trl_defaults`, TRL with its own defaults
(bf16, checkpointing) on the padded unpacked batches (`BENCH_SFT_TRL_DEFAULTS=0` skips it).

Ours takes the unpacked batches as posttrain.stages.sft does (`posttrain.stages.sft.collator`): each batch one row of its
conversations with no padding, attention inside each (varlen_sdpa). It is measured twice: the bare loop
(`posttrain.train.train`, in process) and
through the path the pipeline uses, Ray Train (`posttrain.stages.sft._worker` under a `TorchTrainer`, one worker,
the profile's threads, fed the same batch order; no periodic checkpoints, only the final state report).
`throughput_ratio_vs_trl_raytrain` is the Ray Train figure over TRL's; its clock is the training loop
inside the worker (Ray start-up, model loading and the final state report to Ray Train excluded, as TRL's
side loads before its clock and saves nothing); `raytrain_checkpoint_seconds` is that report and
`raytrain_fit_seconds` the whole `fit()`.

Packed variant: the same conversations packed into rows of seq_len (best-fit decreasing), as `sft.packing`
feeds them: ours takes each batch's rows as one padding-free row (posttrain.stages.sft.collator), TRL's
`packing=True` (best-fit decreasing, padding-free); the conversations of the unpacked run spread over the same
number of steps, or over fewer, one row a step, where they fill fewer rows than steps (at the tiny profile's 1024
tokens they do: `steps_packed`), TRL given the same number of steps.

tokens/s counts the non-pad tokens of the batches over the training loop's wall time (model loading and
data preparation excluded on both sides), from the start of step WARMUP (BENCH_SFT_WARMUP, default 10) to the
end, on every side alike: the first steps carry one-off costs (allocator growth, Ray Train's helper actors
starting beside its worker) that a 1,500-step stage does not feel. The whole loop, warm-up included, is kept
beside it as `*_whole_loop`.

Every side runs BENCH_SFT_ROUNDS times (default 2), the sides interleaved (ours, TRL padded, TRL padding-free,
Ray Train, ours packed, TRL packed, again), and each side's fastest run is its figure: this machine's speed
drifts by 10-20% within minutes, and a single run per side measured the drift as much as the loops. Every run's
rate is kept (`tokens_per_s_rounds_<side>`).

mfu: achieved model FLOP/s (6 x params x tokens/s) over this machine's fp32 matmul peak, measured in the
same run with a large torch.mm.

BENCH_SMALL=1 (bench/__init__.py): 8 steps of 4 conversations (2 warm-up), one round, 60 tasks per domain, one
thread, every side; TRL's sides only where TRL is installed.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import mark, out_dir, peer, size, small

STEPS = int(os.environ.get("BENCH_SFT_STEPS", size(200, 8)))
WARMUP = int(os.environ.get("BENCH_SFT_WARMUP", size(10, 2)))  # steps before every side's clock starts
ROUNDS = int(os.environ.get("BENCH_SFT_ROUNDS", size(2, 1)))  # runs of each side, interleaved; the fastest counts
TRL_DEFAULTS = os.environ.get("BENCH_SFT_TRL_DEFAULTS", "1") != "0"
TASKS = size(600, 60)  # generated tasks per domain, the conversations drawn from them
# TRL's best settings on this machine, set explicitly (TRL 1.16 defaults: bf16=True, gradient_checkpointing=True)
TRL_BEST = {"bf16": False, "gradient_checkpointing": False}
OUT = out_dir()
WORK = OUT / "sft-work"


def _cfg():
    from posttrain.config import load_config
    # HF warms up from lr 0, ours from lr/warmup; small: 4 conversations a step (the profile's seq_len kept), 1 thread
    small_mode = ["sft.batch_size=4", "runtime.torch_threads=1"] if small() else []
    return load_config("tiny-dense", [f"sft.steps={STEPS}", "sft.warmup=0", *small_mode])


def _prepare() -> None:
    """The shared starting point: tokenizer, initial model and the batch order, on disk."""
    import random

    import torch

    import environments
    from posttrain.chat import train_tokenizer
    from posttrain.models.preset import build_model, save_checkpoint, seed_all
    from posttrain.stages.sft import build_examples
    cfg = _cfg()
    seed_all(cfg.seed)
    tasks = [t for d in environments.DOMAINS
             for t in environments.get(d).generate("train", TASKS, cfg.seed, **cfg.world.knobs())]
    tok = train_tokenizer([t.prompt + " " + json.dumps(t.demo) for t in tasks], cfg.tokenizer.vocab_size)
    model = build_model(cfg.model, tok)
    save_checkpoint(model, tok, WORK / "init")
    examples = build_examples(cfg, tok, tasks, cfg.seed)
    rng = random.Random(cfg.seed)
    order = [examples[rng.randrange(len(examples))] for _ in range(STEPS * cfg.sft.batch_size)]
    torch.save(order, WORK / "order.pt")


def _warmup(steps: int) -> int:
    """The steps before the clock starts: WARMUP, or half the loop where it is shorter (small mode's packed side)."""
    return min(WARMUP, steps // 2)


class _Clock:
    """The loop's wall time, whole and from the start of step `warm` (WARMUP: the same cut on every side)."""

    def __init__(self, warm: int = WARMUP):
        self.warm = warm

    def start(self) -> None:
        self.t0 = self.t_warm = time.perf_counter()

    def at_step(self, i: int) -> None:
        if i == self.warm:
            self.t_warm = time.perf_counter()

    def stop(self) -> dict:
        t = time.perf_counter()
        return {"seconds_whole": t - self.t0, "seconds": t - self.t_warm}


def _peak_matmul_flops() -> float:
    import torch
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    return 5 * 2 * 2048**3 / (time.perf_counter() - t)


def _packing(order, seq_len: int) -> tuple[int, int]:
    """(rows per step, steps) when packed: the batch order's conversations spread over STEPS steps, or over fewer,
    one row a step, where they fill fewer rows than that (the tiny profile's conversations, ~50 tokens, fill a
    1024-token row with ~20: 200 steps of 16 fill ~150 rows). Every step has rows: none trains on nothing."""
    from posttrain.packing import pack
    rows = len(pack(order, seq_len))
    n = max(1, rows // STEPS)
    return n, max(1, min(STEPS, rows // n))


def _tokens(order) -> int:
    return sum(len(ids) for ids, _ in order)


def _start():
    """Both sides start here: threads, seed, the shared initial model and batch order."""
    import torch

    from posttrain.models.preset import load_checkpoint
    cfg = _cfg()
    torch.set_num_threads(cfg.runtime.torch_threads)
    torch.manual_seed(cfg.seed)
    model, tok = load_checkpoint(WORK / "init")
    return cfg.sft, model, tok, torch.load(WORK / "order.pt")


def _ours(packed: bool = False) -> dict:
    from posttrain.packing import pack
    from posttrain.stages.sft import collator
    from posttrain.engines.torch_train import TorchTrainEngine
    from posttrain.train import train
    s, model, tok, order = _start()
    n, steps = _packing(order, s.seq_len) if packed else (s.batch_size, STEPS)
    rows = pack(order, s.seq_len)[:steps * n]
    to_batch = collator(tok, model, s.seq_len, packed)  # as posttrain.stages.sft's worker: padding-free where it can

    warm = _warmup(steps)
    clock = _Clock(warm)

    def next_batch(i: int):
        clock.at_step(i)
        return to_batch(rows[i * n:(i + 1) * n] if packed else order[i * s.batch_size:(i + 1) * s.batch_size])

    clock.start()
    engine = TorchTrainEngine.for_lm(model, lr=s.lr, weight_decay=s.weight_decay)
    hist = train(engine, next_batch, steps=steps, lr=s.lr, warmup=s.warmup, min_lr_ratio=s.min_lr_ratio,
                 grad_clip=s.grad_clip, desc="ours")
    tokens = [sum(len(x) for x, _ in row) for row in rows] if packed else [len(ids) for ids, _ in order]
    return {**clock.stop(), "loss": hist["loss"], "tokens": sum(tokens), "steps": steps,
            "tokens_steady": sum(tokens[warm * n:]), "params": sum(p.numel() for p in model.parameters())}


def _raytrain_worker(config: dict) -> None:
    """posttrain.stages.sft's Ray Train worker as the pipeline runs it, fed the bench's batch order, its loop timed."""
    import ray.train

    import posttrain.stages.sft as sft
    s = config["cfg"].sft

    clock = _Clock()

    def bench_batches(cfg, examples):  # the same conversations, in the same order, as the other sides
        def next_batch(i: int):
            clock.at_step(i)
            return examples[i * s.batch_size:(i + 1) * s.batch_size]
        return next_batch

    inner = sft.train

    def timed_train(*args, checkpoint, **kwargs):
        ckpt_s = [0.0]

        def timed_checkpoint(st: dict) -> None:  # the state report to Ray Train: timed apart (TRL saves nothing)
            t = time.perf_counter()
            checkpoint(st)
            ckpt_s[0] += time.perf_counter() - t

        clock.start()
        hist = inner(*args, checkpoint=timed_checkpoint, **kwargs)
        if ray.train.get_context().get_world_rank() == 0:
            times = {k: v - ckpt_s[0] for k, v in clock.stop().items()}
            Path(config["timing"]).write_text(json.dumps({
                **times, "checkpoint_seconds": ckpt_s[0], "loss": hist["loss"],
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
        return hist

    sft._batches, sft.train = bench_batches, timed_train
    sft._worker(config)


def _raytrain(packed: bool = False) -> dict:
    """Ours through Ray Train: the TorchTrainer call of posttrain.stages.sft.run, with the bench's model and batches."""
    import ray
    import torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from posttrain.pipeline.raysupport import ensure_ray
    cfg = _cfg()
    cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"checkpoint_every": 0})})
    s = cfg.sft
    assert not packed and s.grad_accum == 1, "the Ray Train side runs the unpacked batches, one micro-batch a step"
    order = torch.load(WORK / "order.pt")
    timing = (WORK / "raytrain.json").resolve()
    timing.unlink(missing_ok=True)
    shutil.rmtree(WORK / "ray", ignore_errors=True)  # Ray Train would resume from an earlier run's checkpoint
    ensure_ray(cfg.runtime)
    trainer = TorchTrainer(
        _raytrain_worker,
        train_loop_config={"cfg": cfg, "init": str((WORK / "init").resolve()), "examples": order, "val": [],
                           "threads": max(1, cfg.runtime.torch_threads // s.workers), "timing": str(timing)},
        scaling_config=ScalingConfig(num_workers=s.workers, use_gpu=False),
        run_config=RunConfig(name="bench-sft", storage_path=str((WORK / "ray").resolve()),
                             failure_config=FailureConfig(max_failures=0)))
    t = time.perf_counter()
    trainer.fit()
    fit_seconds = time.perf_counter() - t
    ray.shutdown()
    res = json.loads(timing.read_text())
    return {**res, "fit_seconds": fit_seconds, "tokens": _tokens(order),
            "tokens_steady": _tokens(order[WARMUP * s.batch_size:]), "workers": s.workers}


def _trl(packed: bool = False, defaults: bool = False, padding_free: bool = False) -> dict:
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    s, model, tok, order = _start()
    # pre-tokenized: TRL folds the assistant_masks column into the labels (assistant-only loss)
    data = Dataset.from_dict({"input_ids": [ids[:s.seq_len] for ids, _ in order],
                              "assistant_masks": [m[:s.seq_len] for _, m in order]})

    class InOrder(SFTTrainer):  # our batch order, not a reshuffle
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    # packed: TRL's best-fit-decreasing packing, padding-free (one flat row per batch, positions restart)
    # defaults: bf16 and gradient checkpointing left at TRL's own defaults (the labelled side figure)
    rows, steps = _packing(order, s.seq_len) if packed else (s.batch_size, STEPS)
    args = SFTConfig(**({} if defaults else TRL_BEST), output_dir=str(WORK / "trl"), max_steps=steps,
                     per_device_train_batch_size=rows,
                     packing=packed, **({"padding_free": True} if padding_free else {}),
                     learning_rate=s.lr, warmup_steps=s.warmup, lr_scheduler_type="cosine_with_min_lr",
                     lr_scheduler_kwargs={"min_lr_rate": s.min_lr_ratio}, weight_decay=s.weight_decay,
                     adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=s.grad_clip,
                     max_length=None if padding_free else s.seq_len, logging_steps=1, save_strategy="no",
                     report_to=[], use_cpu=True,
                     dataloader_num_workers=0, seed=_cfg().seed, disable_tqdm=True)
    warm = _warmup(steps)
    clock = _Clock(warm)

    class AtWarmup(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.at_step(state.global_step)

    trainer = InOrder(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[AtWarmup()])
    clock.start()
    trainer.train()
    times = clock.stop()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    lengths = [len(x) for x in trainer.train_dataset[:steps * rows]["input_ids"]] if packed else \
        [len(ids) for ids, _ in order]
    config = {k: getattr(args, k) for k in (
        "bf16", "fp16", "gradient_checkpointing", "activation_checkpointing", "packing", "packing_strategy",
        "use_liger_kernel", "torch_compile",
    )}  # as the trainer ran; padding-free is the trainer's decision (bfd packing turns it on)
    config["padding_free"] = getattr(trainer, "padding_free", args.padding_free)
    return {**times, "loss": loss, "tokens": sum(lengths), "tokens_steady": sum(lengths[warm * rows:]),
            "steps": steps, "trl_config": config}


def _rate(side: dict, whole: bool = False) -> float:
    """Non-pad tokens/s from step WARMUP on (`whole`: over the whole loop)."""
    return side["tokens"] / side["seconds_whole"] if whole else side["tokens_steady"] / side["seconds"]


def _child(side: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "bench.sft", *side.split()], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"bench.sft {side} failed:\n{p.stderr[-3000:]}")
    # the result is the last JSON line (Ray may forward worker output to stdout before it)
    return json.loads(next(x for x in reversed(p.stdout.strip().splitlines()) if x.startswith("{")))


def _last(loss: list[float], k: int) -> float:
    """The mean of the last k steps' losses (of all, where there are fewer)."""
    return round(sum(loss[-k:]) / len(loss[-k:]), 4)


def _ratio(a: float, b: float | None) -> float | None:
    return round(a / b, 3) if b else None


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    _prepare()
    with_trl = peer("trl", "sft")
    # each side ROUNDS times, the sides interleaved, and each side's fastest run is its figure: this machine's
    # speed drifts by 10-20% within minutes, and interleaving lets every side meet the same drift
    sides = {"ours": "_ours", "trl_padded": "_trl", "trl_padding_free": "_trl padding_free", "raytrain": "_raytrain",
             "ours_packed": "_ours packed", "trl_packed": "_trl packed"}
    if not with_trl:  # small mode without TRL installed: our sides alone
        sides = {k: v for k, v in sides.items() if not k.startswith("trl")}
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in range(ROUNDS):
        for k, arg in sides.items():
            runs[k].append(_child(arg))
    best = {k: max(v, key=_rate) for k, v in runs.items()}
    ours, ray_ours, ours_p, trl_p = best["ours"], best["raytrain"], best["ours_packed"], best.get("trl_packed")
    # TRL's best unpacked: padded, or padding-free (one flat row; its sdpa then masks the whole row)
    trl_unpacked = {"padded": best["trl_padded"], "padding_free": best["trl_padding_free"]} if with_trl else {}
    trl = max(trl_unpacked.values(), key=_rate) if with_trl else None
    trl_d = _child("_trl defaults") if TRL_DEFAULTS and with_trl else None
    peak = _peak_matmul_flops()
    k = min(10, STEPS)  # loss after n: the mean of the last k steps
    tps, tps_trl = _rate(ours), _rate(trl) if trl else None
    fig = {
        "steps": STEPS, "warmup_steps": WARMUP, "tokens_per_s": round(tps, 1),
        "loss_after_n": _last(ours["loss"], k), "peak_rss_mb": ours["peak_rss_mb"],
        "mfu": round(6 * ours["params"] * tps / peak, 4), "peak_matmul_gflops": round(peak / 1e9, 1),
        "params": ours["params"], "loss_first": round(ours["loss"][0], 4), "trl": with_trl,
    }
    if trl:
        fig |= {
            "tokens_per_s_trl": round(tps_trl, 1), "throughput_ratio_vs_trl": round(tps / tps_trl, 3),
            "loss_after_n_trl": _last(trl["loss"], k), "peak_rss_mb_trl": trl["peak_rss_mb"],
            "mfu_trl": round(6 * ours["params"] * tps_trl / peak, 4), "loss_first_trl": round(trl["loss"][0], 4),
            "trl_config": trl["trl_config"], "trl_bf16": trl["trl_config"]["bf16"],
            "trl_gradient_checkpointing": trl["trl_config"]["gradient_checkpointing"],
            "trl_padding_free": trl["trl_config"]["padding_free"],
            **{f"tokens_per_s_trl_{k}": round(_rate(v), 1) for k, v in trl_unpacked.items()},
        }
    tps_ray = _rate(ray_ours)
    fig |= {"tokens_per_s_raytrain": round(tps_ray, 1),
            "throughput_ratio_vs_trl_raytrain": _ratio(tps_ray, tps_trl),
            "loss_after_n_raytrain": _last(ray_ours["loss"], k),
            "peak_rss_mb_raytrain": ray_ours["peak_rss_mb"], "raytrain_fit_seconds": round(ray_ours["fit_seconds"], 2),
            "raytrain_checkpoint_seconds": round(ray_ours["checkpoint_seconds"], 3),
            "raytrain_workers": ray_ours["workers"]}
    tps_p = _rate(ours_p)
    fig |= {"tokens_per_s_packed": round(tps_p, 1), "steps_packed": ours_p["steps"],
            "loss_after_n_packed": _last(ours_p["loss"], k),
            "peak_rss_mb_packed": ours_p["peak_rss_mb"]}
    if trl_p:
        tps_trl_p = _rate(trl_p)
        fig |= {"tokens_per_s_trl_packed": round(tps_trl_p, 1),
                "throughput_ratio_vs_trl_packed": round(tps_p / tps_trl_p, 3),
                "loss_after_n_trl_packed": _last(trl_p["loss"], k),
                "peak_rss_mb_trl_packed": trl_p["peak_rss_mb"], "trl_config_packed": trl_p["trl_config"]}
    if trl_d:  # TRL at its own defaults (bf16, gradient checkpointing): a side figure, not the comparison
        tps_d = _rate(trl_d)
        fig |= {"trl_defaults_config": trl_d["trl_config"], "tokens_per_s_trl_defaults": round(tps_d, 1),
                "throughput_ratio_vs_trl_defaults": round(tps / tps_d, 3),
                "loss_after_n_trl_defaults": _last(trl_d["loss"], k),
                "peak_rss_mb_trl_defaults": trl_d["peak_rss_mb"]}
    # the whole loop, warm-up steps included
    whole = {"": ours, "_trl": trl, "_raytrain": ray_ours, "_packed": ours_p, "_trl_packed": trl_p}
    fig |= {f"tokens_per_s{k}_whole_loop": round(_rate(v, whole=True), 1) for k, v in whole.items() if v}
    if trl:
        fig |= {"throughput_ratio_vs_trl_whole_loop": round(_rate(ours, True) / _rate(trl, True), 3),
                "throughput_ratio_vs_trl_raytrain_whole_loop": round(_rate(ray_ours, True) / _rate(trl, True), 3)}
    fig |= {"rounds": ROUNDS, **{f"tokens_per_s_rounds_{k}": [round(_rate(r), 1) for r in v] for k, v in runs.items()}}
    fig = mark(fig)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "sft.json").write_text(json.dumps(fig, indent=1))
    print(json.dumps(fig, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("_ours", "_trl", "_raytrain"):
        from bench import sft as me  # by module name: Ray pickles `_raytrain_worker` by reference, not from __main__
        flags = sys.argv[2:]
        kwargs = {"packed": "packed" in flags, **{f: True for f in ("defaults", "padding_free") if f in flags}}
        res = getattr(me, sys.argv[1])(**kwargs)
        res.setdefault("peak_rss_mb", round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
        print(json.dumps(res))
    else:
        main()
