"""bench/opd, from the sft checkpoint and specialists of the latest `make run` (`BENCH_OPD_RUN` names
another run's report).

(a) Our on-policy distillation (the default sampled-token form; `_full`: the full reverse KL over the
vocabulary, TRL's form: `steps_ratio_vs_trl_full` is the like-for-like ratio) against TRL's
(`trl.DistillationTrainer`, the on-policy GKD trainer, with beta = 1: reverse KL): same student (sft), teacher
(the specialist of BENCH_OPD_DOMAIN), prompts, batch (16 prompts, one completion each, up to 48 new tokens),
sampling and loss temperature 1 on both sides (set explicitly: the tiny profile's OPD samples at 0.6), lr and
machine, STEPS optimizer steps, no validation on either side. Figures: steps per second, and the reverse
KL(student || teacher) after the run, measured the same way for both: the exact per-token KL over the
vocabulary on completions each final student samples for 64 held-out val prompts (fixed seed), averaged
over tokens. `_full_onpolicy`: the full form with `opd.max_staleness` 0 (ours trains one version behind its
samples by default; TRL is on-policy).
Settings on each side: ours fp32, no activation checkpointing, plain temperature sampling. TRL set
explicitly and recorded as `trl_config`: `bf16=False`, `gradient_checkpointing=False` (its defaults are
True; bf16 is ~3x slower on this CPU), `top_p=1.0`, `top_k=0` (plain temperature sampling, as ours), and
the full-vocabulary reverse KL (`trl_loss_top_k` = 0, TRL's "full vocabulary"): TRL 1.16's stable
`DistillationConfig` has no `loss_top_k` at all (its trainer always sums the divergence over every
vocabulary chunk, `trl/kernels/chunked_divergence.py`); the `loss_top_k=1`, `top_p=0.95` defaults belong
to the experimental IW-OPD / server-distillation configs. Should the installed config grow a
`loss_top_k`, it is set to 0.

Beside (a): where a step's time goes. `full_step_*_s`, from the full-form run's history: seconds per step the
trainer waited for rollouts, spent in the update, and pushing weights; `component_ms_*`: the rollout, the
teacher's scoring and the update of one such batch (rolled out by the full-form run's final student, whose
completions are as long as the loop's: `component_gen_tokens` against the run's mean `full_gen_tokens`), each alone
on one thread; `floor_steps_per_s`: 2 cores divided by their sum (plus the push), the fastest this arrangement
(each part on one core) can step, and `floor_ratio_vs_trl` that over TRL's steps/s. Ours places the teacher as
the tiny profile does (`opd.teacher_placement`: inside the rollout worker), recorded in `ours_config`.

(b) Token efficiency, per domain: the RL specialist trained from sft as the tiny profile trains it against
single-teacher OPD from the same sft with that specialist as teacher (16 prompts a step), in the full
reverse-KL form and the sampled-token form; validation on 192 generated val-split tasks for both, at the
same granularity in student tokens: after the first step at or past every `val_every_student_tokens`
(BENCH_OPD_VAL_EVERY_TOKENS, default 2048: about one RL step) student tokens generated, the same N for RL
and OPD, plus the start and the last step. Figure: student tokens generated until validation first
reaches 95% of the specialist's final score, RL over OPD; the headline is the full form on the domain
where the ratio is smallest. `_gain` keys: the same until 95% of the specialist's gain over sft (sft plus 0.95
times the difference), which still tells the two apart where sft starts within 5% of the specialist.

BENCH_OPD_SEED (default 0) seeds the OPD runs on both sides (ours and TRL's), to see the students' spread.

BENCH_SMALL=1 (bench/__init__.py): from the smoke run's sft and specialists with the smoke profile's settings, 2
steps of 4 prompts and 8 new tokens, (b) on BENCH_OPD_DOMAIN alone with 8 validation tasks every 16 student
tokens, 8 prompts for the reverse KL, every run in this process (bench/__init__.py: `children_in_process`); TRL's
side only where TRL is installed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import children_in_process, mark, out_dir, peer, release_ray, size, small, smoke_stages

SMOKE_RUN = True  # small mode starts from the smoke run (bench/__init__.py)
PROFILE = size("tiny-dense", "smoke-dense")
STEPS = int(os.environ.get("BENCH_OPD_STEPS", size(20, 2)))
TEMPERATURE = 1.0  # (a): sampling and loss temperature on both sides
DOMAIN = os.environ.get("BENCH_OPD_DOMAIN", "reasoning")  # single-turn, as TRL's trainer takes it
EFF_DOMAINS = os.environ.get("BENCH_OPD_EFF_DOMAINS", size("reasoning,agentic,general", DOMAIN)).split(",")
OPD_STEPS = int(os.environ.get("BENCH_OPD_EFF_STEPS", size(100, 2)))
RL_STEPS = int(os.environ.get("BENCH_OPD_RL_STEPS", size(0, 2)))  # (b)'s RL specialist: 0 = the tiny profile's steps
# (b): validate every N student tokens on both sides (the same N), not every k steps
VAL_EVERY_TOKENS = int(os.environ.get("BENCH_OPD_VAL_EVERY_TOKENS", size(2048, 16)))
SEED = int(os.environ.get("BENCH_OPD_SEED", 0))  # the OPD runs' training seed, ours and TRL's
# TRL's best settings on this machine, set explicitly: fp32 without activation checkpointing (TRL 1.16 defaults
# to bf16 and gradient checkpointing), plain temperature sampling as ours (no nucleus, no top-k filter)
TRL_BEST = {"bf16": False, "gradient_checkpointing": False, "top_p": 1.0, "top_k": 0}
PROMPTS, MAX_NEW, LR = size(16, 4), size(48, 8), 2e-4
# (b)'s OPD forms and their lr: the full reverse KL (the headline) and the sampled-token form at the tiny
# profile's lr; 100 steps of 16 prompts
EFF_FORMS = {"full": 2e-4, "sampled": 1e-4}
VAL_TASKS = size(192, 8)  # reasoning has 197 distinct val problems at the tiny knobs
KL_PROMPTS = size(64, 8)  # held-out prompts of the reverse KL after a run
OUT = out_dir()


def _inputs() -> dict[str, str]:
    if small():
        return smoke_stages()
    report = Path(os.environ.get("BENCH_OPD_RUN", ".posttrain/latest/report.json"))
    if not report.exists():
        sys.exit(f"bench/opd needs sft and specialist checkpoints: {report} does not exist; run `make run` first")
    return {k: v["artifact"] for k, v in json.loads(report.read_text())["stages"].items()}


def _val(domain: str) -> list:
    import environments
    from posttrain.config import load_config
    return environments.get(domain).generate("val", VAL_TASKS, 0, **load_config(PROFILE).world.knobs())


def _loop_config(**over):
    from posttrain.config import load_config
    from posttrain.stages.opd import loop_config
    cfg = load_config(PROFILE)
    return loop_config(cfg).model_copy(update={"checkpoint_every": 0, **over})


def _ours_opd(domain: str, steps: int, val_every_tokens: int, save: str = "", loss: str = "sampled", lr: float = LR,
              temperature: float | None = None, max_staleness: int | None = None) -> dict:
    """Single-teacher OPD from sft (child process: its own Ray, its own clock). `val_every_tokens` 0: no
    validation (start and end only); `temperature`, `max_staleness` None: the tiny profile's."""
    import torch

    from posttrain.config import RuntimeConfig, load_config
    from posttrain.data import load_tasks
    from posttrain.models.preset import save_checkpoint
    from posttrain.pipeline.raysupport import ensure_ray
    from posttrain.rl.loop import Distill, mean_step_times, train_policy
    torch.set_num_threads(1)  # trainer, rollout worker and teacher: one thread each on the 2 cores
    ensure_ray(RuntimeConfig())
    art = _inputs()
    r = _loop_config(steps=steps, val_every=0, val_every_tokens=val_every_tokens, lr=lr,
                     **({"temperature": temperature} if temperature is not None else {}),
                     **({"max_staleness": max_staleness} if max_staleness is not None else {}))
    pool = load_tasks(art["curate"], "rl", domain)
    val = _val(domain) if val_every_tokens else pool[:2]
    placement = load_config(PROFILE).opd.teacher_placement  # the profile's: the teacher inside the rollout worker
    distill = Distill({domain: art[f"rl-{domain}"]}, pool, PROMPTS, mode=loss, teacher_placement=placement)
    policy, tok, st = train_policy(r, art["sft"], [], val, seed=SEED, label=f"bench opd {domain}", distill=distill)
    release_ray()
    if save:
        save_checkpoint(policy, tok, Path(save))
    h = st.history
    return {"wall_s": h["wall_s"][-1], "val": h["val_score"], "tokens": h["student_tokens"],
            "teacher_tokens": h["teacher_tokens"][-1], "reverse_kl": h["reverse_kl"],
            "step_times": mean_step_times(h), "gen_tokens": sum(h["gen_tokens"]) / len(h["gen_tokens"]),
            "temperature": r.temperature, "max_staleness": r.max_staleness, "teacher_placement": placement}


def _ours_rl(domain: str, val_every_tokens: int) -> dict:
    import torch

    from posttrain.config import RuntimeConfig, load_config
    from posttrain.data import load_tasks
    from posttrain.pipeline.raysupport import ensure_ray
    from posttrain.rl.loop import train_policy
    torch.set_num_threads(1)
    ensure_ray(RuntimeConfig())
    art = _inputs()
    r = load_config(PROFILE).rl.for_domain(domain).model_copy(
        update={"val_every": 0, "val_every_tokens": val_every_tokens, "checkpoint_every": 0,
                **({"steps": RL_STEPS} if RL_STEPS else {})})
    _, _, st = train_policy(r, art["sft"], load_tasks(art["curate"], "rl", domain),
                          _val(domain), seed=0, label=f"bench rl {domain}")
    release_ray()
    h = st.history
    return {"wall_s": h["wall_s"][-1], "val": h["val_score"], "tokens": h["student_tokens"]}


def _trl(steps: int, save: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer

    from posttrain.data import load_tasks
    torch.set_num_threads(2)
    art = _inputs()
    tok = AutoTokenizer.from_pretrained(art["sft"])
    tasks = load_tasks(art["curate"], "rl", DOMAIN)
    rows = [{"prompt": tok.apply_chat_template(t.messages(), tokenize=False, add_generation_prompt=True,
                                               enable_thinking=True)} for t in tasks]
    # full-vocabulary reverse KL: TRL 1.16's DistillationConfig has no loss_top_k (always the whole vocabulary);
    # where a TRL config has one, 0 means the full vocabulary
    full_vocab = {"loss_top_k": 0} if "loss_top_k" in {f.name for f in dataclasses.fields(DistillationConfig)} else {}
    args = DistillationConfig(**TRL_BEST, **full_vocab,
                              output_dir=str(OUT / "opd-trl"), per_device_train_batch_size=PROMPTS,
                              max_completion_length=MAX_NEW, learning_rate=LR, beta=1.0, temperature=TEMPERATURE,
                              max_steps=steps, use_cpu=True,
                              logging_steps=1, save_strategy="no", report_to=[], seed=SEED, disable_dropout=True,
                              lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.95, weight_decay=0.0)
    student = AutoModelForCausalLM.from_pretrained(art["sft"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(art[f"rl-{DOMAIN}"], dtype=torch.float32)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                  train_dataset=Dataset.from_list(rows), processing_class=tok)
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    trainer.model.save_pretrained(save)
    tok.save_pretrained(save)
    config = {k: getattr(args, k) for k in (
        "bf16", "fp16", "gradient_checkpointing", "activation_checkpointing", "top_p", "top_k", "temperature",
        "beta", "max_completion_length", "use_vllm", "torch_compile",
    )}
    config |= {"loss_top_k": getattr(args, "loss_top_k", 0), "loss_top_k_setting": bool(full_vocab),
               "loss_support": "full vocabulary"}  # as it ran
    return {"wall_s": wall, "loss": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "trl_config": config}


def _components(student: str, reps: int = size(5, 1)) -> dict:
    """The three parts of an OPD step of (a), each alone in this process on one thread (median ms of `reps` after
    two warm-ups): the rollout of PROMPTS prompts drawn at random as the loop draws them, the teacher's scoring of
    them (full vocabulary), and the trainer's update on them. Rollouts by `student`, the full-form run's final
    student: its completions are as long as the loop's (the sft checkpoint's are half as long, and timing those
    put the floor at 2.06x TRL where it is 1.5-1.8x). Together (plus the weight push) the parts bound how fast a step
    can be on 2 cores when each part runs on one of them: half their sum."""
    import random
    import statistics

    import torch

    from posttrain.data import load_tasks
    from posttrain.engines import train_engine
    from posttrain.rl.opd_loss import distill_backward
    from posttrain.rl.teachers import Teacher
    from posttrain.rl.workers import RolloutWorker
    torch.set_num_threads(1)
    art = _inputs()
    pool = load_tasks(art["curate"], "rl", DOMAIN)
    worker, teacher = RolloutWorker(student), Teacher(art[f"rl-{DOMAIN}"])
    policy = train_engine("torch", art["sft"], lr=LR)
    state: dict = {"i": 0}

    def generate():
        state["i"] += 1
        tasks = random.Random(state["i"]).sample(pool, PROMPTS)
        state["samples"] = worker.rollout(tasks, 1, seed=state["i"], temperature=TEMPERATURE,
                                          max_new_tokens=MAX_NEW)[0]

    def score():
        items = [(s.prompt_ids, s.ids, s.gen_mask) for s in state["samples"]]
        for s, t in zip(state["samples"], teacher.score(items, "full", 16, TEMPERATURE)):
            s.teacher = t

    def update():
        policy.train()
        policy.zero_grad()
        distill_backward(policy, state["samples"], mode="full", temperature=TEMPERATURE)
        policy.step(1.0)
        policy.eval()

    times: dict[str, list[float]] = {"generate": [], "teacher": [], "update": []}
    tokens = []
    for i in range(reps + 2):  # a fresh batch each round, its three parts timed in turn
        for name, fn in (("generate", generate), ("teacher", score), ("update", update)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        tokens.append(sum(s.n_generated for s in state["samples"]) / PROMPTS)
    return {**{name: 1000 * statistics.median(v[2:]) for name, v in times.items()},
            "gen_tokens": statistics.mean(tokens[2:])}


def reverse_kl_on_own_samples(student_dir: str, teacher_dir: str, n: int = KL_PROMPTS) -> float:
    """Exact per-token KL(student || teacher) over the vocabulary, on the student's own completions (T=1,
    fixed seed) for n held-out val prompts, averaged over generated tokens."""
    import torch

    from posttrain.data import load_tasks
    from posttrain.models.preset import load_checkpoint
    from posttrain.rl.opd_loss import reverse_kl_terms
    from posttrain.rl.batches import completion_batch
    from posttrain.models.prefix import prefix_forward
    from posttrain.rl.workers import RolloutWorker
    art = _inputs()
    tasks = load_tasks(art["curate"], "val", DOMAIN)[:n]
    samples, _ = RolloutWorker(student_dir).rollout(tasks, 1, seed=1234, temperature=1.0, max_new_tokens=MAX_NEW)
    student, tok = load_checkpoint(student_dir)
    teacher, _ = load_checkpoint(teacher_dir)
    with torch.no_grad():
        ls = torch.log_softmax(prefix_forward(student.eval(), samples, tok.pad_token_id), -1)
        lt = torch.log_softmax(prefix_forward(teacher.eval(), samples, tok.pad_token_id), -1)
        for s, row in zip(samples, lt):
            s.teacher = row[[j for j, m in enumerate(s.gen_mask) if m]].numpy()
        b = completion_batch(samples)
        kl = reverse_kl_terms(ls, b["ids"], samples, "full")
    return float((kl * b["mask"]).sum() / b["mask"].sum())


def tokens_to(run: dict, target: float) -> float | None:
    tokens = [0.0] + run["tokens"]
    return next((tokens[step] for step, v in run["val"] if v >= target - 1e-9), None)


def _child(what: str, *args) -> dict:
    """`python -m bench.opd what args` (its own process, Ray and clock); small mode: the same in this process, Ray
    kept up between children (a child process would spend ~15 s of its ~18 starting Ray and its workers)."""
    out = OUT / f"opd-{what}.json"
    if children_in_process():
        _run(what, list(map(str, args)))
    else:
        subprocess.run([sys.executable, "-m", "bench.opd", what, *map(str, args)], check=True)
    return json.loads(out.read_text())


def _run(what: str, rest: list[str]) -> None:
    if what == "opd":
        result = _ours_opd(rest[0], int(rest[1]), int(rest[2]), *rest[3:5], *map(float, rest[5:7]),
                           *map(int, rest[7:]))
    elif what == "rl":
        result = _ours_rl(rest[0], int(rest[1]))
    elif what == "components":
        result = _components(rest[0])
    else:
        result = _trl(int(rest[0]), rest[1])
    (OUT / f"opd-{what}.json").write_text(json.dumps(result))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    art = _inputs()
    with_trl = peer("trl", "opd")  # at full size TRL must be installed: fail before the runs
    teacher = art[f"rl-{DOMAIN}"]
    ours = _child("opd", DOMAIN, STEPS, 0, OUT / "opd-ours-student", "sampled", LR, TEMPERATURE)
    full = _child("opd", DOMAIN, STEPS, 0, OUT / "opd-ours-full-student", "full", LR, TEMPERATURE)  # TRL's form
    # the same on-policy (max_staleness 0), as TRL is: does our one step of staleness cost distance to the teacher?
    onpolicy = _child("opd", DOMAIN, STEPS, 0, OUT / "opd-ours-full-onpolicy-student", "full", LR, TEMPERATURE, 0)
    trl = _child("trl", STEPS, OUT / "opd-trl-student") if with_trl else None
    fig = {"domain": DOMAIN, "steps": STEPS, "prompts_per_step": PROMPTS, "seed": SEED,
           "steps_per_s": STEPS / ours["wall_s"], "steps_per_s_trl": STEPS / trl["wall_s"] if trl else None,
           "reverse_kl_before": reverse_kl_on_own_samples(art["sft"], teacher),
           "reverse_kl_after_n": reverse_kl_on_own_samples(str(OUT / "opd-ours-student"), teacher),
           "reverse_kl_after_n_trl": reverse_kl_on_own_samples(str(OUT / "opd-trl-student"), teacher) if trl else None,
           "steps_per_s_full": STEPS / full["wall_s"],
           "reverse_kl_after_n_full": reverse_kl_on_own_samples(str(OUT / "opd-ours-full-student"), teacher),
           "steps_per_s_full_onpolicy": STEPS / onpolicy["wall_s"],
           "reverse_kl_after_n_full_onpolicy": reverse_kl_on_own_samples(str(OUT / "opd-ours-full-onpolicy-student"),
                                                                         teacher)}
    trl_rate = fig["steps_per_s_trl"]
    fig["steps_ratio_vs_trl"] = fig["steps_per_s"] / trl_rate if trl else None
    fig["steps_ratio_vs_trl_full"] = fig["steps_per_s_full"] / trl_rate if trl else None  # same loss on both sides
    fig |= {f"full_step_{k}": v for k, v in full["step_times"].items()}
    # the floor of this arrangement: the parts' single-thread CPU time (and the push) spread over 2 cores
    parts = _child("components", OUT / "opd-ours-full-student")
    fig["component_gen_tokens"] = parts.pop("gen_tokens")  # per completion, beside the loop's own mean
    fig["full_gen_tokens"] = full["gen_tokens"]
    fig |= {f"component_ms_{k}": v for k, v in parts.items()}
    fig["floor_steps_per_s"] = 2000 / (sum(parts.values()) + 1000 * full["step_times"]["push_s"])
    fig["floor_ratio_vs_trl"] = fig["floor_steps_per_s"] / trl_rate if trl else None
    if trl:
        fig |= {"trl_config": trl["trl_config"], "trl_loss_top_k": trl["trl_config"]["loss_top_k"],
                "trl_top_p": trl["trl_config"]["top_p"], "trl_bf16": trl["trl_config"]["bf16"],
                "trl_gradient_checkpointing": trl["trl_config"]["gradient_checkpointing"]}
    fig |= {"ours_config": {"bf16": False, "gradient_checkpointing": False, "top_p": 1.0,
                            "temperature": ours["temperature"], "max_staleness": ours["max_staleness"],
                            "teacher_placement": ours["teacher_placement"]},
            "val_every_student_tokens": VAL_EVERY_TOKENS}
    curves = {}
    for d in EFF_DOMAINS:
        rl = _child("rl", d, VAL_EVERY_TOKENS)
        sft_val, spec_val = rl["val"][0][1], rl["val"][-1][1]
        # 95% of the specialist's score; and 95% of its gain over sft, which still separates the two where sft
        # starts within 5% of the specialist (then both pass the first target at their first validation)
        targets = {"": 0.95 * spec_val, "_gain": sft_val + 0.95 * (spec_val - sft_val)}
        fig |= {f"specialist_val_{d}": spec_val, f"sft_val_{d}": sft_val}
        fig |= {f"rl_student_tokens_to_95pct{t}_{d}": tokens_to(rl, v) for t, v in targets.items()}
        curves[d] = {"rl": rl, "target": targets[""], "target_gain": targets["_gain"]}
        for form, lr in EFF_FORMS.items():
            opd = _child("opd", d, OPD_STEPS, VAL_EVERY_TOKENS, "", form, lr)
            sfx = "" if form == "full" else f"_{form}"
            for t, v in targets.items():
                rl_t = fig[f"rl_student_tokens_to_95pct{t}_{d}"]
                opd_t = tokens_to(opd, v)  # teacher tokens scored = student tokens: each is scored once
                fig |= {f"opd_student_tokens_to_95pct{t}_{d}{sfx}": opd_t,
                        f"token_efficiency_ratio{t}_{d}{sfx}": rl_t / opd_t if rl_t and opd_t else None}
            curves[d][f"opd_{form}"] = opd
    # the headline: the domain where OPD's advantage is smallest
    worst = min(EFF_DOMAINS, key=lambda d: fig[f"token_efficiency_ratio_{d}"] or 0.0)
    fig |= {"token_efficiency_domain": worst, "token_efficiency_form": "full",
            "rl_student_tokens_to_95pct": fig[f"rl_student_tokens_to_95pct_{worst}"],
            "opd_student_tokens_to_95pct": fig[f"opd_student_tokens_to_95pct_{worst}"],
            "token_efficiency_ratio": fig[f"token_efficiency_ratio_{worst}"]}
    (OUT / "opd.json").write_text(json.dumps(mark({**fig, "curves": curves}), indent=1))
    _plot(curves, OUT / "opd.png")
    for k, v in mark(fig).items():
        if not isinstance(v, dict):
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")


def _plot(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    f, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.4), squeeze=False)
    for ax, (d, c) in zip(axes[0], curves.items()):
        for name, label in (("rl", "RL specialist"), *((f"opd_{f}", f"OPD, {f}") for f in EFF_FORMS)):
            tokens = [0.0] + c[name]["tokens"]
            ax.plot([tokens[s] for s, _ in c[name]["val"]], [v for _, v in c[name]["val"]], "o-", ms=3, label=label)
        ax.axhline(c["target"], ls=":", c="grey", label="95% of the specialist")
        ax.axhline(c["target_gain"], ls="--", c="grey", lw=0.8, label="95% of its gain over sft")
        ax.set_xscale("symlog", linthresh=1000)  # linear to 1000 tokens (the start), log beyond
        ax.set(xlim=(0, None), xlabel="student tokens generated", ylabel="validation accuracy", title=d)
        ax.legend(loc="lower right", fontsize=7)
    f.tight_layout()
    f.savefig(path, dpi=110)
    plt.close(f)


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2:])
