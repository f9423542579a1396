"""A ramp rung through the run's train engine (posttrain.engines.lm_engine), on one rank in this process or over as many
ranks as the engine lays the rung out on (posttrain.engines.registry.ranks: megatron's tp x pp x the rung's cp x ep):
Ray Train workers as in sft, every rank running the same loop on the same packed rows (the ranks hold one replica,
so they see one batch), the rung's weights gathered and saved by rank 0.
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
from posttrain.device import stage_gpus
from posttrain.engines import lm_engine, registry
from posttrain.models.preset import load_checkpoint, save_checkpoint
from posttrain.pipeline.store import train_storage
from posttrain.train import train


def _train(cfg: PipelineConfig, model, tok, checkpoint: str | None, next_batch: Callable[[int], dict], kw: dict,
           cp: int | None, job: dict) -> tuple[dict, torch.nn.Module]:
    engine = lm_engine(cfg, model, tok, checkpoint, lr=kw["lr"], cp=cp, **job)
    try:
        hist = train(engine, next_batch, **kw)
        return hist, engine.hf_model()  # a collective over the ranks that hold shards of it
    finally:
        engine.close()


def _worker(c: dict) -> None:
    """One rank: the rung's checkpoint from Ray's object store (the driver's disk may be another node's), the rung's
    loop, then rank 0 reports the weights and history as the run's checkpoint."""
    import ray  # ray: only where the work spreads over Ray workers
    import ray.train
    torch.set_num_threads(c["threads"])
    with tempfile.TemporaryDirectory() as init, tempfile.TemporaryDirectory() as out:
        for name, data in ray.get(c["init"]).items():
            (Path(init) / name).write_bytes(data)
        # no model: the engine loads the checkpoint itself, as it holds it (megatron: this rank's shards)
        hist, model = _train(c["cfg"], None, c["tok"], init, c["next_batch"], c["kw"], c["cp"], c["job"])
        first = ray.train.get_context().get_world_rank() == 0
        if first:
            save_checkpoint(model, c["tok"], out)
            (Path(out) / "history.json").write_text(json.dumps(hist))
        ray.train.report({"steps": len(hist["loss"])},
                         checkpoint=ray.train.Checkpoint.from_directory(out) if first else None)


def train_rung(cfg: PipelineConfig, model, tok, next_batch: Callable[[int], dict], kw: dict,
               stage: RampStage, job: dict) -> tuple[dict, torch.nn.Module]:
    """(the rung's history, the model holding its trained weights) after `train(engine, next_batch, **kw)`, the
    engine from `lm_engine(cfg, model, tok, **job)` on one rank here or on each of the rung's ranks."""
    ranks = registry.ranks(cfg, "ramp", stage.cp)
    if ranks == 1:
        return _train(cfg, model, tok, None, next_batch, kw, stage.cp, job)
    import ray  # ray: only where the work spreads over Ray workers
    with tempfile.TemporaryDirectory(prefix="posttrain-ramp-ranks-") as d, \
            tempfile.TemporaryDirectory(prefix="posttrain-ramp-train-") as storage:
        save_checkpoint(model, tok, d)  # the rung's RoPE and weights, as each rank loads them
        files = ray.put({f.name: f.read_bytes() for f in Path(d).iterdir() if f.is_file()})
        result = _over_ranks(cfg, ranks, storage, {
            "cfg": cfg, "init": files, "tok": tok, "kw": kw, "next_batch": next_batch, "cp": stage.cp, "job": job,
            "threads": max(1, cfg.runtime.torch_threads // ranks)})
        with result.checkpoint.as_directory() as out:
            trained, _ = load_checkpoint(out)
            return json.loads((Path(out) / "history.json").read_text()), trained


def _over_ranks(cfg: PipelineConfig, ranks: int, scratch: str, config: dict):
    from ray.train import FailureConfig, RunConfig, ScalingConfig  # ray: only where the work spreads over Ray workers
    from ray.train.torch import TorchTrainer

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
