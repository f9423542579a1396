"""A ramp rung through the megatron train engine (runtime.train_engine megatron), on one rank in this process or over
the tp x cp ranks `megatron` asks for: Ray Train workers as in sft, every rank running the same loop on the same
packed rows (the ranks hold one replica, so they see one batch), the rung's weights gathered and saved by rank 0.
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

from posttrain.config import PipelineConfig
from posttrain.models.preset import load_checkpoint, save_checkpoint
from posttrain.train import train


def _engine(cfg: PipelineConfig, path: str, lr: float):
    from posttrain.engines.megatron_setup import Parallel
    from posttrain.engines.megatron_train import MegatronTrainEngine
    g = cfg.megatron
    return MegatronTrainEngine(path, lr=lr, parallel=Parallel(g.tp, g.pp, g.cp, g.ep, g.sequence_parallel),
                               weight_decay=cfg.ramp.weight_decay, seed=cfg.seed,
                               recompute=g.recompute or cfg.ramp.activation_checkpointing)


def _worker(c: dict) -> None:
    """One rank: the rung's loop, then (every rank gathering its shards) rank 0 saves the weights and history."""
    import ray.train
    torch.set_num_threads(c["threads"])
    engine = _engine(c["cfg"], c["init"], c["kw"]["lr"])
    hist = train(engine, c["next_batch"], **c["kw"])
    model = engine.hf_model()  # a collective over the tensor-parallel ranks
    if ray.train.get_context().get_world_rank() == 0:
        _, tok = load_checkpoint(c["init"])
        save_checkpoint(model, tok, c["out"])
        (Path(c["out"]) / "history.json").write_text(json.dumps(hist))


def train_rung(cfg: PipelineConfig, model, tok, next_batch: Callable[[int], dict], kw: dict) -> tuple[dict, object]:
    """(the rung's history, the model holding its trained weights) after `train(engine, next_batch, **kw)`."""
    g = cfg.megatron
    ranks = g.tp * g.pp * g.cp
    with tempfile.TemporaryDirectory(prefix="posttrain-ramp-megatron-") as d:
        init, out = str(Path(d) / "in"), str(Path(d) / "out")
        save_checkpoint(model, tok, init)  # the rung's RoPE and weights, as the engine loads them
        if ranks == 1:
            engine = _engine(cfg, init, kw["lr"])
            return train(engine, next_batch, **kw), engine.hf_model()
        _over_ranks(cfg, ranks, {"cfg": cfg, "init": init, "out": out, "kw": kw, "next_batch": next_batch,
                                 "threads": max(1, cfg.runtime.torch_threads // ranks)}, d)
        trained, _ = load_checkpoint(out)
        return json.loads((Path(out) / "history.json").read_text()), trained


def _over_ranks(cfg: PipelineConfig, ranks: int, config: dict, storage: str) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from posttrain.device import stage_gpus
    trainer = TorchTrainer(
        _worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=ranks,
                                     use_gpu=stage_gpus(cfg.runtime.device, cfg.runtime.gpus_per_stage) > 0),
        run_config=RunConfig(name="ramp-rung", storage_path=storage, failure_config=FailureConfig(max_failures=0)))
    sigint = signal.getsignal(signal.SIGINT)  # as in sft: fit() installs a handler that keeps its controller alive
    try:
        trainer.fit()
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, sigint)
        del trainer
        gc.collect()
