"""Run every benchmark under bench/ (modules with a `main()`), or the ones named. `BENCH_SMALL=1`: each at its small
size (bench/__init__.py); every one runs even after one fails, the failures listed at the end (exit status 1)."""
from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import traceback
from pathlib import Path

from bench import small, smoke_report


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
    modules = {name: importlib.import_module(f"bench.{name}") for name in todo}
    if small() and any(getattr(m, "SMOKE_RUN", False) for m in modules.values()):
        # the checkpoints those benchmarks start from, made once and timed apart from them
        t = time.perf_counter()
        print(f"== smoke run (small mode's checkpoints): {smoke_report()}", flush=True)
        print(f"== smoke run: {time.perf_counter() - t:.1f} s", flush=True)
    failed: list[str] = []
    for name, module in modules.items():
        print(f"== bench {name}", flush=True)
        t = time.perf_counter()
        if not small():
            module.main()
            continue
        try:
            module.main()
        except (Exception, SystemExit) as e:  # small mode checks them all: say which fail, then go on
            if not (isinstance(e, SystemExit) and e.code in (None, 0)):
                traceback.print_exc()
                failed.append(f"{name} ({type(e).__name__}: {str(e)[:200]})")
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():  # kept up between a benchmark's runs
            sys.modules["ray"].shutdown()
        print(f"== bench {name}: {'FAILED, ' if failed and failed[-1].startswith(name + ' ') else ''}"
              f"{time.perf_counter() - t:.1f} s", flush=True)
    if failed:
        print(f"bench (small) failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
