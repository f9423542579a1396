"""A KV cache for decoding that writes each step's keys in place.

transformers' DynamicLayer appends with torch.cat, copying the whole cache at every decoded token (a fifth of a
tiny model's decode time on CPU at 128 rows); its StaticCache avoids the copy but attends over its full length
from the first step and cannot drop finished rows. Here keys and values are views into buffers with room to
spare (sized for prompt + new tokens when the caller knows it, doubled when outgrown), so a step writes its slot
and the views simply get longer. Decoding only: writing into a buffer in place is not something autograd can
differentiate through, so training forwards keep transformers' own cache."""
from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve
        self._k = self._v = None
        self._n = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self._n = 0

    def _view(self) -> None:
        self.keys, self.values = self._k[..., :self._n, :], self._v[..., :self._n, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._n, self._n + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            cap = max(end, self.reserve, 2 * (self._k.shape[-2] if self._k is not None else 0))
            k = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
            v = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
            if start:
                k[..., :start, :], v[..., :start, :] = self.keys, self.values
            self._k, self._v = k, v
        self._k[..., start:end, :] = key_states
        self._v[..., start:end, :] = value_states
        self._n = end
        self._view()
        return self.keys, self.values

    def _rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self._k is not None and self._n:
            self._k, self._v = fn(self._k), fn(self._v)
            self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t: t[indices.to(t.device)])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of tokens to remove as a negative integer, got {tokens_to_remove}")
        if tokens_to_remove and self._k is not None:
            self._n = max(0, self._n + tokens_to_remove)
            self._view()

    def reset(self) -> None:
        super().reset()
        self._k = self._v = None
        self._n = 0


class GrowingIndexedLayer(GrowingLayer):
    """A GrowingLayer that also keeps a DSA indexer's keys ([B, T, index_head_dim], what transformers'
    DynamicIndexedLayer adds for GLM-5 / DeepSeek-V3.2), selected and cropped with the rows it belongs to."""

    def __init__(self, reserve: int = 0):
        super().__init__(reserve)
        self.indexer_keys = None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        # one head of index_head_dim: small beside the KV, so appended as transformers does
        self.indexer_keys = (indexer_key_states if self.indexer_keys is None
                             else torch.cat([self.indexer_keys, indexer_key_states], dim=1))
        return self.indexer_keys

    def _rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super()._rows(fn)
        if self.indexer_keys is not None:
            self.indexer_keys = fn(self.indexer_keys)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove and self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :tokens_to_remove]

    def reset(self) -> None:
        super().reset()
        self.indexer_keys = None


def needs_indexed_cache(model) -> bool:
    """A model whose attention keeps DSA indexer keys in its cache (transformers' layer type
    "indexed_attention": GLM-5, DeepSeek-V3.2)."""
    return "indexed_attention" in (getattr(getattr(model, "config", None), "layer_types", None) or ())


def decode_cache(reserve: int = 0, model=None) -> DynamicCache:
    """A DynamicCache whose layers are GrowingLayers with room for `reserve` tokens (GrowingIndexedLayers for a
    `model` with DSA indexers)."""
    cache = DynamicCache()
    layer = GrowingIndexedLayer if model is not None and needs_indexed_cache(model) else GrowingLayer
    cache.layer_class_to_replicate = lambda: layer(reserve)
    return cache


def training_cache(model) -> DynamicCache:
    """transformers' own cache (autograd can go through it) with the layer kind the model needs."""
    return DynamicCache(config=model.config) if needs_indexed_cache(model) else DynamicCache()
