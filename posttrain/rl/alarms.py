"""Reward-hacking alarms during RL: a policy that games its reward tends to drift sharply from its reference,
to collapse onto a few tokens, and to score better on its own rollouts while validation falls. Each is checked
after every step on the loop's curves and raised once when its condition starts to hold (not again until it
clears): printed, kept in the run's state and tagged on the stage's MLflow run as it happens.

No library watches RL curves for these patterns, so the rules are written out here; thresholds are in
`rl.alarms` (posttrain.config.AlarmConfig).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from statistics import mean, median

from posttrain.config import AlarmConfig

RUN_VAR, HOME_VAR = "POSTTRAIN_MLFLOW_RUN", "POSTTRAIN_MLFLOW_HOME"  # set by the stage runner (posttrain.pipeline.nodes)


def conditions(hist: dict, a: AlarmConfig) -> dict[str, tuple[float, str]]:
    """The alarms whose condition holds after the last step: kind -> (value, what it means). Calibrated on the tiny
    default's healthy specialists, where single-step KL outliers (one batch of rollouts) and entropy falling tenfold
    while validation rises are normal: a spike must hold on each of `persist` steps, and a collapse counts only where
    validation has not improved."""
    out = {}
    kl, p, w = hist.get("kl_ref", []), a.persist, a.window
    if len(kl) >= p + w:
        now, base = min(kl[-p:]), median(kl[-p - w:-p])
        if now > a.kl_min and now > a.kl_rise * base:
            out["kl_spike"] = (now, f"KL to the reference {now:.4g} (the least of the last {p} steps) > {a.kl_rise:g}x "
                                    f"its median {base:.4g} over the {w} steps before (and > {a.kl_min:g})")
    ent, val = hist.get("entropy", []), hist.get("val_score", [])
    if len(ent) > w and val:
        first, gain = mean(ent[:w]), val[-1][1] - val[0][1]
        if ent[-1] < a.entropy_floor * first and gain < a.divergence:
            out["entropy_collapse"] = (ent[-1], f"entropy {ent[-1]:.4g} < {a.entropy_floor:g} x its mean {first:.4g} "
                                                f"over the first {w} steps, while validation gained only {gain:+.3f}")
    reward = hist.get("reward", [])
    if len(val) > 2:
        (s0, _), (s1, v1), (s2, v2) = val[-3:]
        if s2 == len(reward):  # a validation just ran: compare its interval with the one before
            r_prev, r_now = mean(reward[s0:s1] or [0.0]), mean(reward[s1:s2] or [0.0])
            if r_now - r_prev >= a.divergence and v1 - v2 >= a.divergence:
                out["reward_up_val_down"] = (v2 - v1, f"train reward {r_prev:.3f} -> {r_now:.3f} while validation "
                                                      f"{v1:.3f} -> {v2:.3f} (steps {s1} to {s2})")
    return out


def check(hist: dict, a: AlarmConfig, active: set[str], step: int, label: str, earlier: list[dict] = ()) -> list[dict]:
    """New alarms after `step` (edge-triggered against `active`, which is updated). The first of each kind in a
    stage (`earlier`: the stage's alarms so far) is printed as it fires; the rest are tagged and counted, and
    `publish` summarizes them once at the stage's end."""
    if not a.enabled:
        return []
    now = conditions(hist, a)
    events = [{"kind": k, "step": step, "value": v, "message": m} for k, (v, m) in now.items() if k not in active]
    active.clear()
    active.update(now)
    shown = {e["kind"] for e in earlier}
    for e in events:
        if e["kind"] not in shown:
            print(f"[{label}] ALARM {e['kind']} at step {step}: {e['message']} (more of this kind are summarized "
                  f"at the stage's end)", flush=True)
        _tag_live(e)
    return events


CURVE = {"kl_spike": "kl_ref", "entropy_collapse": "entropy", "reward_up_val_down": "val_score"}


def summary(events: list[dict], hist: dict) -> list[str]:
    """One line per alarm kind: how often it fired, at which steps, and where its curve went."""
    lines = []
    for kind in sorted({e["kind"] for e in events}):
        steps = [e["step"] for e in events if e["kind"] == kind]
        curve = [v[1] if isinstance(v, (list, tuple)) else v for v in hist.get(CURVE[kind], [])]
        where = (f"; {CURVE[kind]} {curve[0]:.4g} at the start, {curve[-1]:.4g} at the end, min {min(curve):.4g}, "
                 f"max {max(curve):.4g}") if curve else ""
        lines.append(f"ALARM {kind}: fired {len(steps)} time{'s' * (len(steps) > 1)} (steps "
                     f"{', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''}){where}")
    return lines


def tag_name(event: dict) -> str:
    return f"alarm.{event['kind']}.step_{event['step']}"


def tags(events: list[dict]) -> dict[str, str]:
    """MLflow tags for a run's alarms: one per event, and the kinds that fired."""
    out = {tag_name(e): e["message"] for e in events}
    if events:
        out["alarms"] = ",".join(sorted({e["kind"] for e in events}))
    return out


def publish(events: list[dict], out, label: str = "", hist: dict | None = None) -> dict:
    """A stage's alarms: alarms.json in its artifact, a summary line per kind on the console, and the result keys
    the stage runner logs (tags, count)."""
    (Path(out) / "alarms.json").write_text(json.dumps(events, indent=1))
    for line in summary(events, hist or {}):
        print(f"[{label}] {line}", flush=True)
    return {"tags": tags(events), "metrics": {"alarms": len(events)}}


def _tag_live(event: dict) -> None:
    """Tag the stage's MLflow run now, where the stage runner said which run that is; tracking trouble must
    not stop training (the tags are written again with the stage's result)."""
    run_id = os.environ.get(RUN_VAR)
    if not run_id:
        return
    try:
        from posttrain.pipeline import tracking  # MLflow: heavy, and needed only where a stage runner set the run
        tracking.client(os.environ.get(HOME_VAR, "")).set_tag(run_id, tag_name(event), event["message"])
    except Exception as e:  # noqa: BLE001
        print(f"alarm not tagged live on MLflow run {run_id}: {e}", flush=True)
