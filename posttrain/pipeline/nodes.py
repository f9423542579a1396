"""The DAG's nodes as data, and `execute`: verify inputs, content-addressed cache, run on Ray,
manifest, atomic publish, MLflow child run. The Flyte tasks in tasks/ are thin calls to this."""
from __future__ import annotations

import asyncio
import functools
import importlib
import json
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from environments import ENV_VAR
from posttrain.config import PipelineConfig, config_from_dict
from posttrain.device import CPU_BF16
from posttrain.device import ENV as DEVICE_VAR
from posttrain.device import stage_gpus
from posttrain.engines.registry import LOG_DIR_VAR
from posttrain.pipeline import tracking
from posttrain.pipeline.artifacts import (ArtifactRef, DigestMismatch, dir_digest, git_sha, read_manifest, replace_dir,
                                          sha256_file, sha256_json, staging_dir, verify, verify_ref, write_manifest)
from posttrain.pipeline.codehash import stage_code_digest
from posttrain.pipeline.graph import (CHAINS, ENGINES, ROLLOUT_ENGINE,  # noqa: F401; the DAG itself, re-exported
                                      TRAIN_ENGINE, Stage, _chain_inputs, downstream, graph, stage_name, upstream,
                                      waves)
from posttrain.pipeline.lease import hold
from posttrain.pipeline.raysupport import ensure_ray, submit
from posttrain.pipeline.store import SCRATCH_VAR, Store, Versions, drop_scratch, local_versions, publish_local
from posttrain.rl import alarms


@dataclass
class RunContext:
    """What every node needs to know about the pipeline run it belongs to (flows through Flyte)."""
    run_id: str
    home: str
    config_json: str
    parent_run_id: str = ""
    store: str = ""  # the remote artifact store's URL (posttrain.pipeline.store); empty: `home` is the store
    tags: dict[str, str] = field(default_factory=dict)
    force: list[str] = field(default_factory=list)  # stages to redo even on a cache hit

    def cfg(self) -> PipelineConfig:
        """The run's config, parsed once per process (every node and helper asks the context for it)."""
        return _parsed(self.config_json, self.run_id)


@functools.lru_cache(maxsize=8)  # outside the dataclass: Flyte serialises RunContext's fields
def _parsed(config_json: str, run_id: str) -> PipelineConfig:
    return config_from_dict(json.loads(config_json), f"run {run_id}")


class StageFailed(RuntimeError):
    """A node failed or refused its input; the message names the stage and the cause."""


def cache_key(stage: Stage, cfg: PipelineConfig, code: str, inputs: dict[str, ArtifactRef]) -> str:
    body = {"stage": stage.name, "config": cfg.digest(*stage.sections), "code": code, "params": list(stage.params),
            "inputs": {k: v.sha256 for k, v in sorted(inputs.items())}}
    if "base" in stage.sections and cfg.base.init_from:  # the config holds only its path: hash what it holds
        if not Path(cfg.base.init_from).is_dir():
            raise StageFailed(f"{stage.name}: base.init_from {cfg.base.init_from!r} is not a directory "
                              f"(expected a local Hugging Face checkpoint dir)")
        body["init_from"] = dir_digest(cfg.base.init_from)
        if cfg.base.chat_template and Path(cfg.base.chat_template).is_file():
            body["chat_template"] = sha256_file(Path(cfg.base.chat_template))
    if "sft" in stage.sections and cfg.sft.replay_file and Path(cfg.sft.replay_file).is_file():
        body["replay_file"] = sha256_file(Path(cfg.sft.replay_file))
    return sha256_json(body)


def _small_files(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in (".json", ".md", ".png", ".html")
            and p.stat().st_size < 2_000_000 and p.name not in ("tokenizer.json",)]


async def execute(name: str, ctx: RunContext, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
    """Run one node (or take it from the cache, or from another run computing it now) and return its verified
    artifact."""
    cfg, t0 = ctx.cfg(), time.time()
    stage = graph(cfg)[name]
    tracking.configure(cfg.tracking.uri)  # a remote task's pod starts with only the config
    code = stage_code_digest(stage.fn.split(":")[0], cfg)
    missing = set(stage.inputs) - set(inputs)
    if missing:
        raise StageFailed(f"{name}: missing inputs {sorted(missing)}")
    store = Store(ctx.store, Path(ctx.home)) if ctx.store else None
    for k, ref in inputs.items() if store is None else ():  # remote: the worker verifies what it downloads
        try:  # refuses a tampered or half-written upstream artifact, cache hit or not
            verify_ref(ref)
        except DigestMismatch as e:
            raise StageFailed(f"stage {name} refused its input {k}: {e}") from e
    key = cache_key(stage, cfg, code, inputs)
    target = Path(ctx.home) / "artifacts" / name / key[:16]
    tags = {"posttrain.stage": name, "posttrain.run_id": ctx.run_id, "git_sha": git_sha(),
            "config_digest": cfg.digest(), "code_digest": code, "cache_key": key, **ctx.tags}
    datasets = [(k, v.sha256, v.path) for k, v in inputs.items()]
    forced = name in ctx.force
    versions = _cached(store, name, key, target)
    lease = None
    if versions.valid is None or forced:  # one run computes a node at a time; the others wait for its artifact
        lease = await hold(store, ctx.home, name, key, ctx.run_id)
        versions = _cached(store, name, key, target)
        if versions.valid is not None and not forced:  # published by the run this one waited for
            lease.release()
            lease = None
    if lease is None:
        uri, manifest = versions.valid
        run_id = tracking.start_run(ctx.home, name, {**tags, "posttrain.cache_hit": "true", "artifact_uri": uri,
                                                     "artifact_sha256": manifest["sha256"],
                                                     "produced_by_run": manifest["mlflow_run_id"]},
                                    ctx.parent_run_id)
        tracking.log_result(ctx.home, run_id, params={}, metrics=manifest.get("metrics", {}), datasets=datasets)
        tracking.end_run(ctx.home, run_id)
        return ArtifactRef(name, uri, manifest["sha256"], run_id, round(time.time() - t0, 2), True,
                           manifest.get("metrics", {}))
    for problem in versions.corrupted:  # kept as evidence: a registered model's lineage may point at it
        print(f"[{name}] a cached version failed verification and is kept as evidence; this run publishes a new "
              f"version: {problem}", flush=True)
    try:
        return await _compute(name, ctx, stage, cfg, code, key, inputs, store, versions, tags, datasets, t0)
    finally:
        lease.release()


async def _compute(name: str, ctx: RunContext, stage: Stage, cfg: PipelineConfig, code: str, key: str,
                   inputs: dict[str, ArtifactRef], store: Store | None, versions: Versions, tags: dict,
                   datasets: list, t0: float) -> ArtifactRef:
    """The node's work on Ray under its MLflow child run, published as a new version of its cache key."""
    run_id = tracking.start_run(ctx.home, name, tags, ctx.parent_run_id)
    scratch_url = store.url(f"scratch/{name}/{key[:16]}") if store and stage.resumable else ""
    try:
        ensure_ray(cfg.runtime)
        env_vars = {ENV_VAR: json.dumps(cfg.world.environments)} if cfg.world.environments else {}
        if cfg.runtime.device != "auto":
            env_vars[DEVICE_VAR] = cfg.runtime.device
        if cfg.runtime.cpu_bf16:
            env_vars[CPU_BF16] = "auto" if cfg.runtime.cpu_bf16 == "auto" else "1"
        gpus = stage_gpus(cfg.runtime.device, cfg.runtime.gpus_per_stage) if stage.gpu else 0.0
        # this stage's own variables: set in its worker for the call (and passed to the actors it starts), so that
        # the run-wide runtime_env above stays one and Ray reuses the workers, imports and all, stage after stage
        stage_env = {LOG_DIR_VAR: str(Path(ctx.home) / "runs" / ctx.run_id / "logs" / name)}  # beside the report
        if scratch_url:  # resume checkpoints go to the store too (posttrain.pipeline.store.checkpointed)
            stage_env[SCRATCH_VAR] = scratch_url
        # same key after a crash: resume from it
        extra = {"scratch": str(Path(ctx.home) / "scratch" / name / key[:16])} if stage.resumable else {}
        manifest = {"stage": name, "parents": {k: v.sha256 for k, v in inputs.items()},
                    "config_digest": cfg.digest(*stage.sections), "code_digest": code, "mlflow_run_id": run_id}
        result = await submit("posttrain.pipeline.nodes:produce", stage.num_cpus, stage.threads, stage.fn, cfg,
                              {k: (v.path, v.sha256) for k, v in inputs.items()}, ctx.home, ctx.store, key,
                              manifest, dict(stage.params), frozenset(versions.seen), env_vars=env_vars or None,
                              stage_env=stage_env, num_gpus=gpus, **extra)
        uri, digest, metrics = result["uri"], result["digest"], result["metrics"]
        for notice in result.get("notices", []):
            print(f"[{name}] {notice.replace('{artifact}', uri)}", flush=True)
        if result.get("adopted_from"):
            print(f"[{name}] another run published this node first (MLflow run {result['adopted_from']}): "
                  f"this run continues from that artifact, {uri}", flush=True)
        with tempfile.TemporaryDirectory() as d:  # the worker's tables and plots, for the MLflow run
            files = [Path(d) / f for f in result["files"]]
            for path, data in zip(files, result["files"].values()):
                path.write_bytes(data)
            tracking.log_result(ctx.home, run_id, params={**{s: json.dumps(cfg.section(s)) for s in stage.sections},
                                                          **dict(stage.params)},
                                metrics=metrics, history=result.get("history"), datasets=datasets, files=files,
                                tags={**result.get("tags", {}), "artifact_sha256": digest, "artifact_uri": uri,
                                      "ray_node": result.get("ray_node", ""),
                                      **({"posttrain.adopted_from": result["adopted_from"]}
                                         if result.get("adopted_from") else {})})
        for child in result.get("children", []):
            _log_child(ctx.home, run_id, tags, child, uri)
    except BaseException as e:
        shown = getattr(e, "cause", None) or e  # a RayTaskError carries the stage's own exception
        detail = "".join(traceback.format_exception_only(type(shown), shown)).strip()
        tracking.log_result(ctx.home, run_id, params={}, metrics={}, tags={"error": detail[:4000]})
        tracking.end_run(ctx.home, run_id, "FAILED")
        if isinstance(e, (KeyboardInterrupt, asyncio.CancelledError)):
            raise
        raise StageFailed(f"stage {name} failed: {detail}") from e
    if scratch_url:  # published: the resume state is no longer needed
        drop_scratch(scratch_url)
    tracking.end_run(ctx.home, run_id)
    return ArtifactRef(name, uri, digest, run_id, round(time.time() - t0, 2), False, metrics)


def produce(fn: str, cfg: PipelineConfig, inputs: dict[str, tuple[str, str]], home: str, store_root: str,
            key: str, manifest: dict, params: dict, skip: frozenset[str] = frozenset(), scratch: str = "") -> dict:
    """A stage's work, on the machine Ray placed it: fetch and verify its inputs (from the store into this
    machine's mirror), run `fn` into a temp folder, write the manifest, publish on a version name nobody holds
    (a remote store: upload, manifest last, then the commit that makes it visible). `skip`: the versions the
    driver already judged. Returns the stage's result with the artifact's URI, digest, metrics and small files
    (tables, plots) for the driver's MLflow run; `adopted_from` when another run published the node first."""
    store = Store(store_root, Path(home)) if store_root else None
    local: dict[str, Path] = {}
    for k, (path, sha) in inputs.items():
        try:  # refuses a tampered or half-written upstream artifact (a local store's: execute verified it)
            local[k] = store.fetch(path, sha) if store else Path(path)
        except (DigestMismatch, OSError) as e:
            raise DigestMismatch(f"refused its input {k}: {e}") from None
    name = manifest["stage"]
    target = Path(home) / "artifacts" / name / key[:16]
    module, attr = fn.split(":")
    work = getattr(importlib.import_module(module), attr)
    live = {alarms.RUN_VAR: manifest.get("mlflow_run_id") or "", alarms.HOME_VAR: home}  # live alarm tags
    saved = {k: os.environ.get(k) for k in live}
    os.environ.update(live)
    try:
        with staging_dir(target) as tmp:
            result = work(cfg, {k: str(v) for k, v in local.items()}, tmp, **params,
                          **({"scratch": scratch} if scratch else {}))
            metrics = {k: v for k, v in result.get("metrics", {}).items() if isinstance(v, (int, float))}
            digest = write_manifest(tmp, **manifest, extra={"metrics": metrics})
            files = {p.name: p.read_bytes() for p in _small_files(tmp)}
            if store:  # the local mirror is a cache: replaced; the store decides what is published
                replace_dir(tmp, target)
                uri, published = store.publish(target, name, key, digest, skip)
                theirs = store.manifest(uri, published) if published != digest else None
            else:
                folder = publish_local(tmp, target, skip)
                uri, theirs = str(folder), read_manifest(folder)
                theirs = theirs if theirs["sha256"] != digest else None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    if theirs is not None:
        return {**result, "metrics": theirs.get("metrics", {}), "digest": theirs["sha256"], "uri": uri, "files": files,
                "adopted_from": theirs.get("mlflow_run_id", "")}
    return {**result, "metrics": metrics, "digest": digest, "uri": uri, "files": files}


def _cached(store: Store | None, name: str, key: str, target: Path) -> Versions:
    """The versions already made for this cache key: the newest that verifies is served; a corrupted one is
    never served nor replaced. A local artifact whose upload failed is published now."""
    if store is None:
        return local_versions(target)
    versions = store.committed(name, key)
    if versions.valid is None and target.exists():
        try:
            manifest = verify(target)
        except DigestMismatch:
            return versions
        uri, sha = store.publish(target, name, key, manifest["sha256"], frozenset(versions.seen))
        versions.valid = uri, store.manifest(uri, sha)
    return versions


def _log_child(home: str, parent: str, tags: dict, child: dict, uri: str) -> None:
    """A sub-step of a node (a ramp stage) as its own MLflow run under the node's run."""
    where = f"{uri}/{child['path']}" if child.get("path") else uri
    run_id = tracking.start_run(home, child["name"], {**tags, "artifact_uri": where}, parent)
    tracking.log_result(home, run_id, params=child.get("params", {}), metrics=child.get("metrics", {}),
                        history=child.get("history"))
    tracking.end_run(home, run_id)


def ref_from_dict(d: dict) -> ArtifactRef:
    return ArtifactRef(**{k: v for k, v in d.items() if k in ArtifactRef.__dataclass_fields__})

