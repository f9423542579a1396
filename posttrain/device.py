"""Where a stage's tensors live: `runtime.device` (auto | cpu | cuda; auto picks CUDA when present), reaching
the Ray tasks as POSTTRAIN_DEVICE. On CUDA, forward passes run under bf16 autocast while parameters,
optimizer state and the log-probability sums stay fp32."""
from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    import ray  # ray: only where the work spreads over Ray workers
    has = ray.cluster_resources().get("GPU", 0) > 0
    if setting == "cuda" and not has:
        raise RuntimeError("runtime.device is cuda but the Ray cluster has no GPU resources")
    return per_stage if has else 0.0


CPU_BF16 = "POSTTRAIN_CPU_BF16"  # "1" or "auto" from runtime.cpu_bf16, set in the stage's Ray runtime_env


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's flags that name bf16 or AMX (what a bench records of its machine)."""
    try:
        flags = next(x for x in Path(cpuinfo).read_text().splitlines() if x.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if "bf16" in f or f.startswith("amx"))


def native_cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it torch's CPU bf16 matmul is
    emulated: 9x slower than fp32 at SmolLM2's shapes on an AVX2-only AMD EPYC (2026-12-01)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_bf16_flags(cpuinfo)))


def cpu_bf16_on() -> bool:
    """runtime.cpu_bf16 as the stage's process sees it: true, or auto on a CPU with native bf16."""
    setting = os.environ.get(CPU_BF16, "0")
    if setting == "1" and not native_cpu_bf16():
        _say_emulated()
    return setting == "1" or setting == "auto" and native_cpu_bf16()


@functools.cache
def _say_emulated() -> None:
    print("runtime.cpu_bf16: true on a CPU without AVX512-BF16 or AMX: bf16 matmuls are emulated here, several times "
          "slower than fp32; set runtime.cpu_bf16: auto", flush=True)


def autocast(dev: torch.device):
    """What a training forward runs under: on CUDA bf16 autocast, and SDPA without cuDNN's kernel where its
    backward is not trusted (`cudnn_sdpa_trusted`); on CPU fp32 (the embedded default), or bf16 autocast with
    runtime.cpu_bf16 (1.65-2.19x the training tokens/s of SmolLM2-135M on an AVX512-BF16 Xeon: bench/cpu_bf16)."""
    if dev.type != "cuda":
        return torch.autocast("cpu", dtype=torch.bfloat16) if cpu_bf16_on() else contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
    if not cudnn_sdpa_trusted(torch.cuda.get_device_capability(dev)):
        # the backward follows the kernel the forward picked, so the forward's choice is enough
        stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
    return stack


CUDNN_SDPA = "POSTTRAIN_CUDNN_SDPA"  # 1: train through cuDNN's SDPA on Hopper anyway


def cudnn_sdpa_trusted(capability: tuple[int, int]) -> bool:
    """Whether training may use cuDNN's SDPA kernel on a GPU of this compute capability. Not on Hopper (9.x):
    there, with a mask, its backward returns NaN gradients for a query row whose logsumexp is below about -88.7
    (pytorch#196678; TRL's DPO hit it as huggingface/trl#7181): a fully masked row, such as the left padding of
    an RL batch's prompts, is one. On an H200 this turned GRPO and OPD updates of a padded sdpa policy to NaN
    (bench/cuda_shapes); without cuDNN they are finite. The memory-efficient kernel takes the masked calls."""
    return capability[0] != 9 or os.environ.get(CUDNN_SDPA) == "1"
