"""The DAG's nodes as data, and `execute`: verify inputs, content-addressed cache, run on Ray,
manifest, atomic publish, MLflow child run. The Flyte tasks in tasks/ are thin calls to this."""
from __future__ import annotations

import asyncio
import json
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from posttrain import tracking
from posttrain.artifacts import ArtifactRef, DigestMismatch, atomic_dir, dir_digest, git_sha, sha256_json, verify, \
    verify_ref, write_manifest
from posttrain.codehash import stage_code_digest
from posttrain.config import PipelineConfig, _at as config_at, config_from_dict


@dataclass(frozen=True)
class Stage:
    name: str
    fn: str                      # "module:function" doing the work
    inputs: tuple[str, ...]      # upstream stage names
    sections: tuple[str, ...]    # config sections that change its output
    params: tuple[tuple[str, str], ...] = ()
    num_cpus: float = 1.0        # Ray CPUs reserved; the specialists take a share so all three run at once
    threads: int = 2
    resumable: bool = False      # gets a `scratch` dir that survives a crash, for its training checkpoints


DOMAIN_STAGES = tuple(f"rl-{d}" for d in ("reasoning", "agentic", "general"))
CROSS_ORDER = ("reasoning", "agentic", "general")  # GLM-5's RL stage order (workflows/cross_stage.py)
CHAINS = ("xs", "seq")                            # cross-stage distillation; plain sequential RL


def stage_name(chain: str, domain: str) -> str:
    return "rl-reasoning" if domain == CROSS_ORDER[0] else f"{chain}-{domain}"


def inputs_of(chain: str, domain: str) -> tuple[str, ...]:
    """Upstream stages: the previous stage (the start), and for `xs` every earlier stage (the teachers)."""
    earlier = [stage_name(chain, d) for d in CROSS_ORDER[:CROSS_ORDER.index(domain)]]
    return tuple(dict.fromkeys([earlier[-1], *(earlier if chain == "xs" else []), "curate"]))


STAGES: dict[str, Stage] = {s.name: s for s in [
    Stage("raw", "posttrain.curate:make_raw", (), ("world", "curate"), num_cpus=1, threads=1),
    # curate only waits on its per-file Ray tasks, so it reserves almost nothing itself
    Stage("curate", "posttrain.curate:run", ("raw",), ("world", "curate"), num_cpus=0.1, threads=1),
    Stage("base", "posttrain.base:run", ("curate",), ("seed", "tokenizer", "model", "base")),
    Stage("ramp", "posttrain.ramp:run", ("base", "curate"),
          ("seed", "world.seed", "model", "ramp", "eval.n_per_suite", "eval.max_new_tokens", "eval.batch_size"),
          resumable=True),
    # sft's own Ray task only waits on its Ray Train workers
    Stage("sft", "posttrain.sft:run", ("ramp", "curate"), ("seed", "sft"), num_cpus=0.1, resumable=True),
    # 3 x (0.4 + one 0.25-CPU rollout worker) fits the 2 CPUs, so the three specialists run at once
    *[Stage(s, "posttrain.rl:run", ("sft", "curate"), ("seed", "rl"), (("domain", s[3:]),), num_cpus=0.4, threads=1,
            resumable=True) for s in DOMAIN_STAGES],
    # the trainer, one rollout worker (0.25) and three teachers (0.2 each) fit the 2 CPUs
    Stage("opd", "posttrain.opd:run", ("sft", "curate", *DOMAIN_STAGES), ("seed", "opd", "rl"), num_cpus=0.5,
          threads=1, resumable=True),
    Stage("quantize", "posttrain.quantize:run", ("opd", "curate"), ("seed", "quantize")),
    Stage("evaluate", "posttrain.evaluate:run", ("base", "ramp", "sft", *DOMAIN_STAGES, "opd", "quantize", "curate"),
          ("seed", "world.seed", "eval", "rl", "model", "ramp")),
    # workflows/cross_stage.py: the GLM-5 chain with distillation (xs-) and without (seq-), both after rl-reasoning
    *[Stage(stage_name(c, d), "posttrain.cross_stage:run", inputs_of(c, d), ("seed", "rl", "cross_stage", "opd"),
            (("domain", d), ("chain", c)), num_cpus=0.4, threads=1, resumable=True)
      for d in CROSS_ORDER[1:] for c in CHAINS],
    Stage("consolidation", "posttrain.consolidation:run",
          ("sft", "curate", *DOMAIN_STAGES, "opd", *(stage_name(c, d) for c in CHAINS for d in CROSS_ORDER[1:])),
          ("seed", "eval", "rl", "cross_stage")),
]}
ORDER = list(STAGES)


def downstream(stage: str) -> list[str]:
    """`stage` and every stage that (transitively) consumes it, in DAG order."""
    hit = {stage}
    for s in ORDER:
        if set(STAGES[s].inputs) & hit:
            hit.add(s)
    return [s for s in ORDER if s in hit]


@dataclass
class RunContext:
    """What every node needs to know about the pipeline run it belongs to (flows through Flyte)."""
    run_id: str
    home: str
    config_json: str
    parent_run_id: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    force: list[str] = field(default_factory=list)  # stages to redo even on a cache hit

    def cfg(self) -> PipelineConfig:
        return config_from_dict(json.loads(self.config_json), f"run {self.run_id}")


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
    return sha256_json(body)


def _small_files(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in (".json", ".md", ".png", ".html")
            and p.stat().st_size < 2_000_000 and p.name not in ("tokenizer.json",)]


async def execute(name: str, ctx: RunContext, inputs: dict[str, ArtifactRef]) -> ArtifactRef:
    """Run one node (or take it from the cache) and return its verified artifact."""
    from posttrain.raysupport import ensure_ray, submit

    stage, cfg, t0 = STAGES[name], ctx.cfg(), time.time()
    tracking.configure(cfg.tracking.uri)  # a remote task's pod starts with only the config
    code = stage_code_digest(stage.fn.split(":")[0], cfg)
    missing = set(stage.inputs) - set(inputs)
    if missing:
        raise StageFailed(f"{name}: missing inputs {sorted(missing)}")
    for k, ref in inputs.items():
        try:
            verify_ref(ref)  # refuses a tampered or half-written upstream artifact
        except DigestMismatch as e:
            raise StageFailed(f"stage {name} refused its input {k}: {e}") from e
    key = cache_key(stage, cfg, code, inputs)
    target = Path(ctx.home) / "artifacts" / name / key[:16]
    tags = {"posttrain.stage": name, "posttrain.run_id": ctx.run_id, "git_sha": git_sha(),
            "config_digest": cfg.digest(), "cache_key": key, **ctx.tags}
    datasets = [(k, v.sha256, v.path) for k, v in inputs.items()]
    if target.exists() and name not in ctx.force:
        try:
            manifest = verify(target)
        except DigestMismatch:
            manifest = None  # a corrupted cache entry is recomputed, never served
        if manifest:
            run_id = tracking.start_run(ctx.home, name, {**tags, "posttrain.cache_hit": "true",
                                                         "artifact_uri": str(target),
                                                         "artifact_sha256": manifest["sha256"],
                                                         "produced_by_run": manifest["mlflow_run_id"]},
                                        ctx.parent_run_id)
            tracking.log_result(ctx.home, run_id, params={}, metrics=manifest.get("metrics", {}), datasets=datasets)
            tracking.end_run(ctx.home, run_id)
            return ArtifactRef(name, str(target), manifest["sha256"], run_id, round(time.time() - t0, 2), True,
                               manifest.get("metrics", {}))
    run_id = tracking.start_run(ctx.home, name, tags, ctx.parent_run_id)
    try:
        ensure_ray(cfg.runtime)
        scratch = Path(ctx.home) / "scratch" / name / key[:16]  # same key after a crash: resume from it
        extra = {"scratch": str(scratch)} if stage.resumable else {}
        with atomic_dir(target) as tmp:
            ref = submit(stage.fn, stage.num_cpus, stage.threads, cfg, {k: v.path for k, v in inputs.items()}, tmp,
                         **dict(stage.params), **extra)
            result = await ref
            metrics = {k: v for k, v in result.get("metrics", {}).items() if isinstance(v, (int, float))}
            digest = write_manifest(tmp, stage=name, parents={k: v.sha256 for k, v in inputs.items()},
                                    config_digest=cfg.digest(*stage.sections), code_digest=code,
                                    mlflow_run_id=run_id, extra={"metrics": metrics})
            files = _small_files(tmp)
            tracking.log_result(ctx.home, run_id, params={**{s: json.dumps(config_at(cfg.model_dump(mode="json"), s))
                                                             for s in stage.sections}, **dict(stage.params)},
                                metrics=metrics, history=result.get("history"), datasets=datasets, files=files,
                                tags={"artifact_uri": str(target), "artifact_sha256": digest})
            for child in result.get("children", []):
                _log_child(ctx.home, run_id, tags, child, target)
    except BaseException as e:
        shown = getattr(e, "cause", None) or e  # a RayTaskError carries the stage's own exception
        detail = "".join(traceback.format_exception_only(type(shown), shown)).strip()
        tracking.log_result(ctx.home, run_id, params={}, metrics={}, tags={"error": detail[:4000]})
        tracking.end_run(ctx.home, run_id, "FAILED")
        if isinstance(e, (KeyboardInterrupt, asyncio.CancelledError)):
            raise
        raise StageFailed(f"stage {name} failed: {detail}") from e
    shutil.rmtree(scratch, ignore_errors=True)  # published: the resume state is no longer needed
    tracking.end_run(ctx.home, run_id)
    return ArtifactRef(name, str(target), digest, run_id, round(time.time() - t0, 2), False, metrics)


def _log_child(home: str, parent: str, tags: dict, child: dict, target: Path) -> None:
    """A sub-step of a node (a ramp stage) as its own MLflow run under the node's run."""
    run_id = tracking.start_run(home, child["name"], {**tags, "artifact_uri": str(target / child.get("path", ""))},
                                parent)
    tracking.log_result(home, run_id, params=child.get("params", {}), metrics=child.get("metrics", {}),
                        history=child.get("history"))
    tracking.end_run(home, run_id)


def ref_from_dict(d: dict) -> ArtifactRef:
    return ArtifactRef(**{k: v for k, v in d.items() if k in ArtifactRef.__dataclass_fields__})

