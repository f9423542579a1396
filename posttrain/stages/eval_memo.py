"""Scores of a checkpoint already evaluated, reused: `posttrain rerun opd --downstream` scores the new generalist and
its export, not again the base, sft and specialists it did not touch (on the small profile the untouched ones were
two thirds of evaluate's 30-50 minutes).

The evaluate node's own cache key covers every checkpoint at once, so any new one recomputes all of them. This memo
is per checkpoint: keyed by that checkpoint's artifact digest, its name (which suites and samples it gets), the
curated test split's digest, evaluate's config sections (of `rl` only what its suites' episodes take from it, so a
rerun of one specialist with new RL settings scores only that specialist) and code digest (its whole import closure,
environments included) and the device type. Evaluation is deterministic for those (a checkpoint's torch seed is set before it is
scored, docs/glm5.md's determinism check), so a hit is the score it would compute. It lives beside the store's local
mirror (`<home>/eval-memo/`): a miss, or a machine without it, only computes. Each reused entry names the MLflow run
that computed it in eval.json's `decoding`, for the lineage audit; delete the folder to score everything afresh."""
from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.config import PipelineConfig
from posttrain.device import device
from posttrain.pipeline.artifacts import atomic_write_text, read_manifest, sha256_json
from posttrain.pipeline.codehash import stage_code_digest
from posttrain.pipeline.graph import graph
from posttrain.rl import alarms

FOLDER = "eval-memo"


def _home() -> Path | None:
    home = os.environ.get(alarms.HOME_VAR)  # set by the stage runner: evaluate called outside a node keeps nothing
    return Path(home) / FOLDER if home else None


def keys(cfg: PipelineConfig, inputs: dict[str, str], calls: dict[str, tuple[str, bool, int, dict]]) -> dict[str, str]:
    """checkpoint name -> memo key, for `calls` {name: (its stage's artifact dir, scored as completion, samples,
    {suite: the RL settings its episodes use})}; none outside a pipeline node."""
    if _home() is None:
        return {}
    stage = graph(cfg)["evaluate"]
    common = {"config": cfg.digest(*(s for s in stage.sections if s != "rl")),
              "code": stage_code_digest(stage.fn.split(":")[0], cfg),
              "curate": read_manifest(inputs["curate"])["sha256"], "device": device().type}
    return {ck: sha256_json({**common, "checkpoint": read_manifest(path)["sha256"], "name": ck,
                             "completion": completion, "samples": samples, "episodes": episodes})
            for ck, (path, completion, samples, episodes) in calls.items()}


def load(key: str | None) -> tuple | None:
    """evaluate_checkpoint's result for `key`, its info naming the run that computed it; None on a miss."""
    folder = _home()
    path = folder / f"{key[:32]}.json" if folder and key else None
    if path is None or not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # unreadable: computed again and written over
    if entry.get("key") != key:
        return None
    scores, tokens, passk, info = entry["result"]
    return scores, tokens, passk, {**info, "memo": {"key": key[:16], "computed_by_run": entry["run"]}}


def save(key: str | None, result: tuple) -> None:
    if (folder := _home()) is None or key is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"{key[:32]}.json",
                      json.dumps({"key": key, "run": os.environ.get(alarms.RUN_VAR, ""), "result": list(result)}))
