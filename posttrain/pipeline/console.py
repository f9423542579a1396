"""What the pipeline prints: metrics as `key value` pairs a person reads, not Python dicts."""
from __future__ import annotations

import re

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def kv(metrics: dict) -> str:
    """`loss_first 5.5, steps 2, long_context@64 0` from {"loss_first": 5.500240087509155, ...}."""
    def show(v) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, dict):
            return "{" + kv(v) + "}"
        return str(v)
    return ", ".join(f"{k} {show(v)}" for k, v in metrics.items())
