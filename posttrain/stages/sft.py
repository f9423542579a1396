"""sft: chat-template demonstrations with thinking on or off per conversation; assistant-only loss."""
from __future__ import annotations

import gc
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

import environments
from environments import long_context
from environments.base import Task
from posttrain import checkpoint_rules, replay
from posttrain.chat import ChatFormatError, chat_format, pad_id, render_ids, render_with_mask
from posttrain.config import PipelineConfig
from posttrain.data import load_tasks
from posttrain.device import device, stage_gpus
from posttrain.engines import as_rollout_engine, lm_engine, registry, supports
from posttrain.models import attention, dsa, glm5, moe, mtp
from posttrain.models.preset import load_checkpoint, save_checkpoint, seed_all
from posttrain.packing import collate, pack
from posttrain.pipeline.store import checkpointed, train_storage
from posttrain.train import flat_examples, moe_metrics, pad_examples, summarize, train

STATE = "state.pt"
ENGINE = "engine"  # a sharded engine's ranks' own resume shards (save_sharded)


def conversation(task: Task, thinking: bool, shortcut: bool = False) -> list[dict]:
    """The task's demonstration (or its environment's lazy-teacher `shortcut`); with thinking off every
    assistant turn has an empty think block."""
    lazy = getattr(environments.get(task.domain), "shortcut", None) if shortcut else None
    demo = lazy(task) if lazy else task.demo
    demo = [m if thinking or m["role"] != "assistant" else {**m, "reasoning_content": ""} for m in demo]
    return task.messages() + demo


def build_examples(cfg: PipelineConfig, tok, tasks: list[Task], seed: int) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per task, mixing the modes: thinking off for `nothink_share` of the conversations,
    earlier turns' thinking kept in the history for `preserve_thinking_share` (always where the task's meta says
    `preserve_thinking`: the form its rollouts see), a lazy teacher's demonstration for `shortcut_share`."""
    rng, lazy = random.Random(seed), random.Random(seed + 1)  # own stream: the mode mix stays as it was
    s = cfg.sft
    out = []
    for t in tasks:
        thinking = rng.random() >= s.nothink_share
        preserve = rng.random() < s.preserve_thinking_share or t.meta.get("preserve_thinking", False)
        out.append(render_with_mask(tok, conversation(t, thinking, lazy.random() < s.shortcut_for(t.domain)),
                                    enable_thinking=thinking, preserve_thinking=preserve))
    return out


def check_masks(examples: list[tuple[list[int], list[int]]], tok, node: str = "sft") -> None:
    """Stop before training when the template leaves nothing to learn: an all-zero loss mask trains nothing,
    and a run that 'finishes' on it would be a silent no-op."""
    empty = sum(not any(m) for _, m in examples)
    if empty == len(examples):
        raise ChatFormatError(f"{node}: every loss mask is empty with the checkpoint's chat template "
                              f"({chat_format(tok).template}, from {getattr(tok, 'name_or_path', '?')}): no "
                              f"assistant turn renders as a continuation of its generation prompt")
    if empty:
        print(f"[{node}] {empty} of {len(examples)} conversations have no trainable assistant turn", flush=True)


def _long_tasks(tok, split: str, n: int, seed: int, max_len: int) -> list[Task]:
    def count(tasks):
        return [len(render_ids(tok, conversation(t, True))) for t in tasks]
    lengths = [max_len // 4, max_len // 2, max_len]
    return [t for i, L in enumerate(lengths) for t in long_context.fit_to_length(split, n // 3, seed + i, L, count)]


def _batches(cfg: PipelineConfig, examples: list) -> Callable[[int], list]:
    """The conversations of micro-batch `i` of the global data order (`sft.packing`: its packed rows): a pure
    function of `i` (exact resume needs no cursor file).

    `sft.packing`: `batch_size` rows of `seq_len` tokens, conversations packed best-fit with their
    boundaries kept (positions restart, attention stays inside each). Otherwise length buckets: a padded batch
    is as wide as its longest row, so one long-context example would make the whole batch `seq_len` wide.
    """
    s = cfg.sft
    if s.packing:
        rows = pack(examples, s.seq_len)

        def next_packed(i: int) -> list:
            rng = random.Random(cfg.seed * 31 + i)
            return [rows[rng.randrange(len(rows))] for _ in range(s.batch_size)]
        return next_packed
    buckets: dict[int, list] = {}
    for ex in examples:
        buckets.setdefault(min(s.seq_len, 1 << max(6, (len(ex[0]) - 1).bit_length())), []).append(ex)
    keys = sorted(buckets)

    def next_batch(i: int) -> list:
        rng = random.Random(cfg.seed * 31 + i)
        bucket = buckets[rng.choices(keys, weights=[len(buckets[k]) for k in keys])[0]]
        return [bucket[rng.randrange(len(bucket))] for _ in range(s.batch_size)]
    return next_batch


def collator(tok, model, max_len: int, packing: bool = False) -> Callable[[list], dict]:
    """Conversations (`packing`: rows of packed conversations) -> tensors. Where the model's attention reads
    documents from the positions (posttrain.models.attention.padding_free), all of them go in as one row without padding
    (1.3-1.4x faster steps on bench/sft's tiny-model batches, 38% padding; the stage's length buckets pad 27%); else
    padded rows."""
    pad = pad_id(tok)
    if attention.padding_free(model):
        if packing:
            return lambda rows: flat_examples([ex for row in rows for ex in row], pad, max_len)
        return lambda examples: flat_examples(examples, pad, max_len)
    if packing:
        return lambda rows: collate(rows, pad)
    return lambda examples: pad_examples(examples, pad, max_len)


def _worker(config: dict) -> None:
    """One Ray Train worker: resume from the latest reported checkpoint if any, train, report checkpoints."""
    import ray.train  # ray: only where the work spreads over Ray workers
    import ray.train.torch
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    sharded = supports(config["cfg"], registry.SHARDED_STATE)
    state, resume = None, tempfile.mkdtemp(prefix="posttrain-sft-resume-")  # a sharded engine reads it when it starts
    if (ckpt := ray.train.get_checkpoint()) is not None:
        ckpt.to_directory(resume)
        state = _load_state(Path(resume), sharded)

    def report(metrics: dict, d: str) -> None:  # Ray Train gathers every worker's files into the one checkpoint
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 or sharded
                         else None)
    try:
        _train_rank(config, rank, state, report, ray.train.torch.prepare_model)
    finally:
        shutil.rmtree(resume, ignore_errors=True)


def _load_state(d: Path, sharded: bool) -> dict:
    state = torch.load(d / STATE, weights_only=False)
    if sharded:  # the ranks' shards and optimizer moments, which the engine loads itself
        state["engine"] = {"dist_checkpoint": str(d / ENGINE)}
    return state


def _train_rank(config: dict, rank: int, state: dict | None, report: Callable[[dict, str], None],
                prepare: Callable) -> None:
    """One rank's training loop from `state` (None: from the start); each checkpoint is written to a folder
    and given to `report` with its metrics; `prepare` readies the model for the ranks (DDP, its device)."""
    cfg: PipelineConfig = config["cfg"]
    s = cfg.sft
    torch.set_num_threads(config["threads"])
    seed_all(cfg.seed)
    model, tok = with_mtp(cfg, *load_checkpoint(config["init"]))
    sharded = supports(cfg, registry.SHARDED_STATE)
    if state is not None:
        model.load_state_dict(state["model"])
        print(f"[sft] resuming at step {state['step']} of {s.steps}", flush=True)
    to_batch, to_val = collator(tok, model, s.seq_len, s.packing), collator(tok, model, s.seq_len)
    # DSA adopted: the indexers keep training on their KL to the dense attention, as in the ramp's sparse rungs.
    # Frozen, they select from hidden states that sft moves: on tiny, long_context@512 fell 1.00 -> 0.45 in sft
    dsa_cfg, indexers = cfg.ramp.dsa, {}
    if glm5.dsa_adopted(model):  # GLM-5's own indexers: the loaded model selects, but collects no KL
        glm5.install_dsa(model, model.config.index_topk, dsa_cfg.kl_queries)
    if dsa.state(model) is not None:
        dsa.state(model).kl_min_keys = dsa_cfg.kl_min_keys
        indexers = dict(dsa_weight=dsa_cfg.kl_weight, indexers=("sparse", dsa_cfg.kl_queries, dsa_cfg.kl_weight))
    # the engine's ranks: DDP replicas (torch), or tp x pp x cp of them holding one replica and seeing one batch
    engine = lm_engine(cfg, model, tok, config["init"], lr=s.lr, weight_decay=s.weight_decay, moe=cfg.moe,
                       mtp_weight=cfg.mtp.loss_weight, prepare=prepare, stage="sft", **indexers)
    shard, shards = engine.data_shard()
    global_batch = _batches(cfg, config["examples"])

    def next_batch(i: int) -> dict:  # this data-parallel rank's share of the global batch
        return to_batch(global_batch(i)[shard::shards])

    val_batches = [to_val(config["val"][i:i + s.batch_size]) for i in range(0, len(config["val"]), s.batch_size)]

    def checkpoint(st: dict) -> None:
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save(st, Path(d) / STATE)
            if sharded:  # every rank writes its own shards
                engine.save_sharded(Path(d) / ENGINE)
            report({"step": st["step"], "loss": st["hist"]["loss"][-1]}, d)
        if os.environ.get("POSTTRAIN_SFT_KILL_AT_STEP") == str(st["step"]):  # fault injection for the resume test
            time.sleep(3)  # die mid-way through the next step (Ray Train: once it registered the checkpoint)
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        train(engine, next_batch, steps=s.steps, lr=s.lr, warmup=s.warmup, min_lr_ratio=s.min_lr_ratio,
              grad_clip=s.grad_clip, desc="sft", grad_accum=s.grad_accum,
              zero_loss_hint=f"chat template {chat_format(tok).template}",
              eval_fn=lambda: sum(engine.lm_loss(b).item() for b in val_batches) / max(1, len(val_batches)),
              eval_every=max(1, s.steps // 5), state=state, checkpoint=checkpoint, checkpoint_every=s.checkpoint_every)
    finally:
        engine.close()


def with_mtp(cfg: PipelineConfig, model, tok):
    """The model with the MTP layer `mtp.depth` asks for (the ramp installs it; a ramp output without one
    gets a new one here)."""
    if cfg.mtp.depth and mtp.get(model) is None:
        mtp.install(model, cfg.mtp.depth)
    return model, tok


def replay_examples(cfg: PipelineConfig, base: str) -> tuple[list, int]:
    """`sft.replay_share`'s examples (posttrain/replay.py): the answers of the `base` checkpoint (the user's chat
    model, before the ramp's plain-text training moved it), and how many were left unfinished; none when off.
    Stops when the model finishes none of them: the replay would be a silent no-op."""
    s = cfg.sft
    if not s.replay_share:
        return [], 0
    model, tok = load_checkpoint(base)
    prompts = replay.load_prompts(s.replay_file)[:s.replay_prompts]
    t0 = time.time()
    replayed, unfinished = replay.examples(as_rollout_engine(model, tok), prompts,
                                           max_new_tokens=s.replay_max_new_tokens)
    del model
    if not replayed:
        raise ChatFormatError(f"sft.replay_share: the model finished none of its {len(prompts)} replay answers "
                              f"within sft.replay_max_new_tokens={s.replay_max_new_tokens} (chat template "
                              f"{chat_format(tok).template}): raise it, or set sft.replay_share: 0")
    print(f"[sft] replay: {len(replayed)} of {len(prompts)} answers of the base model in {time.time() - t0:.0f} s "
          f"({unfinished} unfinished, left out), {s.replay_share:.0%} of the mixture", flush=True)
    return replayed, unfinished


def run(cfg: PipelineConfig, inputs: dict[str, str], out: Path, scratch: str = "") -> dict:
    """Build the SFT mixture, train it (one rank in this process, several as Ray Train workers; resuming from
    `scratch` after a crash), save."""
    seed_all(cfg.seed)
    s = cfg.sft
    model, tok = load_checkpoint(inputs["ramp"])
    new_draft = cfg.mtp.depth and mtp.get(model) is None
    model, tok = with_mtp(cfg, model, tok)
    domains = environments.names(cfg.world.environments)
    train_tasks = [t for d in domains for t in load_tasks(inputs["curate"], "sft", d)]
    long_tasks = _long_tasks(tok, "train", len(train_tasks) // 6, cfg.seed, s.seq_len)
    train_tasks += long_tasks
    val_tasks = [t for d in domains for t in load_tasks(inputs["curate"], "val", d)]
    # checked before the first stage too (posttrain.stages.base.check_checkpoint)
    if errors := checkpoint_rules.chat_tools(cfg, tok, f"the chat template of {inputs['ramp']} "
                                                       f"({chat_format(tok).template})"):
        raise ChatFormatError(f"sft: {errors[0]}")
    examples = build_examples(cfg, tok, train_tasks, cfg.seed)
    check_masks(examples, tok)
    replayed, unfinished = replay_examples(cfg, inputs.get("base", ""))
    examples = replay.mix(examples, replayed, s.replay_share)
    val = build_examples(cfg, tok, val_tasks, cfg.seed + 1)
    config = {"cfg": cfg, "init": inputs["ramp"], "examples": examples, "val": val,
              "threads": max(1, cfg.runtime.torch_threads // s.workers)}
    with tempfile.TemporaryDirectory(prefix="posttrain-sft-init-") as init:
        if new_draft:  # the new draft layer in the checkpoint the ranks start from (an engine may load it from there)
            save_checkpoint(model, tok, init)
            config["init"] = init
        if cfg.sft_in_process():
            state = _in_process(config, Path(scratch or tempfile.mkdtemp(prefix="sft-")))
        else:
            state = _over_workers(cfg, config, scratch)
    model.load_state_dict(state["model"])
    save_checkpoint(model, tok, out)
    hist = state["hist"]
    (out / "history.json").write_text(json.dumps(hist))
    moe.plot_load(hist, out / moe.PLOT, "sft")
    n_tok = sum(sum(m) for _, m in examples)
    return {"metrics": {"examples": len(examples), "long_context_examples": len(long_tasks),
                        "replay_prompts": len(replayed), "replay_unfinished": unfinished,
                        "assistant_tokens": n_tok, **summarize(hist), **summarize(hist, "mtp_loss"),
                        **summarize(hist, "mtp_acc1"), **summarize(hist, "indexer_kl"),
                        **summarize(hist, "topk_recall"), **moe_metrics(hist),
                        **summarize(hist, "val_loss", 1)}, "history": hist}


def _in_process(config: dict, scratch: Path) -> dict:
    """One torch rank in this process: the stage's Ray worker already holds the imports, where a Ray Train worker
    group would start two more processes (~20 s of a smoke run's sft). Checkpoints go to `scratch` (and to the
    store when it is remote) as Ray Train's would; the last one is the trained state."""
    def latest() -> Path | None:
        return max(scratch.glob("sft-step*"), default=None)

    def report(metrics: dict, d: str) -> None:  # a whole folder appears in one rename: a kill never leaves half
        tmp, final = scratch / ".sft-step.tmp", scratch / f"sft-step{metrics['step']:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(d, tmp)
        tmp.rename(final)
        for old in scratch.glob("sft-step*"):
            if old != final:
                shutil.rmtree(old)
        checkpointed(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    _train_rank(config, 0, _load_state(latest(), False) if latest() else None, report,
                lambda m: m.to(device()))
    return _load_state(latest(), False)


def _over_workers(cfg: PipelineConfig, config: dict, scratch: str) -> dict:
    """Ray Train's workers as the engine's ranks (data-parallel, or split as it lays itself out); resumes from its last
    reported checkpoint."""
    # ray: only where the work spreads over Ray workers
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    s = cfg.sft
    storage, filesystem = train_storage(scratch or tempfile.mkdtemp(prefix="sft-"))
    trainer = TorchTrainer(
        _worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=s.workers,
                                     use_gpu=stage_gpus(cfg.runtime.device, cfg.runtime.gpus_per_stage) > 0),
        run_config=RunConfig(name="sft", storage_path=storage, storage_filesystem=filesystem,
                             failure_config=FailureConfig(max_failures=0),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    # Ray Train's fit() installs a SIGINT handler holding the controller actor's handle, which keeps the
    # controller alive after training; restoring the handler lets it go with the trainer
    sigint = signal.getsignal(signal.SIGINT)
    try:
        result = trainer.fit()
    finally:
        if threading.current_thread() is threading.main_thread():  # where fit() could install it
            signal.signal(signal.SIGINT, sigint)
        del trainer
        gc.collect()
    with result.checkpoint.as_directory() as d:
        return torch.load(Path(d) / STATE, weights_only=False)
