"""The DAG as data: its stages, what each consumes, the waves they run in. Light on purpose (the config
only): the CLI checks stage names with it before importing torch, Ray, Flyte or MLflow; posttrain.pipeline.nodes runs
the nodes."""
from __future__ import annotations

from dataclasses import dataclass

from posttrain.config import PipelineConfig
from posttrain.engines import registry


@dataclass(frozen=True)
class Stage:
    name: str
    fn: str                      # "module:function" doing the work
    inputs: tuple[str, ...]      # upstream stage names
    sections: tuple[str, ...]    # config sections that change its output (PipelineConfig.section)
    task: str                    # "module:task": its typed Flyte task (tasks/); arguments bound by name (bind)
    params: tuple[tuple[str, str], ...] = ()
    num_cpus: float = 1.0        # Ray CPUs reserved; the specialists take a share so they run at once
    threads: int = 2
    resumable: bool = False      # gets a `scratch` dir that survives a crash, for its training checkpoints
    gpu: bool = True             # its task computes on the run's device (sft's Ray Train workers ask themselves)
    workflow: str = "post_train"  # post_train: the GLM-5.2 DAG; cross_stage: the GLM-5 chains and comparison


CHAINS = ("xs", "seq")  # cross-stage distillation; plain sequential RL


# what trains a stage's model, and the engines' own settings (megatron's split): part of the cache key of the stages
# that use it
TRAIN_ENGINE = ("runtime.train_engine", *(e.section for e in registry.TRAIN.values() if e.section))
# what generates the rollouts, teachers' scores and evaluations (its samples differ from another engine's)
ROLLOUT_ENGINE = "runtime.rollout_engine"
ENGINES = (*TRAIN_ENGINE, ROLLOUT_ENGINE)  # the RL stages': both


def stage_name(chain: str, domain: str, order: list[str]) -> str:
    """A stage of a GLM-5 chain over the RL domains in `order`; both chains start at the first specialist."""
    return f"rl-{domain}" if domain == order[0] else f"{chain}-{domain}"


def _chain_inputs(chain: str, domain: str, order: list[str]) -> tuple[str, ...]:
    """The previous stage (the start), and for `xs` every earlier stage (the teachers)."""
    earlier = [stage_name(chain, d, order) for d in order[:order.index(domain)]]
    return tuple(dict.fromkeys([earlier[-1], *(earlier if chain == "xs" else []), "curate"]))


def checkpoints(cfg: PipelineConfig) -> dict[str, str]:
    """Evaluated checkpoint -> the stage that made it: one specialist per domain of rl.domains."""
    return {"base": "base", "ramped": "ramp", "sft": "sft", **{f"specialist/{d}": f"rl-{d}" for d in cfg.rl.domains},
            "generalist": "opd", "quantized": "quantize"}


def graph(cfg: PipelineConfig) -> dict[str, Stage]:
    """The DAG of a run: the only place that says what each stage consumes. The workflows derive their nodes
    and waves from it (waves), and every domain of `rl.domains` gets its specialist, its OPD teacher, its
    cross-stage chain stages and its consolidation row."""
    order = list(cfg.rl.domains)
    specialists = [f"rl-{d}" for d in order]
    chain = [stage_name(c, d, order) for d in order[1:] for c in CHAINS]
    evaluated = ("base", "ramp", "sft", *specialists, "opd", "quantize", "curate")
    stages = [
        Stage("raw", "posttrain.stages.curate:make_raw", (), ("world", "curate"), "tasks.curate:raw", num_cpus=1,
              threads=1, gpu=False),
        # curate only waits on its per-file Ray tasks, so it reserves almost nothing itself
        Stage("curate", "posttrain.stages.curate:run", ("raw",), ("world", "curate"), "tasks.curate:curate",
              num_cpus=0.1, threads=1, gpu=False),
        Stage("base", "posttrain.stages.base:run", ("curate",), ("seed", "tokenizer", "model", "base", "moe"),
              "tasks.base:base"),
        Stage("ramp", "posttrain.stages.ramp:run", ("base", "curate"),
              ("seed", "world.seed", "model", "ramp", "mtp", "moe", "eval.n_per_suite", "eval.max_new_tokens",
               "eval.batch_size", *TRAIN_ENGINE),
              "tasks.ramp:ramp", resumable=True),
        # sft trains in its own task (one torch rank) or waits on its Ray Train workers; base: the model whose
        # answers it replays
        Stage("sft", "posttrain.stages.sft:run", ("base", "ramp", "curate"),
              ("seed", "sft", "mtp", "moe", "lora", *TRAIN_ENGINE),
              "tasks.sft:sft", num_cpus=1.0 if cfg.sft_in_process() else 0.1, resumable=True,
              gpu=cfg.sft_in_process()),
        # 3 x (0.4 + one 0.25-CPU rollout worker) fits 2 CPUs: three specialists run at once, more queue in Ray
        *[Stage(f"rl-{d}", "posttrain.stages.specialist:run", ("sft", "curate"),
                ("seed", f"rl:{d}", "moe", "lora", *ENGINES), "tasks.rl:rl", (("domain", d),), num_cpus=0.4,
                threads=1, resumable=True) for d in order],
        # the trainer, one rollout worker (0.25) and a teacher per domain (0.2 each): 1.35 CPUs for three
        # with opd.everyday_prompts or a route to "base", the base model is one more teacher; with opd.base_weight it
        # is averaged into the generalist
        Stage("opd", "posttrain.stages.opd:run",
              ("sft", "curate", *specialists, *(("base",) if cfg.opd.uses_base() else ())),
              ("seed", "opd", "rl", "moe", "lora", *ENGINES), "tasks.opd:opd", num_cpus=0.5, threads=1, resumable=True),
        Stage("quantize", "posttrain.stages.quantize:run", ("opd", "curate"), ("seed", "quantize"),
              "tasks.quantize:quantize"),
        # on CPU evaluate's checkpoints run as Ray tasks of one CPU each (posttrain.stages.evaluate): it reserves little
        Stage("evaluate", "posttrain.stages.evaluate:run", evaluated,
              ("seed", "world.seed", "eval", "rl", "model", "ramp", ROLLOUT_ENGINE), "tasks.evaluate:evaluate",
              num_cpus=0.1),
    ]
    if len(order) > 1:  # the GLM-5 chains (with distillation, xs-, and without, seq-) after the first specialist
        stages += [Stage(stage_name(c, d, order), "posttrain.stages.cross_stage:run", _chain_inputs(c, d, order),
                         ("seed", "rl", "cross_stage", "opd", "moe", "lora", *ENGINES), "tasks.cross_stage:chain_stage",
                         (("domain", d), ("chain", c)), num_cpus=0.4, threads=1, resumable=True,
                         workflow="cross_stage") for d in order[1:] for c in CHAINS]
        stages.append(Stage("consolidation", "posttrain.stages.consolidation:run",
                            ("sft", "curate", *specialists, "opd", *chain), ("seed", "eval", "rl", "cross_stage"),
                            "tasks.cross_stage:consolidation", workflow="cross_stage"))
    return {s.name: s for s in stages}


def waves(stages: dict[str, Stage], workflow: str) -> list[list[str]]:
    """The stages of one workflow in waves: each wave's stages need only earlier waves (or stages of another
    workflow, which run before), so a wave's stages run at once."""
    level: dict[str, int] = {}
    for s in stages.values():  # the table is in dependency order
        if s.workflow == workflow:
            level[s.name] = 1 + max((level[i] for i in s.inputs if i in level), default=-1)
    return [[s for s in level if level[s] == k] for k in range(max(level.values(), default=-1) + 1)]


def upstream(stages: dict[str, Stage], stage: str) -> set[str]:
    """`stage` and every stage it (transitively) consumes."""
    return {stage}.union(*(upstream(stages, i) for i in stages[stage].inputs))


def downstream(stages: dict[str, Stage], stage: str) -> list[str]:
    """`stage` and every stage that (transitively) consumes it, in DAG order."""
    hit = {stage}
    for s in stages.values():
        if set(s.inputs) & hit:
            hit.add(s.name)
    return [s for s in stages if s in hit]
