"""The SGLang rollout engine: generation, teacher scores and weight updates through a real SGLang server
(`engines.sglang_server`), over SGLang's native HTTP API. Token in, token out: prompts go as `input_ids`, the
completion comes back as `output_ids` with each token's log-probability; nothing is re-tokenised. Stops are the
caller's stop ids only (the model's own EOS is ignored unless it is one of them), kept as generated."""
from __future__ import annotations

import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.engines.base import Generation, WeightSource
from posttrain.engines.sglang_server import SGLangServer
from posttrain.engines.weight_group import send, weight_group
from posttrain.models.preset import load_pretrained, save_checkpoint
from posttrain.quant.int_linear import is_compressed

FULL_MAX = 65536  # ids a teacher returns per position when the whole distribution is needed


def token_versions(meta: dict, n: int) -> list[int]:
    """Each of a request's n output tokens' weight version, from SGLang's spans ({version, start, end}); the
    version the server started with is "default", our 0."""
    def num(v: str) -> int:
        return int(v) if v.isdigit() else 0
    spans = meta.get("weight_versions") or [{"version": meta.get("weight_version", "default"), "start": 0, "end": n}]
    out = [num(s["version"]) for s in spans for _ in range(s["start"], s["end"])]
    if len(out) != n:
        raise RuntimeError(f"SGLang weight-version spans {spans} do not cover the {n} output tokens")
    return out


class SGLangRolloutEngine:
    """A checkpoint served by its own SGLang server (a child process of this one). What it can do beyond the
    RolloutEngine protocol (weights mid-generation, the trainer's broadcast) is declared in
    posttrain.engines.registry."""

    def __init__(self, checkpoint: str | Path, *, seed: int = 0, dtype: str = "float32", keep_in_flight: bool = False):
        """`keep_in_flight`: updates reach the generations in flight (GLM-5's partial rollouts): the server retracts
        them (their generated tokens kept), takes the new weights and prefills them again, so every token after an
        update is exactly the new weights' given what came before; each Generation says which version produced each
        token (SGLang's per-request weight-version spans). The server then keeps no prefix cache: a cached prefix
        would be the old weights' encoding."""
        self.checkpoint = str(checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.partial = keep_in_flight
        self.server = SGLangServer(checkpoint, seed=seed, extra_args=(
            "--dtype", dtype, *(("--disable-radix-cache",) if keep_in_flight else ())))
        self.version = 0
        self.stats: dict[str, float] = {}  # the server's speculative decoding is its own: no counters here
        self._weights: str | dict = self.checkpoint  # what a restarted server reloads: a folder or a state dict
        self._weights_version = 0
        self._group = self._group_server = None  # the process group broadcasting weights to the server
        self._outside = None  # the server process that joined the trainer's group (join_group)
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._open = threading.Event()
        self._open.set()

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: str = "float32", keep_in_flight: bool = False
                        ) -> "SGLangRolloutEngine":
        if is_compressed(path):
            raise ValueError(f"runtime.rollout_engine sglang: {path} is a W4A8 compressed-tensors export; SGLang's int4 / "
                             f"int8 kernels are CUDA's, and posttrain's mixed export has not been tried there")
        return cls(path, dtype=dtype, keep_in_flight=keep_in_flight)

    def _call(self, route: str, payload: dict | None = None):
        return self.server.call(route, payload, on_restart=self._reload)

    def _reload(self) -> None:
        """A restarted server's weights: the last folder it was given, or the last state it broadcast (as a folder).
        Weights the trainer broadcast straight to the server died with it: the version falls back to what it
        reloads, so its tokens are tagged with the weights that really made them until the trainer's next push."""
        if isinstance(self._weights, dict):
            self._weights = self._write(self._weights)
        if self._weights != self.checkpoint:
            self.server.post("update_weights_from_disk", {"model_path": self._weights,
                                                          "weight_version": str(self._weights_version)})
        self.version = self._weights_version

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, stop_ids: set[int],
                 generator: torch.Generator | None = None) -> list[Generation]:
        self._open.wait()
        if not prompts:
            return []
        # a seed per request, drawn from the caller's generator: SGLang reads them under
        # --enable-deterministic-inference (CUDA attention backends only); else draws follow the server's own RNG
        seeds = torch.randint(2 ** 31, (len(prompts),), generator=generator).tolist()
        params = [{"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": sorted(stop_ids),
                   "no_stop_trim": True, "sampling_seed": s} for s in seeds]
        out = self._call("generate", {"input_ids": [list(p) for p in prompts], "sampling_params": params,
                                      "return_logprob": True})
        gens = []
        for r in out:
            meta = r["meta_info"]
            ids = list(r["output_ids"])
            lps = [float(lp) for lp, _, *_ in meta["output_token_logprobs"]]
            stopped = meta["finish_reason"]["type"] == "stop"
            gens.append(Generation(ids, lps, "stop" if stopped else "length",
                                   versions=token_versions(meta, len(ids)) if self.partial else None))
        return gens

    def score(self, items: list[tuple[list[int], list[int], list[int]]], *, mode: str = "sampled", top_k: int = 16,
              temperature: float = 1.0) -> list:
        """The server's prompt log-probabilities at the completion's generated tokens: `sampled` (the tokens' own),
        `topk` or `full`. SGLang scores prompts at temperature 1 only; at another temperature the whole
        distribution comes back and is renormalised here (exact: log softmax(log p / T) = log softmax(z / T)), which
        needs a vocabulary of at most FULL_MAX ids."""
        vocab = len(self.tokenizer)
        whole = mode == "full" or temperature != 1.0
        if whole and vocab > FULL_MAX:
            raise ValueError(f"runtime.rollout_engine sglang: teacher scores {mode!r} at temperature {temperature} need "
                             f"the whole distribution of {vocab} ids from the server (at most {FULL_MAX}); use "
                             f"opd.loss sampled or topk at temperature 1, or the torch engine")
        k = vocab if whole else top_k if mode == "topk" else 0
        out = self._call("generate", {
            "input_ids": [list(p) + list(ids) for p, ids, _ in items],
            "sampling_params": [{"max_new_tokens": 0}] * len(items), "return_logprob": True,
            "logprob_start_len": [len(p) - 1 for p, _, _ in items], "top_logprobs_num": [k] * len(items)})
        res = []
        for (_, ids, mask), r in zip(items, out):
            meta = r["meta_info"]
            # entry j scores the prompt's last position plus j, i.e. completion token j - 1: entry 0 scores nothing
            pos = [j + 1 for j, m in enumerate(mask) if m]
            if not whole:
                if mode == "sampled":
                    res.append([float(meta["input_token_logprobs"][j][0]) for j in pos])
                else:
                    tops = meta["input_top_logprobs"]
                    res.append((np.array([[t[1] for t in tops[j]] for j in pos], dtype=np.int32),
                                np.array([[t[0] for t in tops[j]] for j in pos], dtype=np.float32)))
                continue
            full = torch.full((len(pos), vocab), float("-inf"))
            for row, j in enumerate(pos):
                lp = torch.tensor([t[0] for t in meta["input_top_logprobs"][j]])
                full[row, torch.tensor([t[1] for t in meta["input_top_logprobs"][j]])] = lp
            full = torch.log_softmax(full / temperature, -1)
            if mode == "full":
                res.append(full.numpy())
            elif mode == "sampled":
                res.append(full.gather(1, torch.tensor([ids[j - 1] for j in pos])[:, None])[:, 0].tolist())
            else:
                v, i = full.topk(min(top_k, vocab), -1)
                res.append((i.to(torch.int32).numpy(), v.numpy()))
        return res

    def update_weights(self, source: WeightSource, version: int) -> None:
        """From a checkpoint folder (`update_weights_from_disk`, what a trainer on another node can always do), or
        from a state dict in this process, broadcast to the server over a process group of the two
        (`update_weights_from_distributed`: gloo on CPU, NCCL on CUDA; no file written). New generations wait
        meanwhile; the server lets the running ones finish on the old weights first, or with `keep_in_flight`,
        retracts them and continues them on the new weights."""
        # flush_cache: a server keeping generations in flight has no prefix cache, and refuses a flush while the
        # retracted requests wait in its queue
        with self._updating():
            if isinstance(source, (str, Path)):
                out = self._call("update_weights_from_disk", {"model_path": str(source), "flush_cache": not self.partial,
                                                              "weight_version": str(version)})
                if not out.get("success", False):
                    raise RuntimeError(f"SGLang update_weights_from_disk {source}: {out.get('message')}")
                self._weights = str(source)
            else:
                if self._group is None or self._group_server != self.server.proc:  # a restarted server joins afresh
                    self._group = weight_group([lambda payload: self._call("init_weights_update_group", payload)])
                    self._group_server = self.server.proc
                send(self._group, source, [lambda payload: self._receive(payload, version)])
                self._weights = source
            self.version = self._weights_version = version

    @contextmanager
    def _updating(self):
        self._open.clear()
        if self.partial:  # the running requests give their KV cache back, to be prefilled again by the new weights
            self._call("pause_generation", {"mode": "retract"})
        try:
            yield
        finally:
            if self.partial:
                self._call("continue_generation", {})
            self._open.set()

    def _receive(self, payload: dict, version: int) -> dict:
        """Take the tensors the group's rank 0 broadcasts now (payload: names, dtypes, shapes, group_name)."""
        self.server.post("begin_weight_update", {})
        try:
            return self.server.post("update_weights_from_distributed", {
                **payload, "flush_cache": not self.partial, "weight_version": str(version)})
        finally:
            self.server.post("end_weight_update", {})

    # runtime.weight_sync broadcast: the trainer's rank 0 broadcasts to every worker's server in one group, so this
    # engine never holds those weights; a restarted server comes back with the last ones it did hold (`_reload`)
    def join_group(self, payload: dict) -> dict:
        """Join the trainer's group (`weight_group` on the trainer's side)."""
        out = self._call("init_weights_update_group", payload)
        self._outside = self.server.proc
        return out

    def in_group(self) -> bool:
        """Whether the server that joined the trainer's group is still the one running."""
        return self._outside is not None and self._outside is self.server.proc and self.server.alive()

    def receive_weights(self, payload: dict, version: int) -> dict:
        """The trainer's broadcast of `version`, as `update_weights` takes one (pausing or holding generations)."""
        with self._updating():
            out = self._receive(payload, version)
            if not out.get("success", False):
                raise RuntimeError(f"SGLang update_weights_from_distributed: {out.get('message')}")
            self.version = version
        return out

    def _write(self, state: dict) -> str:
        """A state dict as a checkpoint folder beside the served one's config and tokenizer (replacing the last)."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="posttrain-sglang-weights-")
            self._model = load_pretrained(AutoModelForCausalLM, self.checkpoint)
        self._model.load_state_dict(state)
        out = Path(self._tmp.name) / "current"
        save_checkpoint(self._model, self.tokenizer, out)
        return str(out)

    def pause(self) -> None:
        """Hold new generations here, and the server's running ones where they are (`in_place`: their KV cache
        kept, so they continue after `resume`)."""
        self._open.clear()
        self._call("pause_generation", {"mode": "in_place"})

    def resume(self) -> None:
        self._call("continue_generation", {})
        self._open.set()

    def close(self) -> None:
        self.server.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the server's process group may already be gone
            pass
