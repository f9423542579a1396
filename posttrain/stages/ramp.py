"""ramp: mid-training in stages of growing sequence length (GLM-5: 4k -> 32k -> 128k -> 200k).

Per stage: RoPE base (and optional scaling) raised and written into config.json, documents packed with
their boundaries kept (positions restart, attention stays inside a document), a growing share of
long-context rows, its own token budget and LR schedule, peak memory, then long-context accuracy at
every ladder length (up to the stage's, and beyond it for contrast). Each stage's checkpoint is kept
under `stages/<seq_len>/` (and in the scratch dir, so a rerun after a crash starts at the first
unfinished stage); the artifact root holds the last one.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from transformers import AutoModelForCausalLM

from environments import long_context
from environments.base import Task
from posttrain import checkpoint_rules
from posttrain.chat import bos_ids, doc_end_id, pad_id
from posttrain.completion_eval import completion_scores
from posttrain.config import PipelineConfig, RampStage
from posttrain.data import load_pretrain_texts
from posttrain.models import attention, dsa, glm5, mtp
from posttrain.models.preset import load_checkpoint, restore, save_checkpoint, seed_all
from posttrain.packing import collate, pack, packing_efficiency
from posttrain.pipeline.console import kv
from posttrain.pipeline.memory import peak_memory
from posttrain.pipeline.store import checkpointed
from posttrain.stages.ramp_ranks import train_rung
from posttrain.train import eval_loss, moe_metrics, summarize


VAL_TASKS = 32  # long_context validation tasks per early-stop check (ramp.stages[].until_long_context)


def prose_lens(tok, tasks: list[Task], extra: int = 0) -> list[int]:
    """Tokens of each task's prose with its document markers, plus `extra`, in one batched call (the same ids as a call
    a text, fewer calls: `long_documents` counts 20,000 and more)."""
    if not tasks:  # a tokenizer refuses an empty batch
        return []
    return [len(ids) + 2 + extra for ids in tok([t.prose() for t in tasks], add_special_tokens=False)["input_ids"]]


def long_documents(tok, seq_len: int, n: int, seed: int, weight: float = 1.0,
                   digits: tuple[int, int] = (4, 4)) -> list[tuple[list[int], list[float]]]:
    """Long-context training documents (a fact buried in filler, question, then reasoning and answer) with
    lengths spread over (seq_len/8, seq_len]: the model must retrieve at every distance, not only the longest.

    Loss only on the reasoning and answer, with `weight` per token: the filler is random words, and the
    few tokens that need retrieval are a sliver of a batch's loss next to the pretraining rows (measured
    on tiny: weight 8 forms the retrieval circuit in ~500 steps at 256 tokens, weight 1 not in 1000).
    The prompt is tokenized on its own, exactly as the evaluation prompts it. `digits`: the codes' lengths, spread
    evenly from min to max (evaluation's codes have 4).
    """
    buckets = [seq_len // 8, seq_len // 4, seq_len // 2, 3 * seq_len // 4, seq_len]
    codes = range(digits[0], digits[1] + 1)
    tasks = [t for d in codes for i, L in enumerate(buckets)
             for t in long_context.fit_to_length("train", n // (len(buckets) * len(codes)),
                                                 seed * 1000 + 10 * (d - digits[0]) + i, L,
                                                 lambda ts: prose_lens(tok, ts), digits=d)]
    if not tasks:  # n below one per bucket (a tokenizer refuses an empty batch)
        return []
    eos, bos = doc_end_id(tok), bos_ids(tok)
    # one batched call each (the same ids as one call a text)
    prompts = tok([t.prose_prompt() for t in tasks], add_special_tokens=False)["input_ids"]
    answers = tok([t.prose()[len(t.prose_prompt()):] for t in tasks], add_special_tokens=False)["input_ids"]
    return [([*bos, *p, *a, eos], [0.0] * (len(bos) + len(p)) + [weight] * (len(a) + 1))
            for p, a in zip(prompts, answers)]


def eval_sets(cfg: PipelineConfig, tok) -> dict[int, list[Task]]:
    """long_context test tasks per ladder length, sized so prompt + answer fit the length."""
    return {L: long_context.fit_to_length("test", cfg.eval.n_per_suite, cfg.world.seed, L,
                                          lambda ts: prose_lens(tok, ts, cfg.eval.max_new_tokens // 2))
            for L in cfg.eval_lengths()}


def long_context_accuracy(cfg: PipelineConfig, model, tok, sets: dict[int, list[Task]]) -> dict[int, float]:
    """Completion-format accuracy at every ladder length (fewer prompts per batch as they grow)."""
    model.eval()
    acc = {}
    for L, tasks in sets.items():
        rewards, _ = completion_scores(model, tok, tasks, max_new_tokens=cfg.eval.max_new_tokens,
                                       batch_size=cfg.eval.batch_size_at(L))
        acc[L] = round(sum(rewards) / len(rewards), 4)
    return acc


def retrieval_formed(cfg: PipelineConfig, st: RampStage, tok) -> dict:
    """`train`'s early stop for a rung with `until_long_context`: long_context at the rung's length on validation
    tasks (never the test split the evaluation scores) at or above the bar. {} without one."""
    if st.until_long_context is None:
        return {}
    tasks = long_context.fit_to_length("val", VAL_TASKS, cfg.world.seed, st.seq_len,
                                       lambda ts: prose_lens(tok, ts, cfg.eval.max_new_tokens // 2))

    def formed(engine) -> bool:
        acc = long_context_accuracy(cfg, engine.hf_model(), tok, {st.seq_len: tasks})[st.seq_len]
        print(f"[ramp@{st.seq_len}] long_context on {len(tasks)} validation tasks: {acc:.3f} "
              f"(stops at {st.until_long_context})", flush=True)
        return acc >= st.until_long_context
    return {"stop_fn": formed, "stop_every": st.check_every}


def with_rope(model, stage: RampStage):
    """Rebuild the model with this stage's RoPE settings (inv_freq derives from config, is not stored)."""
    config = checkpoint_rules.rung_config(model.config, stage)
    new = restore(AutoModelForCausalLM.from_config(config).float())
    new.load_state_dict(model.state_dict())
    return new


def _sampler(cfg: PipelineConfig, k: int, short_rows: list, long_rows: list, stage: RampStage, pad_id: int):
    r = cfg.ramp
    n_long = round(r.batch_size * stage.long_share) if long_rows else 0

    def next_batch(i: int) -> dict:  # a pure function of the micro-batch index
        rng = random.Random(cfg.seed * 7919 + k * 100_003 + i)
        rows = [rng.choice(short_rows) for _ in range(r.batch_size - n_long)] + \
               [rng.choice(long_rows) for _ in range(n_long)]
        return collate(rows, pad_id, mask_documents=r.mask_documents)
    return next_batch


def plot_accuracy(curves: dict[str, dict[int, float]], trained: dict[str, int], path: Path) -> None:
    """Accuracy against length per stage: solid up to the length the stage trained at, dashed beyond."""
    import matplotlib  # matplotlib: only when plotting (a second to import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when plotting (a second to import)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, acc) in enumerate(curves.items()):
        xs = sorted(acc)
        inside = [x for x in xs if x <= trained[name]]
        line, = ax.plot(inside, [acc[x] for x in inside], marker="o", label=name, zorder=3 + i)
        if len(inside) < len(xs):
            out = xs[len(inside) - 1:] if inside else xs
            ax.plot(out, [acc[x] for x in out], marker="o", ls="--", color=line.get_color(), zorder=3 + i)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("long_context accuracy (test)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("long-context accuracy after each ramp stage\n(dashed: longer than the stage trained on)",
                 fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


DSA_CURVES = ("indexer_kl", "topk_recall")


def indexer_warmup(cfg: PipelineConfig, model, tok, next_batch, stage: RampStage, name: str) -> tuple[dict, object]:
    """GLM-5's adoption of DSA: dense attention, everything frozen but the new indexers, which learn the dense
    attention distribution (KL) before sparse training starts. (history, the model after it)"""
    d = cfg.ramp.dsa
    return train_rung(cfg, model, tok, next_batch, dict(
        steps=d.warmup_steps, lr=d.warmup_lr, warmup=max(1, d.warmup_steps // 10), desc=f"{name} indexer warm-up"),
        stage, dict(indexers=("warmup", d.kl_queries, 1.0), recompute=cfg.ramp.activation_checkpointing))


def train_stage(cfg: PipelineConfig, k: int, st: RampStage, model, tok, docs: list[list[int]],
                sets: dict[int, list[Task]], short_val: dict):
    """One rung of the ladder: RoPE + attention set, packed mixture trained, then measured."""
    r = cfg.ramp
    model = with_rope(model, st)
    own = glm5.is_glm5(model)  # GLM-5 brings its indexers: DSA's adoption trains those
    # a GLM-5 checkpoint whose indexers already select (an earlier rung before a crash, a real GLM-5) trains on
    # sparse from the first rung, without the dense warm-up
    adopted = r.attention == "dsa" and dsa.state(model) is None and glm5.dsa_adopted(model)
    adopt = r.attention == "dsa" and dsa.state(model) is None and (adopted or st.seq_len >= r.dsa_start())
    if adopt and own:
        glm5.install_dsa(model, r.dsa.top_k, r.dsa.kl_queries)
    elif adopt:
        dsa.install(model, r.dsa.top_k, r.dsa.index_share, r.dsa.heads, r.dsa.kl_queries, r.dsa.own_indexer)
    if adopt:
        dsa.state(model).kl_min_keys = r.dsa.kl_min_keys
    elif dsa.state(model) is None:  # dense stages before DSA's adoption run packed sdpa (GLM-5's indexer: sdpa)
        model = attention.use(model, ("sdpa" if own else "packed_sdpa") if r.attention == "dsa" else r.attention)
    if cfg.mtp.depth and mtp.get(model) is None:
        mtp.install(model, cfg.mtp.depth)
    short_rows = pack([(d, [1] * len(d)) for d in docs], st.seq_len)
    n_docs = r.long_docs if st.long_docs is None else st.long_docs
    long_rows = pack(long_documents(tok, st.seq_len, n_docs, cfg.seed + k, r.long_loss_weight, r.long_code_digits),
                     st.seq_len)
    name, steps = f"ramp@{st.seq_len}", r.steps(st)
    next_batch = _sampler(cfg, k, short_rows, long_rows, st, pad_id(tok))
    extra: dict[str, float] = {}

    def warm_batch(i: int) -> dict:
        return next_batch(10_000_000 + i)
    with peak_memory() as peak:
        if adopt and r.dsa.warmup_steps and not adopted:
            warm, model = indexer_warmup(cfg, model, tok, warm_batch, st, name)
            extra = {f"dsa_warmup.{key}": v for c in DSA_CURVES for key, v in summarize(warm, c).items()}
        kw = dict(steps=steps, lr=st.lr, warmup=st.warmup, min_lr_ratio=st.min_lr_ratio, grad_accum=r.grad_accum,
                  desc=name, **retrieval_formed(cfg, st, tok))
        job = dict(weight_decay=r.weight_decay, moe=cfg.moe, mtp_weight=cfg.mtp.loss_weight,
                   dsa_weight=r.dsa.kl_weight, recompute=r.activation_checkpointing,
                   indexers=("sparse", r.dsa.kl_queries, r.dsa.kl_weight) if adopt else None)
        hist, model = train_rung(cfg, model, tok, next_batch, kw, st, job)
    extra.update({key: v for c in (*DSA_CURVES, "mtp_loss", "mtp_acc1") for key, v in summarize(hist, c).items()})
    acc = long_context_accuracy(cfg, model, tok, sets)  # beyond the stage's length too: the contrast
    steps = hist.get("stopped_at", [steps])[0]
    metrics = {**summarize(hist), **moe_metrics(hist), **extra, "steps": steps,
               "tokens": steps * r.batch_size * r.grad_accum * st.seq_len,
               "peak_memory_mb": peak["mb"], "short_val_loss": round(eval_loss(model, [short_val]), 4),
               "packing_efficiency": round(packing_efficiency(short_rows + long_rows, st.seq_len), 4),
               **{f"long_context@{L}": a for L, a in acc.items()}}
    return model, {"name": name, "path": f"stages/{st.seq_len}", "history": hist, "long_context": acc,
                   "params": {**st.model_dump(mode="json"), "steps": steps}, "metrics": metrics}


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path, scratch: str = "") -> dict:
    seed_all(cfg.seed)
    r = cfg.ramp
    model, tok = load_checkpoint(inputs["base"])
    native = model.config.max_position_embeddings
    # checked before the first stage too (posttrain.stages.base.check_checkpoint); here for a rerun or a remote run
    checkpoint_rules.stage_check(cfg, model.config, inputs["base"], checkpoint_rules.ramp_attention,
                                 checkpoint_rules.ramp_dsa)
    eos, bos = doc_end_id(tok), bos_ids(tok)
    docs = [[*bos, *d, eos]
            for d in tok(load_pretrain_texts(inputs["curate"]), add_special_tokens=False)["input_ids"]]
    n_val = max(1, len(docs) // 50)
    val_docs, docs = docs[:n_val], docs[n_val:]
    short_val = collate(pack([(d, [1] * len(d)) for d in val_docs], cfg.model.max_position_embeddings)[:32],
                        pad_id(tok))
    sets = eval_sets(cfg, tok)
    curves = {"pre-ramp": long_context_accuracy(cfg, model, tok, sets)}
    metrics = {"pre_ramp.short_val_loss": round(eval_loss(model, [short_val]), 4),
               **{f"pre_ramp.long_context@{L}": a for L, a in curves["pre-ramp"].items()}}
    history, children = {}, []
    for k, st in enumerate(r.stages):
        saved = Path(scratch) / "stages" / str(st.seq_len) if scratch else None
        if saved and (saved / "stage.json").exists():  # finished before a crash
            model, _ = load_checkpoint(saved)
            child = json.loads((saved / "stage.json").read_text())
            print(f"[ramp] ramp@{st.seq_len}: finished before the crash, loaded from {saved}", flush=True)
        else:
            model, child = train_stage(cfg, k, st, model, tok, docs, sets, short_val)
            if saved:
                save_checkpoint(model, tok, saved)
                (saved / "stage.json").write_text(json.dumps(child))
                checkpointed(scratch)  # to the artifact store too, when it is remote
        save_checkpoint(model, tok, out / child["path"])
        curves[child["name"]] = {int(L): a for L, a in child["long_context"].items()}
        children.append(child)
        history.update({f"{key}@{st.seq_len}": xs for key, xs in child["history"].items()})
        metrics.update({f"{child['name']}.{key}": v for key, v in child["metrics"].items()})
        print(f"[ramp] {child['name']}: {kv(child['metrics'])}", flush=True)
    save_checkpoint(model, tok, out)
    (out / "long_context.json").write_text(json.dumps(curves, indent=1))
    plot_accuracy(curves, {"pre-ramp": native,
                           **{f"ramp@{st.seq_len}": st.seq_len for st in r.stages}}, out / "long_context.png")
    return {"metrics": {**metrics, "final_seq_len": r.stages[-1].seq_len}, "history": history,
            "children": children}
