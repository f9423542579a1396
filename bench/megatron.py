"""bench/megatron: the megatron-core train engine against the torch engine (transformers' model), same process.

- `tokens_per_s_torch_engine` / `tokens_per_s_megatron`: SFT steps of posttrain.train's loop (AdamW, clipping,
  the masked LM loss) on the same batches, the two engines alternating `REPEATS` times; `speed_ratio` is megatron's
  over torch's.
- `logits_max_abs_diff_vs_hf`, `hf_roundtrip_exact`: the Megatron model's logits against transformers' on the same
  weights (fp32), and the exported Hugging Face tensors against the checkpoint's, bit for bit.
- `tp2_loss_max_abs_diff`, `dp2_loss_max_abs_diff`, `cp2_loss_max_abs_diff`: the same steps on two gloo (NCCL on
  CUDA) ranks, tensor, data and context parallel (posttrain.engines.megatron.context_parallel), against one rank's losses.
- `glm5_*`: the same for GLM-5's architecture (the glm5 preset at GLM5_SHAPE: latent attention, eight routed experts
  and a shared one, the first layer dense) in Megatron's own MLA and MoE layers (posttrain.engines.megatron.glm5),
  and `ep2_loss_max_abs_diff`: its experts over two expert-parallel ranks against one rank, beside
  `glm5_dp2_loss_max_abs_diff` (the same two data-parallel ranks with every expert on each).
- `glm5_dsa_*`: the same GLM-5 with DSA adopted (`index_topk` a quarter of the rows' length, so every layer attends
  to its indexer's selection: transformers' sparse attention against the engine's `engines.megatron.dsa`), and
  `glm5_dsa_cp2_loss_max_abs_diff`: over two context-parallel ranks, each rank's queries selecting among the whole
  sequence's keys.
- `glm5_mtp_*`: the same GLM-5 with a draft (MTP) layer of DRAFT steps trained beside the LM loss at weight 0.3
  (transformers' layer on each engine's embedding and head: `posttrain.models.mtp`, `engines.megatron.mtp`), and
  `glm5_mtp_cp2_loss_max_abs_diff` over two context-parallel ranks (each running the draft layer over the whole
  sequence).
- `*_distributed_optimizer_*`: dp 2 (GLM-5: ep 2) with `megatron.distributed_optimizer`: the loss against one rank,
  rank 0's AdamW state in bytes over the same split without it (`..._state_ratio`), and its steps' time over theirs
  (`..._time_ratio`: the parameters' broadcast after each step). Timed splits run REPEATS times, alternating; best
  time.
- `pp2_1f1b_speed_ratio`: two pipeline stages, each batch in MICRO micro-batches in the 1F1B order
  (`megatron.micro_batches`), against the same two stages taking the whole batch in turn (`pp2_loss_max_abs_diff`,
  `pp2_1f1b_loss_max_abs_diff` against one rank); at most 2 x MICRO / (MICRO + 1) with two stages.

    python -m bench.megatron [--shape tiny|0.5b]     (make bench B=megatron)

`--shape 0.5b` (the default on CUDA): Qwen2-0.5B's shapes with random weights (24 layers, hidden 896, 14 heads,
2 key-value heads, vocabulary 151,936). BENCH_SMALL=1: the tiny shape, 2 steps of 2 x 32 tokens, one repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import mark, out_dir, size, threads

OUT = out_dir()
REPEATS = size(3, 1)
STEPS = size(10, 2)
BATCH, SEQ = size(8, 2), size(256, 32)
MICRO = size(4, 2)
DRAFT = 2  # the draft layer's steps
TIMED = {"dp2", "dp2_distributed_optimizer", "pp2", "pp2_1f1b", "ep2", "glm5_ep2_distributed_optimizer"}
SHAPES = {"tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=768, vocab_size=4096),
          "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936)}


def checkpoint(shape: str, where: Path) -> Path:
    """A Llama of `shape` with random weights, saved with a byte-level tokenizer of its vocabulary size."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    from posttrain.chat import CHAT_TEMPLATE
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  pad_token="t0", eos_token="t1", bos_token="t2", chat_template=CHAT_TEMPLATE)
    LlamaForCausalLM(cfg).save_pretrained(where)
    tok.save_pretrained(where)
    return where


GLM5_SHAPE = dict(arch="glm5", hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384,
                  moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=64, kv_lora_rank=32,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_heads=4, index_head_dim=32,
                  indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=4096)


def glm5_checkpoint(where: Path, vocab: int = 4096) -> Path:
    """The glm5 preset at GLM5_SHAPE with random weights and a byte-level tokenizer of `vocab` entries."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    from posttrain.chat import CHAT_TEMPLATE
    from posttrain.config import ModelConfig
    from posttrain.models.preset import build_model, save_checkpoint
    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)},
                                                                               unk_token="t0")),
                                  pad_token="t0", eos_token="t1", bos_token="t2", chat_template=CHAT_TEMPLATE)
    save_checkpoint(build_model(ModelConfig(**GLM5_SHAPE), tok), tok, where)
    return where


def with_draft(glm5: Path, where: Path) -> Path:
    """`glm5` with a new draft (MTP) layer of DRAFT steps (GLM-5's: stored as layer num_hidden_layers)."""
    from posttrain.models import mtp
    from posttrain.models.preset import load_checkpoint, save_checkpoint
    model, tok = load_checkpoint(glm5)
    torch.manual_seed(0)
    save_checkpoint(mtp.install(model, DRAFT), tok, where)
    return where


def adopted(glm5: Path, where: Path, top_k: int) -> Path:
    """`glm5`'s weights with DSA adopted at `top_k` keys (its indexers as they are: random, they still select)."""
    import shutil
    shutil.copytree(glm5, where)
    config = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, "index_topk": top_k}))
    return where


def batches(vocab: int, n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(SEQ)] for _ in range(BATCH)])
        out.append({"input_ids": ids, "loss_mask": torch.ones_like(ids)})
    return out


def steps(engine_or_model, data: list[dict]) -> tuple[list[float], float]:
    """(losses, seconds) of posttrain.train's loop over `data` (a model's draft layer, if any, trained beside the LM
    loss at weight 0.3, as the megatron engine's `mtp_weight`)."""
    from posttrain.engines.torch_train import TorchTrainEngine
    from posttrain.train import train
    t = time.perf_counter()
    engine = TorchTrainEngine.for_lm(engine_or_model, lr=1e-3, mtp_weight=0.3) \
        if isinstance(engine_or_model, torch.nn.Module) else engine_or_model
    hist = train(engine, lambda i: data[i], steps=len(data), lr=1e-3, warmup=1, desc="bench")
    return hist["loss"], time.perf_counter() - t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, par: dict, path: str, data: list[dict], out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from posttrain.engines.megatron.layout import Parallel
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    par = dict(par)
    engine = MegatronTrainEngine(path, lr=1e-3, distributed_optimizer=par.pop("distributed_optimizer", False),
                                 micro_batches=par.pop("micro_batches", 1), mtp_weight=0.3, parallel=Parallel(**par))
    dp, shard = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [{k: v[shard::dp] for k, v in b.items()} for b in data]  # equal shares: the mean of means is the mean
    losses, seconds = steps(engine, mine)
    total = torch.tensor(losses, device=engine.device)
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    state = sum(t.numel() * t.element_size() for st in engine.opt.state.values() for t in st.values() if t.dim())
    if rank == 0:
        torch.save({"losses": (total / dp).tolist(), "seconds": seconds, "optimizer_bytes": state}, out)
    dist.barrier()
    dist.destroy_process_group()


def ranks(path: Path, data: list[dict], par: dict, world: int) -> dict | None:
    """Rank 0's losses (the whole batch's), seconds and AdamW state bytes over `world` ranks split as `par`
    (Parallel's fields, `distributed_optimizer`); None where this machine has fewer GPUs than ranks."""
    import torch.multiprocessing as mp
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        return None
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "losses.pt")
        mp.spawn(_rank, args=(world, _free_port(), par, str(path), data, out), nprocs=world)
        return torch.load(out)


def exactness(path: Path) -> dict:
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    from posttrain.models.preset import load_checkpoint
    hf, _ = load_checkpoint(path)
    engine = MegatronTrainEngine(path, "reference")
    hf = hf.to(engine.device)
    ids = torch.randint(3, hf.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids.to(engine.device)).logits
        h = engine.fwd.hidden(ids.to(engine.device))
        got = engine.fwd.logits(h.reshape(-1, h.shape[-1]))[0].view_as(want)
    exported, own = engine.weights(), hf.state_dict()
    return {"logits_max_abs_diff_vs_hf": (got - want).abs().max().item(),
            "hf_roundtrip_exact": set(exported) == set(own) and all(torch.equal(exported[k].cpu(), own[k].cpu())
                                                                    for k in own)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b" if torch.cuda.is_available() else "tiny")
    shape = size(p.parse_args(argv if argv is not None else []).shape, "tiny")  # `python -m bench` calls main() bare
    torch.set_num_threads(threads(2))
    from posttrain.engines.megatron.engine import MegatronTrainEngine
    from posttrain.models.preset import load_checkpoint
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    with tempfile.TemporaryDirectory() as d:
        path = checkpoint(shape, Path(d) / shape)
        data = batches(SHAPES[shape]["vocab_size"], STEPS)
        fig = {"device": device, "shape": shape, "steps": STEPS, "batch": BATCH, "seq_len": SEQ, "repeats": REPEATS,
               "dtype": "float32" if not torch.cuda.is_available() else "bf16 autocast (torch) / fp32 (megatron)",
               "glm5_shape": GLM5_SHAPE, "glm5_dsa_index_topk": SEQ // 4, "glm5_mtp_steps": DRAFT,
               "glm5_mtp_loss_weight": 0.3}
        glm5 = glm5_checkpoint(Path(d) / "glm5")
        zero = {"distributed_optimizer": True}
        for prefix, at, splits in (("", path, (("tp2", {"tp": 2}), ("dp2", {}), ("cp2", {"cp": 2}),
                                               ("dp2_distributed_optimizer", zero), ("pp2", {"pp": 2}),
                                               ("pp2_1f1b", {"pp": 2, "micro_batches": MICRO}))),
                                   ("glm5_", glm5, (("glm5_dp2", {}), ("ep2", {"ep": 2}),
                                                    ("glm5_ep2_distributed_optimizer", {"ep": 2, **zero}))),
                                   ("glm5_dsa_", adopted(glm5, Path(d) / "glm5_dsa", SEQ // 4),
                                    (("glm5_dsa_cp2", {"cp": 2}),)),
                                   ("glm5_mtp_", with_draft(glm5, Path(d) / "glm5_mtp"),
                                    (("glm5_mtp_cp2", {"cp": 2}),))):
            times = {"torch": [], "megatron": []}
            curves = {}
            for _ in range(REPEATS):  # alternating, so drift in the machine's speed hits both
                model, _ = load_checkpoint(at)
                curves["torch"], s = steps(model, data)
                times["torch"].append(s)
                del model
                curves["megatron"], s = steps(MegatronTrainEngine(at, lr=1e-3, mtp_weight=0.3), data)
                times["megatron"].append(s)
            tokens = STEPS * BATCH * SEQ
            torch_tps, mega_tps = (round(tokens / min(times[k]), 1) for k in ("torch", "megatron"))
            fig |= {f"{prefix}tokens_per_s_torch_engine": torch_tps, f"{prefix}tokens_per_s_megatron": mega_tps,
                    f"{prefix}speed_ratio": round(mega_tps / torch_tps, 3),
                    f"{prefix}loss_max_abs_diff_vs_torch_engine": max(abs(a - b) for a, b in zip(curves["torch"],
                                                                                                 curves["megatron"]))}
            fig |= {prefix + k: v for k, v in exactness(at).items()}
            runs = {}
            for rep in range(REPEATS):  # the splits alternating; the timed ones again each repeat, best time kept
                for name, par in splits:
                    if rep and name not in TIMED:
                        continue
                    got = ranks(at, data, par, 2)
                    if got and name in runs:
                        got["seconds"] = min(got["seconds"], runs[name]["seconds"])
                    runs[name] = got
                    fig[f"{name}_loss_max_abs_diff"] = None if got is None else max(
                        abs(a - b) for a, b in zip(got["losses"], curves["megatron"]))
            zero_run, plain = (("glm5_ep2_distributed_optimizer", "ep2") if prefix == "glm5_" else
                               ("dp2_distributed_optimizer", "dp2"))  # the same split with and without it
            if runs.get(zero_run) and runs.get(plain):
                fig[f"{zero_run}_state_ratio"] = round(runs[zero_run]["optimizer_bytes"] /
                                                       runs[plain]["optimizer_bytes"], 3)
                fig[f"{zero_run}_time_ratio"] = round(runs[zero_run]["seconds"] / runs[plain]["seconds"], 3)
            if not prefix and runs["pp2"] and runs["pp2_1f1b"]:
                fig |= {"micro_batches": MICRO,
                        "pp2_1f1b_speed_ratio": round(runs["pp2"]["seconds"] / runs["pp2_1f1b"]["seconds"], 3)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "megatron.json").write_text(json.dumps(mark(fig), indent=1) + "\n")
    print(json.dumps(mark(fig), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
