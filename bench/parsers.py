"""bench/parsers: the agentic environment's parsers and guard rules on the inputs a review found super-linear, at
doubling sizes, beside the regular expressions they replaced (the peer: the same job done the old way, in the same
process). Each row is timed as the best of REPEATS; its growth exponent is the least-squares slope of log(seconds)
over log(characters) across the sizes (1: linear, 2: quadratic). The old form stops doubling after the first size
that took it over OLD_STOP_S (the cubic one takes minutes at 8k).

Figures: `<case>_exponent` and `<case>_old_exponent`, `<case>_s_at_<n>` and `<case>_old_s_at_<n>` at the largest size
both ran, `<case>_speedup_at_<n>` (old / ours), and `max_exponent` over our cases."""
from __future__ import annotations

import json
import math
import re
import time

from bench import mark, out_dir, size
from environments import agentic, base, sandbox

SIZES = size([1000, 2000, 4000, 8000, 16000, 32000, 64000], [1000, 2000, 4000])
OLD_STOP_S = size(0.5, 0.05)
REPEATS = size(5, 2)

_OLD_URL = re.compile(r"[a-z][a-z0-9+.-]*://|\b(curl|wget|ftp|scp|nc|ssh)\b", re.I)
_OLD_CALL = re.compile(r"<tool_call>\s*([^<]*?)\s*</tool_call>")
_OLD_THINK = re.compile(r"<think>.*?</think>", re.S)
_OLD_NUMBER = re.compile(r"\s*([+-]?\d+)\s*\.?\s*")

# case -> (input of n characters, ours, the old form)
CASES = {
    # the URL rule on a long run of scheme-like characters (rules run on capped input: the pattern alone here)
    "url_rule": (lambda n: "a" * n, lambda x: sandbox.RULES[1][0].search(x), lambda x: _OLD_URL.search(x)),
    "tool_call_whitespace": (lambda n: "<tool_call>" + "\n" * n, agentic.parse_tool_call, lambda x: _OLD_CALL.search(x)),
    "think_tags": (lambda n: "<think>" * (n // 7), base.final_answer, lambda x: _OLD_THINK.sub("", x)),
    "number_spaces": (lambda n: "1" + " " * n + "x", lambda x: re.fullmatch(r"([+-]?\d+)\s*\.?", x.strip()),
                      lambda x: _OLD_NUMBER.fullmatch(x)),
    "json_nesting": (lambda n: '<tool_call>{"name": "read", "arguments": ' + "[" * n + "</tool_call>",
                     agentic.parse_tool_call, None),
}


def _best(fn, x) -> float:
    best = math.inf
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-7)


def _slope(xs: list[int], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    fig: dict = {"sizes": SIZES, "old_stop_s": OLD_STOP_S, "repeats": REPEATS}
    for name, (make, ours, old) in CASES.items():
        ours_s = [_best(ours, make(n)) for n in SIZES]
        fig[f"{name}_exponent"] = round(_slope(SIZES, ours_s), 2)
        line = f"{name}: ours " + " ".join(f"{n}:{s * 1e3:.3f}ms" for n, s in zip(SIZES, ours_s))
        if old is not None:
            old_sizes, old_s = [], []
            for n in SIZES:
                old_sizes.append(n)
                old_s.append(_best(old, make(n)))
                if old_s[-1] > OLD_STOP_S and len(old_s) >= 2:  # two sizes at least, for a slope
                    break
            top = old_sizes[-1]
            fig[f"{name}_old_exponent"] = round(_slope(old_sizes, old_s), 2)
            fig[f"{name}_s_at_{top}"] = ours_s[SIZES.index(top)]
            fig[f"{name}_old_s_at_{top}"] = old_s[-1]
            fig[f"{name}_speedup_at_{top}"] = round(old_s[-1] / ours_s[SIZES.index(top)], 1)
            line += f" | old " + " ".join(f"{n}:{s * 1e3:.3f}ms" for n, s in zip(old_sizes, old_s))
        print(line, flush=True)
    fig["max_exponent"] = max(v for k, v in fig.items() if k.endswith("_exponent") and "_old_" not in k)
    print({k: v for k, v in fig.items() if k.endswith("exponent") or "speedup" in k}, flush=True)
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "parsers.json").write_text(json.dumps(mark(fig), indent=1))
