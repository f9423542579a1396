"""A ramp rung through the megatron train engine (runtime.train_engine megatron), on one rank in this process or over
tp x pp x cp ranks (`megatron.tp`, `megatron.pp`, the rung's `cp` or else `megatron.cp`): Ray Train workers as in sft, every rank
running the same loop on the same packed rows (the ranks hold one replica, so they see one batch), the rung's
weights gathered and saved by rank 0.
Context parallelism is what the long rungs need: each rank holds 1/cp of every sequence's activations."""
from __future__ import annotations

import gc
import json
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from posttrain.config import PipelineConfig, RampStage
from posttrain.models.preset import load_checkpoint, save_checkpoint
from posttrain.train import train


def _engine(cfg: PipelineConfig, path: str, kw: dict, cp: int, indexers: tuple | None):
    """`indexers`: (mode, kl_queries, kl_weight) while DSA's indexers train; the warm-up trains nothing else, so
    the experts' bias and the draft (MTP) layer stay too."""
    from posttrain.engines.megatron_setup import Parallel
    from posttrain.engines.megatron_train import MegatronTrainEngine
    g = cfg.megatron
    warmup = indexers is not None and indexers[0] == "warmup"
    return MegatronTrainEngine(path, lr=kw["lr"], parallel=Parallel(g.tp, g.pp, cp, g.ep, g.sequence_parallel),
                               weight_decay=kw.get("weight_decay", 0.0), seed=cfg.seed,
                               recompute=g.recompute or cfg.ramp.activation_checkpointing,
                               moe=None if warmup else cfg.moe, distributed_optimizer=g.distributed_optimizer,
                               micro_batches=g.micro_batches, train_indexers=indexers,
                               mtp_weight=0.0 if warmup else cfg.mtp.loss_weight)


def _worker(c: dict) -> None:
    """One rank: the rung's checkpoint from Ray's object store (the driver's disk may be another node's), the rung's
    loop, then (every rank gathering its shards) rank 0 reports the weights and history as the run's checkpoint."""
    import ray
    import ray.train
    torch.set_num_threads(c["threads"])
    with tempfile.TemporaryDirectory() as init, tempfile.TemporaryDirectory() as out:
        for name, data in ray.get(c["init"]).items():
            (Path(init) / name).write_bytes(data)
        engine = _engine(c["cfg"], init, c["kw"], c["cp"], c["indexers"])
        hist = train(engine, c["next_batch"], **c["kw"])
        model = engine.hf_model()  # a collective over the tensor-parallel ranks
        first = ray.train.get_context().get_world_rank() == 0
        if first:
            save_checkpoint(model, c["tok"], out)
            (Path(out) / "history.json").write_text(json.dumps(hist))
        ray.train.report({"steps": len(hist["loss"])},
                         checkpoint=ray.train.Checkpoint.from_directory(out) if first else None)


def train_rung(cfg: PipelineConfig, model, tok, next_batch: Callable[[int], dict], kw: dict,
               stage: RampStage, indexers: tuple[str, int, float] | None = None) -> tuple[dict, object]:
    """(the rung's history, the model holding its trained weights) after `train(engine, next_batch, **kw)` over
    megatron's tp x pp and the rung's context-parallel ranks (`PipelineConfig.ramp_ranks`); with `indexers`
    (`MegatronTrainEngine`'s `train_indexers`) GLM-5's DSA indexers train too, or alone in the warm-up."""
    cp, ranks = stage.cp or cfg.megatron.cp, cfg.ramp_ranks(stage)
    with tempfile.TemporaryDirectory(prefix="posttrain-ramp-megatron-") as d, \
            tempfile.TemporaryDirectory(prefix="posttrain-ramp-train-") as storage:
        save_checkpoint(model, tok, d)  # the rung's RoPE and weights, as the engine loads them
        if ranks == 1:
            engine = _engine(cfg, d, kw, cp, indexers)
            return train(engine, next_batch, **kw), engine.hf_model()
        import ray
        files = ray.put({f.name: f.read_bytes() for f in Path(d).iterdir() if f.is_file()})
        result = _over_ranks(cfg, ranks, storage, {
            "cfg": cfg, "init": files, "tok": tok, "kw": kw, "next_batch": next_batch, "cp": cp, "indexers": indexers,
            "threads": max(1, cfg.runtime.torch_threads // ranks)})
        with result.checkpoint.as_directory() as out:
            trained, _ = load_checkpoint(out)
            return json.loads((Path(out) / "history.json").read_text()), trained


def _over_ranks(cfg: PipelineConfig, ranks: int, scratch: str, config: dict):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from posttrain.device import stage_gpus
    from posttrain.pipeline.store import train_storage
    storage, filesystem = train_storage(scratch)  # the stage's scratch in the store when it is remote
    trainer = TorchTrainer(
        _worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=ranks,
                                     use_gpu=stage_gpus(cfg.runtime.device, cfg.runtime.gpus_per_stage) > 0),
        run_config=RunConfig(name=f"ramp-{config['kw']['desc'].split('@')[-1]}", storage_path=storage,
                             storage_filesystem=filesystem, failure_config=FailureConfig(max_failures=0)))
    sigint = signal.getsignal(signal.SIGINT)  # as in sft: fit() installs a handler that keeps its controller alive
    try:
        return trainer.fit()
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, sigint)
        del trainer
        gc.collect()
