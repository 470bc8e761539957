"""The paged attention as one opaque op, ``torch.ops.inflightq.paged_attention``, so that a
compiled forward (torch.compile) keeps the whole decoder in one graph instead of breaking at
each layer's attention.

The op takes only tensors and the layer number; the step's metadata (block tables, slot
mapping, the KV caches) reaches it through ``step_metadata``, set by the model runner around
the forward. That keeps Python objects out of the traced graph, so guards never look at them
and a new step never recompiles. The op writes the layer's K/V into the cache, which is not
one of its arguments: nothing in the graph reads the cache, so the compiler cannot reorder a
read before that write.

Rows past the step's real token count are padding (the compiled forward runs on token-count
buckets): they get zeros and their K/V is never written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from worker.engine.model.attention.metadata import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def step_metadata(meta: AttentionMetadata) -> Iterator[None]:
    global _current
    _current = meta
    try:
        yield
    finally:
        _current = None


@torch.library.custom_op("inflightq::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [T, Hq, D]."""
    meta = _current
    if meta is None:
        raise RuntimeError("inflightq::paged_attention runs only inside the model runner's step_metadata")
    meta.stop_if_interrupted(layer)
    padded, real = query.shape[2], meta.slot_mapping.numel()
    if real == padded:
        return meta.backend.forward(meta, layer, query, key, value, scale)
    out = query.new_zeros(padded, query.shape[1], query.shape[3])
    q, k, v = (t[:, :, :real] for t in (query, key, value))
    out[:real] = meta.backend.forward(meta, layer, q, k, v, scale)
    return out


@paged_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])
