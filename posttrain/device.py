"""Where a stage's tensors live: `runtime.device` (auto | cpu | cuda; auto picks CUDA when present), reaching
the Ray tasks as POSTTRAIN_DEVICE. On CUDA, forward passes run under bf16 autocast while parameters,
optimizer state and the log-probability sums stay fp32."""
from __future__ import annotations

import contextlib
import os

import torch

ENV = "POSTTRAIN_DEVICE"  # the stage's Ray task has it from runtime.device


def device() -> torch.device:
    want = os.environ.get(ENV, "auto")
    if want == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(f"{ENV}=cuda (runtime.device) but torch sees no CUDA device here "
                           f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible!r})")
    return torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")


def stage_gpus(setting: str, per_stage: float) -> float:
    """Ray GPUs a stage's task reserves: Ray hides the GPUs from a task that asks for none."""
    if setting == "cpu":
        return 0.0
    import ray
    has = ray.cluster_resources().get("GPU", 0) > 0
    if setting == "cuda" and not has:
        raise RuntimeError("runtime.device is cuda but the Ray cluster has no GPU resources")
    return per_stage if has else 0.0


def autocast(dev: torch.device):
    """bf16 autocast on CUDA; nothing on CPU (the embedded default computes in fp32, as it always has)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
