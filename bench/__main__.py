"""Run every benchmark under bench/ (modules with a `main()`), or the one named."""
from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    todo = argv or names()
    unknown = set(todo) - set(names())
    if unknown:
        print(f"unknown benchmark(s) {sorted(unknown)}; available: {names()}", file=sys.stderr)
        return 2
    if not todo:
        print("no benchmarks yet: each arrives with the issue that names its figures")
    for name in todo:
        print(f"== bench {name}")
        importlib.import_module(f"bench.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
