"""A pipeline run's beginning and end: run context, parent MLflow run, report.json, registry."""
from __future__ import annotations

import json
import shutil
import time
import uuid
from functools import partial
from pathlib import Path

import environments
from posttrain import engines
from posttrain.config import ConfigError, PipelineConfig, config_from_dict
from posttrain.pipeline import report_html, store, tracking
from posttrain.pipeline.artifacts import ArtifactRef, atomic_write_text, git_sha, read_manifest, read_with_timings
from posttrain.pipeline.gates import check_gates, validate_gates
from posttrain.pipeline.nodes import RunContext, graph


def home_dir() -> Path:
    """This process's local home: POSTTRAIN_HOME, or the local mirror of a remote store (posttrain.pipeline.store)."""
    return store.home_dir()


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def check_domains(cfg: PipelineConfig) -> None:
    """Names in the config that refer to code: per-domain settings name domains of this run's world, engines
    name registered engines (checked before any work)."""
    try:
        engines.check({"runtime.rollout_engine": cfg.runtime.rollout_engine})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    known = environments.names(cfg.world.environments)
    named = {"rl.domains": cfg.rl.domains, "rl.per_domain": list(cfg.rl.per_domain),
             "sft.shortcut_share": list(cfg.sft.shortcut_share) if isinstance(cfg.sft.shortcut_share, dict) else [],
             "world.domain_knobs": list(cfg.world.domain_knobs)}
    for key, domains in named.items():
        if unknown := [d for d in domains if d not in known]:
            raise ConfigError(f"{key}: unknown domains {unknown} (known: {', '.join(known)}; add your own in "
                              f"world.environments)")
    check_benchmarks(cfg)


def check_benchmarks(cfg: PipelineConfig) -> None:
    """The benchmarks' wheels and checkers before any stage: a missing, corrupt or mispinned package, a checker
    that cannot run or a reasoning-gym task type that does not exist stops the run naming the key and the fix."""
    rg = environments.get("reasoning_gym")
    checks = {f"world.domain_knobs.{d}.rg_tasks": partial(rg.check, cfg.world.knobs(d).get("rg_tasks") or {})
              for d in environments.names(cfg.world.environments) if environments.module_name(d) == rg.__name__}
    if cfg.eval.reasoning_gym:
        checks["eval.reasoning_gym"] = partial(rg.check, cfg.eval.reasoning_gym)
    if cfg.eval.ifbench:
        checks["eval.ifbench"] = _ifbench_scores
    for key, check in checks.items():
        try:
            check()
        except (ValueError, RuntimeError) as e:  # BenchmarkPackageError is a RuntimeError
            raise ConfigError(f"{key}: {e}") from None


def _ifbench_scores() -> None:
    """The package, its data, and every checker it keeps, each run once on a reply (the prompt echoed)."""
    env = environments.get("ifbench")
    one_each = {iid: t for t in env.generate("test") for iid in t.meta["instruction_id_list"]}
    tasks = list({t.meta["key"]: t for t in one_each.values()}.values())
    env.aggregate(tasks, [t.prompt for t in tasks])


def start(cfg: PipelineConfig, *, run_id: str = "", tags: dict[str, str] | None = None,
          force: list[str] | None = None) -> RunContext:
    validate_gates(cfg)
    check_domains(cfg)
    tracking.configure(cfg.tracking.uri)
    home = home_dir()
    for killed in tracking.close_killed_runs(home):
        print(f"[pipeline] MLflow run {killed} was left RUNNING by a driver that is gone: marked KILLED", flush=True)
    run_id = run_id or new_run_id()
    run_dir = home / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
    tags = {"posttrain.run_id": run_id, "profile": cfg.profile, "git_sha": git_sha(),
            "config_digest": cfg.digest(), **tracking.driver_tags(), **(tags or {})}
    parent = tracking.start_run(str(home), f"pipeline-{run_id}", tags)
    tracking.log_result(str(home), parent, params={"profile": cfg.profile}, metrics={},
                        files=[run_dir / "config.json"])
    root = store.root_uri()
    return RunContext(run_id=run_id, home=str(home), config_json=cfg.model_dump_json(), parent_run_id=parent,
                      tags={"posttrain.pipeline_run": parent}, force=list(force or []),
                      store=root if store.is_url(root) else "")


def environment_counts(cfg: PipelineConfig, refs: dict[str, ArtifactRef]) -> dict[str, dict[str, int]]:
    """Split sizes per environment (from the data card) and hack attempts its specialist's guard blocked."""
    card = json.loads((store.local_path(refs["curate"]) / "data_card.json").read_text())["splits"]
    envs: dict[str, dict[str, int]] = {}
    for key, n in card.items():
        split, env = key.split("_", 1)
        entry = envs.setdefault(env, {"train": 0, "val": 0, "test": 0, "hack_attempts_blocked": 0})
        entry["train" if split in ("sft", "rl") else split] += n
    for env, entry in envs.items():
        if f"rl-{env}" in refs:
            entry["hack_attempts_blocked"] = int(read_manifest(store.local_path(refs[f"rl-{env}"]))["metrics"]
                                                 .get("hack_attempts_blocked", 0))
    sft_metrics = read_manifest(store.local_path(refs["sft"]))["metrics"] if "sft" in refs else {}
    envs["long_context"] = {"train": int(sft_metrics.get("long_context_examples", 0)), "val": 0,
                            "test": cfg.eval.n_per_suite * len(cfg.eval_lengths()), "hack_attempts_blocked": 0}
    return envs


def guard_and_compaction(cfg: PipelineConfig, refs: dict[str, ArtifactRef]) -> dict:
    """From the specialists that had them: the guard's judge as measured on its labelled calls, with its cost in
    RL; and compaction's sub-traces with the specialist's validation gain under it (this run's seed: the gain
    without compaction at the same budget is bench/compaction's, over seeds)."""
    out: dict = {}
    for d in cfg.rl.domains:
        r = cfg.rl.for_domain(d)
        if f"rl-{d}" not in refs or not (r.judge.checkpoint or r.context_budget):
            continue
        m = read_manifest(store.local_path(refs[f"rl-{d}"]))["metrics"]
        if r.judge.checkpoint and "judge" not in out:
            out["judge"] = {"stage": f"rl-{d}", "checkpoint": r.judge.checkpoint,
                            **{k: m.get(f"judge.{k}") for k in ("precision", "recall", "judge_tokens_per_episode",
                                                                 "labelled_calls", "blocked")}}
        if r.context_budget and r.compaction and "compaction" not in out:
            out["compaction"] = {"stage": f"rl-{d}", "context_budget": r.context_budget, "seeds": [cfg.seed],
                                 "summary": r.compaction_summary,
                                 "gain_with": round(m["val_score_after"] - m["val_score_before"], 4),
                                 "gain_without": None, "subtraces_per_episode": m.get("subtraces_per_episode")}
    return out


def moe_figures(refs: dict[str, ArtifactRef]) -> dict[str, dict[str, float]]:
    """Per stage that trained routers: the expert load's coefficient of variation over its first and last steps,
    and in RL under routing replay the mean rollout/trainer gap with and without it (rl.step's probe). From the
    metrics each ref carries: no artifact is fetched (a remote store would download every checkpoint)."""
    keys = ("moe_cv_first", "moe_cv_last", "replay_probe_with", "replay_probe_without")
    return {stage: {k: round(ref.metrics[k], 5) for k in keys if k in ref.metrics}
            for stage, ref in refs.items() if "moe_cv_first" in ref.metrics}


def finish(ctx: RunContext, refs: dict[str, ArtifactRef], wall_seconds: float, extra: dict | None = None) -> dict:
    """Write report.json (and the `latest` copy), register the final model, close the parent run. With
    `extra["stale"]` (a rerun without --downstream: nodes reused from the run it redid one node of) no gates are
    checked on the stale evaluation and nothing is registered: the scores are of the old model."""
    cfg = ctx.cfg()
    stale = (extra or {}).get("stale", [])
    home, run_dir = Path(ctx.home), Path(ctx.home) / "runs" / ctx.run_id
    report = {"run_id": ctx.run_id, "profile": cfg.profile, "mlflow_run_id": ctx.parent_run_id,
              "wall_seconds": round(wall_seconds, 1), "config_digest": cfg.digest(), "git_sha": git_sha(),
              "stages": {s: {"seconds": r.seconds, "mlflow_run_id": r.mlflow_run_id, "artifact": r.path,
                             "sha256": r.sha256, "cached": r.cached}
                         for s in graph(cfg) if (r := refs.get(s))},
              **(extra or {})}
    local = {s: store.local_path(r) for s, r in refs.items() if s in ("evaluate", "consolidation", "quantize")}
    if "evaluate" in refs:
        report.update(json.loads((local["evaluate"] / "eval.json").read_text()))
        for name in report.get("extra_plots", {}):  # shown in the run's report.html beside the eval plots
            shutil.copyfile(local["evaluate"] / name, run_dir / name)
        if "evaluate" not in stale:
            report["gates"] = check_gates(cfg, report["eval"])
    if "consolidation" in refs:
        report.update(json.loads((local["consolidation"] / "consolidation.json").read_text()))
    if "curate" in refs:
        report["environments"] = environment_counts(cfg, refs)
    report.update(guard_and_compaction(cfg, refs))
    if moe := moe_figures(refs):
        report["moe"] = moe
    passed = report.get("gates", {}).get("passed", True)
    if "quantize" in refs:
        q = refs["quantize"]
        report["quantization"] = read_with_timings(local["quantize"], "quantization.json")
        if stale:
            print(f"[pipeline] not registered: {', '.join(stale)} reused from the run this one redid a node of, "
                  f"computed from what it replaced (rerun with --downstream to redo them)", flush=True)
        elif passed:  # a model that fails its gates is not registered
            report["registered_model"] = f"{cfg.registered_model}@" + tracking.register_model(
                ctx.home, cfg.registered_model, str(local["quantize"]), q.mlflow_run_id,
                {"sha256": q.sha256, "pipeline_run": ctx.parent_run_id, "posttrain.run_id": ctx.run_id,
                 "posttrain.artifact": q.path})
    if "eval" in report:
        report["report_html"] = str(run_dir / "report.html")
        report_html.write(report, run_dir)
    text = json.dumps(report, indent=1)
    atomic_write_text(run_dir / "report.json", text)
    (run_dir / PARTIAL).unlink(missing_ok=True)
    atomic_write_text(home / "latest" / "report.json", text)
    shown = {"evaluate": ("eval.md", "eval.png"), "consolidation": ("consolidation.md", "consolidation.png")}
    for stage, names in shown.items():
        for name in names if stage in refs else ():
            shutil.copy(local[stage] / name, run_dir / name)
    pages = ("report.html", *report_html.PLOTS) if "eval" in report else ()
    files = [run_dir / "report.json"] + [run_dir / n for ns in [*shown.values(), pages] for n in ns
                                         if (run_dir / n).exists()]
    metrics = {f"{ck}.{s}": v for ck, ss in report.get("eval", {}).items() for s, v in ss.items()}
    # the parent run shows what the run read and made: every stage's artifact as a dataset, the registered model
    datasets = [(s, r.sha256, r.path) for s, r in refs.items()]
    reg = {"posttrain.registered_model": report["registered_model"]} if "registered_model" in report else {}
    tracking.log_result(ctx.home, ctx.parent_run_id, params={}, metrics={"wall_seconds": wall_seconds, **metrics},
                        files=files, datasets=datasets, tags={"posttrain.pipeline.gates": "passed" if passed else "failed", **reg})
    tracking.end_run(ctx.home, ctx.parent_run_id, "FINISHED" if passed else "FAILED")
    store.upload_run(run_dir, ctx.run_id)
    return report


PARTIAL = "partial.json"  # a failed run's finished stages: `posttrain rerun STAGE --from RUN` redoes the rest


def save_partial(ctx: RunContext, refs: dict[str, ArtifactRef], workflows: tuple[str, ...] = ("post_train",)) -> Path:
    """The stages finished so far and the workflows the run was running, in the run's folder: after every wave, so
    that a run killed in any way (kill -9, Ctrl-C, a lost machine) can be rerun from what it finished; report.json
    supersedes it."""
    cfg = ctx.cfg()
    partial = {"run_id": ctx.run_id, "profile": cfg.profile, "failed": True, "mlflow_run_id": ctx.parent_run_id,
               "workflows": list(workflows),
               "stages": {s: {"seconds": r.seconds, "mlflow_run_id": r.mlflow_run_id, "artifact": r.path,
                              "sha256": r.sha256, "cached": r.cached} for s in graph(cfg) if (r := refs.get(s))}}
    run_dir = Path(ctx.home) / "runs" / ctx.run_id
    atomic_write_text(run_dir / PARTIAL, json.dumps(partial, indent=1))
    return run_dir


def fail(ctx: RunContext, refs: dict[str, ArtifactRef], workflows: tuple[str, ...] = ("post_train",)) -> None:
    """Close the parent run as FAILED and keep the stages that finished, so the failed node can be rerun from them."""
    tracking.end_run(ctx.home, ctx.parent_run_id, "FAILED")
    store.upload_failed_run(save_partial(ctx, refs, workflows), ctx.run_id, PARTIAL)


def load_run(run: str) -> tuple[dict, PipelineConfig]:
    """An earlier run's report and config, by run id (or 'latest')."""
    store.download_run(run)
    home = home_dir()
    run_dir = home / "runs" / run if run != "latest" else None
    if run_dir is None:
        if not (home / "latest" / "report.json").exists():
            raise FileNotFoundError(f"no finished run under {home} yet (POSTTRAIN_HOME): `posttrain run` first")
        run = json.loads((home / "latest" / "report.json").read_text())["run_id"]
        run_dir = home / "runs" / run
    report_path = run_dir / "report.json"
    if not report_path.exists() and (run_dir / PARTIAL).exists():  # a failed run: the stages it finished
        n = len(json.loads((run_dir / PARTIAL).read_text())["stages"])
        print(f"[pipeline] run {run} did not finish; reusing the {n} stages it finished", flush=True)
        report_path = run_dir / PARTIAL
    if not report_path.exists():
        known = sorted(p.name for p in (home / "runs").glob("*") if (p / "report.json").exists())
        raise FileNotFoundError(f"no finished run {run!r} under {home / 'runs'} (finished runs: {known[-5:]})")
    cfg = config_from_dict(json.loads((run_dir / "config.json").read_text()), str(run_dir / "config.json"))
    return json.loads(report_path.read_text()), cfg

