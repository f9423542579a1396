"""`posttrain figures`: the pipeline over several training seeds on the same data, and what each stage did,
as means with their spread. The README's tables are pasted from the `figures.md` this writes.

`seed` varies everything downstream of curate (initial weights, data order, sampling); `world.seed` (the
data, the splits, the test sets) stays the profile's, so raw and curate run once and are cached after.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import zlib
from pathlib import Path
from statistics import mean

import numpy as np

from posttrain.pipeline import report_html
from posttrain.pipeline.artifacts import atomic_write_text
from posttrain.pipeline.run import home_dir

# what the embedded default must show in the mean over seeds (issue 17): the bar each claim is held to
CLAIMS = {"thinking_delta": 0.10, "gain": 0.05, "retention": 0.90, "quant_drop_max": 0.02,
          # the registered (quantized) model at the ramp's top length; a real chat model's everyday answers
          # (eval.chat_suite) kept through post-training, as a share of its own score before it
          "long_context": 0.70, "chat_retention": 0.90}
THINKING_DOMAINS = ("reasoning", "agentic")  # where thinking must pay: general's constraints need no steps
DRAWS = 2000  # resamplings of each suite's test items for a claim's interval


class SeedFailed(RuntimeError):
    """One seed's run failed; its own error is printed above."""


def run_seeds(profile: str, seeds: list[int], overrides: list[str]) -> list[Path]:
    """One `posttrain run` per seed, in this POSTTRAIN_HOME; returns each run's report.json."""
    reports = []
    for i, seed in enumerate(seeds):
        print(f"== figures: seed {seed} ({i + 1} of {len(seeds)})", flush=True)
        args = [sys.executable, "-m", "posttrain.cli", "run", "--profile", profile,
                *(x for kv in [*overrides, f"seed={seed}"] for x in ("--set", kv))]
        p = subprocess.run(args, env=os.environ.copy())
        if p.returncode != 0:
            raise SeedFailed(f"the run for seed {seed} failed (exit {p.returncode}); "
                               f"command: {' '.join(args[1:])}")
        run_id = json.loads((home_dir() / "latest" / "report.json").read_text())["run_id"]
        reports.append(home_dir() / "runs" / run_id / "report.json")
    return reports


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": round(mean(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def aggregate(reports: list[dict]) -> dict:
    """figures.json from finished runs' reports (each with `eval` and `stages`)."""
    if not reports:
        raise ValueError("no reports to aggregate")
    ev = [r["eval"] for r in reports]
    cks = [c for c in ev[0] if all(c in e for e in ev)]
    out: dict = {"seeds": [r.get("seed") for r in reports], "runs": [r["run_id"] for r in reports],
                 "profile": reports[0]["profile"],
                 "eval": {c: {s: _spread([e[c][s] for e in ev]) for s in ev[0][c] if all(s in e[c] for e in ev)}
                          for c in cks}}

    def m(ck: str, suite: str) -> float:
        return out["eval"][ck][suite]["mean"]

    # the run's RL domains: one specialist checkpoint each
    doms = [c.split("/", 1)[1] for c in out["eval"] if c.startswith("specialist/") and "sft" in out["eval"]]
    per_seed_gain = {d: [e[f"specialist/{d}"][d] - e["sft"][d] for e in ev] for d in doms}
    out["gain"] = {d: round(mean(g), 4) for d, g in per_seed_gain.items()}
    out["gain_spread"] = {d: _spread(g) for d, g in per_seed_gain.items()}
    if "generalist" in out["eval"]:
        # the generalist's mean gain over the specialist's: a ratio of means, since a per-seed ratio of two
        # small gains can be anything
        out["retention"] = {d: round((m("generalist", d) - m("sft", d)) / g, 4) if g > 0 else None
                            for d, g in out["gain"].items()}
        out["retention_per_seed"] = {d: [round((e["generalist"][d] - e["sft"][d]) / x, 4) if x > 0 else None
                                         for e, x in zip(ev, per_seed_gain[d])] for d in doms}
    if {"generalist", "quantized"} <= set(out["eval"]):
        drops = {s: round(m("generalist", s) - m("quantized", s), 4) for s in out["eval"]["quantized"]
                 if s in out["eval"]["generalist"]}
        out["quant_drop"] = drops
        out["quant_drop_max"] = max(drops.values())
    if "sft" in out["eval"]:
        sft = out["eval"]["sft"]
        out["thinking_delta"] = {d: round(mean(e["sft"][d] - e["sft"][f"{d}:nothink"] for e in ev), 4)
                                 for d in sft if f"{d}:nothink" in sft}
        tok = [r.get("tokens", {}).get("sft", {}) for r in reports]
        out["thinking_tokens"] = {d: {"on": round(mean(t[d] for t in tok), 1),
                                      "off": round(mean(t[f"{d}:nothink"] for t in tok), 1)}
                                  for d in out["thinking_delta"] if all(d in t and f"{d}:nothink" in t for t in tok)}
    lengths = [int(x.split("@")[1]) for x in out["eval"].get("quantized", {}) if x.startswith("long_context@")]
    if lengths:
        top = f"long_context@{max(lengths)}"
        out["long_context_top"] = {"length": max(lengths), "value": m("quantized", top),
                                   "min": out["eval"]["quantized"][top]["min"]}
    moe = [r.get("moe", {}) for r in reports]  # GLM-5's routers: load balance and routing replay, per stage
    # a stage some reports lack (a `posttrain rerun` reports only the nodes it ran): over those that have it, counted
    for s in dict.fromkeys(k for x in moe for k in x):
        have = [x[s] for x in moe if s in x]
        v = {k: round(mean(h[k] for h in have), 5) for k in have[0] if all(k in h for h in have)}
        out.setdefault("moe", {})[s] = v | ({"runs": len(have)} if len(have) < len(moe) else {})
    if "chat" in out["eval"].get("base", {}):
        before = m("base", "chat")
        out["chat_retention"] = {c: round(m(c, "chat") / before, 4) if before > 0 else None
                                 for c in cks if c != "base" and "chat" in out["eval"][c]}
    if {"base", "generalist"} <= set(out["eval"]):
        # what a real chat model knew before post-training, on suites nobody trains on (held-out chat, IFBench, the
        # reasoning-gym types): the generalist's mean as a share of the base's, where the base scores above 0
        kept = [s for s in out["eval"]["base"] if (s in ("chat", "ifbench") or s.startswith("rg/"))
                and s in out["eval"]["generalist"] and m("base", s) > 0]
        out["base_retention"] = {s: round(m("generalist", s) / m("base", s), 4) for s in kept}
    # a cached stage did no work in that run: its seconds come from the runs that computed it
    secs: dict[str, list[float]] = {}
    for r in reports:
        for s, v in r["stages"].items():
            if not v.get("cached"):
                secs.setdefault(s, []).append(v["seconds"])
    out["wall_seconds"] = {s: round(mean(v), 1) for s, v in secs.items()}
    out["wall_seconds"]["run"] = round(mean(r["wall_seconds"] for r in reports), 1)
    out["claims"] = claims(out, resampled(reports))
    out["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"
    return out


def resampled(reports: list[dict], draws: int = DRAWS) -> dict[tuple[str, str], np.ndarray]:
    """Each checkpoint's score on each suite, per seed, on `draws` resamplings of the suite's test items, as
    seeds x draws. The same items are drawn for every checkpoint, seed and thinking mode of a suite, so differences
    stay paired; the spread left is how far another draw of test questions could move a figure (a 47-question suite
    moves a score by 2.1 points a question). Empty where a report has no per-item scores (runs before 2026-11-30)."""
    items = [r.get("items") or {} for r in reports]
    out, drawn = {}, {}
    for ck, suites in items[0].items():
        for s, first in suites.items():
            rows = [it.get(ck, {}).get(s) for it in items]
            if not first or any(r is None or len(r) != len(first) for r in rows):
                continue
            key = (s.removesuffix(":nothink"), len(first))
            if key not in drawn:  # seeded by the suite's name: the same draws in every figures.json
                rng = np.random.default_rng(zlib.crc32(key[0].encode()))
                drawn[key] = rng.integers(0, len(first), size=(draws, len(first)))
            out[ck, s] = np.asarray(rows, dtype=np.float64)[:, drawn[key]].mean(-1)
    return out


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / b, np.nan)


def _row(claim: str, value: float | None, bar: float, draws: np.ndarray | None = None, at_most: bool = False) -> dict:
    """A claim held to its bar by the mean; with the claim's statistic on resampled items, its 95% interval and
    whether that interval is clear of the bar (otherwise the test items cannot tell the verdict from chance)."""
    row = {"claim": claim, "value": value,
           "holds": value is not None and (value <= bar if at_most else value >= bar)}
    if draws is not None and np.isfinite(draws).any():
        lo, hi = (float(x) for x in np.nanquantile(draws, [0.025, 0.975]))
        row["interval"] = [round(lo, 4), round(hi, 4)]
        row["clear"] = (hi <= bar or lo > bar) if at_most else (lo >= bar or hi < bar)
    return row


def claims(f: dict, boot: dict[tuple[str, str], np.ndarray] | None = None) -> list[dict]:
    """Each claim about the pipeline with the mean it rests on and whether it holds; with `boot` (resampled()),
    each claim's interval over resampled test items."""
    b = boot or {}

    def draws(fn, *keys: tuple[str, str]) -> np.ndarray | None:
        return fn(*(b[k] for k in keys)) if all(k in b for k in keys) else None

    rows = []
    for d, v in f.get("thinking_delta", {}).items():
        if d in THINKING_DOMAINS:
            rows.append(_row(f"sft: thinking on beats off on {d} by >= {CLAIMS['thinking_delta']:.2f}", v,
                             CLAIMS["thinking_delta"],
                             draws(lambda on, off: (on - off).mean(0), ("sft", d), ("sft", f"{d}:nothink"))))
    for d, v in f.get("gain", {}).items():
        rows.append(_row(f"specialist/{d} gains >= {CLAIMS['gain']:.2f} over sft on {d}", v, CLAIMS["gain"],
                         draws(lambda sp, sf: (sp - sf).mean(0), (f"specialist/{d}", d), ("sft", d))))
    for d, v in f.get("gain_spread", {}).items():
        rows.append(_row(f"specialist/{d} gains >= {CLAIMS['gain']:.2f} over sft on {d} on every seed", v["min"],
                         CLAIMS["gain"], draws(lambda sp, sf: (sp - sf).min(0), (f"specialist/{d}", d), ("sft", d))))
    for s, v in f.get("base_retention", {}).items():
        rows.append(_row(f"generalist keeps >= {CLAIMS['retention']:.0%} of the base's {s} score", v,
                         CLAIMS["retention"],
                         draws(lambda g, base: _ratio(g.mean(0), base.mean(0)), ("generalist", s), ("base", s))))
    for d, v in f.get("retention", {}).items():
        rows.append(_row(f"generalist keeps >= {CLAIMS['retention']:.0%} of the {d} gain", v, CLAIMS["retention"],
                         draws(lambda g, sp, sf: _ratio(g.mean(0) - sf.mean(0), sp.mean(0) - sf.mean(0)),
                               ("generalist", d), (f"specialist/{d}", d), ("sft", d))))
    if "long_context_top" in f:
        v, bar = f["long_context_top"], CLAIMS["long_context"]
        top = ("quantized", f"long_context@{v['length']}")
        rows.append(_row(f"quantized scores >= {bar:.2f} on long_context@{v['length']} (the ramp's top length)",
                         v["value"], bar, draws(lambda q: q.mean(0), top)))
        if "min" in v:
            rows.append(_row(f"quantized scores >= {bar:.2f} on long_context@{v['length']} on every seed", v["min"],
                             bar, draws(lambda q: q.min(0), top)))
    def over(v: dict) -> str:
        return f" (the {v['runs']} of {len(f['runs'])} runs that ran it)" if "runs" in v else ""
    if "moe_cv_last" in (m := f.get("moe", {}).get("base", {})) and m.get("moe_cv_first"):
        rows.append({"claim": f"base: expert load CV lower over its last steps than its first (ratio){over(m)}",
                     "value": m["moe_cv_last"] / m["moe_cv_first"], "holds": m["moe_cv_last"] < m["moe_cv_first"]})
    for s, v in f.get("moe", {}).items():
        if v.get("replay_probe_without"):
            rows.append({"claim": f"{s}: routing replay lowers mean |log pi_train - log pi_rollout| (with / without)"
                                  f"{over(v)}",
                         "value": v["replay_probe_with"] / v["replay_probe_without"],
                         "holds": v["replay_probe_with"] < v["replay_probe_without"]})
    if (v := f.get("chat_retention", {}).get("quantized")) is not None:
        rows.append(_row(f"quantized keeps >= {CLAIMS['chat_retention']:.0%} of the base's held-out chat score", v,
                         CLAIMS["chat_retention"],
                         draws(lambda q, base: _ratio(q.mean(0), base.mean(0)),
                               ("quantized", "chat"), ("base", "chat"))))
    if "quant_drop_max" in f:
        # the largest drop over the suites with per-item scores (IFBench's strict and instruction-level figures are
        # scored over the whole suite only)
        kept = [s for s in f["quant_drop"] if ("generalist", s) in b and ("quantized", s) in b]
        rows.append(_row(f"quantized within {CLAIMS['quant_drop_max']:.2f} of the generalist on every suite",
                         f["quant_drop_max"], CLAIMS["quant_drop_max"],
                         np.max([(b["generalist", s] - b["quantized", s]).mean(0) for s in kept], axis=0)
                         if kept else None, at_most=True))
    return rows


def markdown(f: dict) -> str:
    n = len(f["seeds"])
    cks = list(f["eval"])
    suites = report_html.columns(f["eval"])
    cell = (lambda v: f"{v['mean']:.3f}" if n == 1 else f"{v['mean']:.3f} ({v['min']:.2f}-{v['max']:.2f})")
    lines = [f"# figures: profile {f['profile']}, seeds {f['seeds']}", "",
             f"Machine: {f['machine']}. Runs: {', '.join(f['runs'])}. Test scores: mean over seeds "
             f"(min-max); greedy, thinking on unless the suite says `:nothink`.", "",
             "| checkpoint | " + " | ".join(suites) + " |", "|" + "---|" * (len(suites) + 1)]
    lines += [f"| {c} | " + " | ".join(cell(f["eval"][c][s]) if s in f["eval"][c] else "" for s in suites) + " |"
              for c in cks]
    if f.get("gain"):
        lines += ["", "| domain | specialist gain over sft (min-max) | generalist retention (per seed) |",
                  "|---|---|---|"]
        for d, g in f["gain"].items():
            sp, ret = f["gain_spread"][d], f.get("retention", {}).get(d)
            per = ", ".join("-" if x is None else f"{x:.2f}" for x in f.get("retention_per_seed", {}).get(d, []))
            lines.append(f"| {d} | {g:+.3f} ({sp['min']:+.2f} to {sp['max']:+.2f}) | "
                         f"{'-' if ret is None else f'{ret:.0%}'} ({per}) |")
    if f.get("thinking_delta"):
        lines += ["", "| sft, thinking on vs off | score delta | tokens on | tokens off |", "|---|---|---|---|"]
        for d, v in f["thinking_delta"].items():
            t = f.get("thinking_tokens", {}).get(d, {})
            lines.append(f"| {d} | {v:+.3f} | {t.get('on', '-')} | {t.get('off', '-')} |")
    if f.get("chat_retention"):
        lines += ["", "Held-out everyday chat (environments/chat.py), share of the base's score kept: " +
                  ", ".join(f"{c} {'-' if v is None else f'{v:.0%}'}" for c, v in f["chat_retention"].items()) + "."]
    if "quant_drop_max" in f:
        worst = max(f["quant_drop"], key=f["quant_drop"].get)
        lines += ["", f"Quantization: largest mean drop, generalist to quantized, {f['quant_drop_max']:+.3f} ({worst})."]
    lines += ["", "| stage | mean seconds |", "|---|---|"]
    lines += [f"| {s} | {v:.0f} |" for s, v in f["wall_seconds"].items()]
    if f.get("claims"):
        lines += ["", "| claim (mean over seeds) | value | 95% interval, test items resampled | holds | "
                  "interval clear of the bar |", "|---|---|---|---|---|"]
        lines += [f"| {c['claim']} | {'-' if c['value'] is None else round(c['value'], 3)} | "
                  f"{'{:.3f} to {:.3f}'.format(*c['interval']) if 'interval' in c else '-'} | "
                  f"{'yes' if c['holds'] else 'NO'} | "
                  f"{('yes' if c['clear'] else 'no: the items cannot tell') if 'clear' in c else '-'} |"
                  for c in f["claims"]]
    return "\n".join(lines) + "\n"


def write(f: dict, home: Path) -> tuple[Path, Path]:
    home.mkdir(parents=True, exist_ok=True)
    js, md = home / "figures.json", home / "figures.md"
    atomic_write_text(js, json.dumps(f, indent=1))
    atomic_write_text(md, markdown(f))
    return js, md


def figures(profile: str, seeds: list[int], overrides: list[str], runs: list[str]) -> dict:
    """Run (or, with `runs`, only collect) the seeds' pipelines and write figures.json / figures.md."""
    t0 = time.time()
    paths = [_report_path(r) for r in runs] if runs else run_seeds(profile, seeds, overrides)
    reports = []
    for p in paths:
        r = json.loads(p.read_text())
        cfg = p.parent / "config.json"
        r["seed"] = json.loads(cfg.read_text())["seed"] if cfg.exists() else None
        reports.append(r)
    f = aggregate(reports)
    js, md = write(f, home_dir())
    print(markdown(f))
    print(f"wrote {js} and {md} ({time.time() - t0:.0f} s)")
    return f


def _report_path(run: str) -> Path:
    """A run id under this POSTTRAIN_HOME, a run folder, or a report.json path."""
    p = Path(run)
    for cand in (p, p / "report.json", home_dir() / "runs" / run / "report.json"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no report for run {run!r} (looked for {p}, {p / 'report.json'} and "
                            f"{home_dir() / 'runs' / run / 'report.json'})")
