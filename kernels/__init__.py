"""Triton kernels, each beside its plain-torch reference.

- `kernels.logprob`: hidden states x output head -> log-probability of the target token and entropy, chunked
  over tokens (and the vocabulary inside the kernels), never the whole [tokens, vocab] logits.
- `kernels.reverse_kl`: the full-vocabulary reverse KL(student || teacher) with the same chunking.
- `kernels.w4a8`: int4 group-quantized weights (compressed-tensors packing) x int8 per-token activations.

The Triton paths run on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (how the tests check
them against the references on a machine without a GPU). Elsewhere the same chunked algorithms run their
row operations in torch.
"""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether kernels run in Triton for tensors like `t`: on CUDA, or anywhere under the interpreter."""
    return _has_triton() and (t.is_cuda or interpreting())


def jit_cache(build):
    """Build a module's Triton kernels on first use (importing triton only where a kernel runs). The
    interpreter mode is fixed when triton is first imported: set TRITON_INTERPRET before the process starts
    (`kernels.selfcheck` runs in a child process for this reason)."""
    return functools.cache(build)
