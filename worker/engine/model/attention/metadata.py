"""Per-step attention metadata shared by all layers, and the interface every backend implements.

Token layout of a step's flattened batch: the single-token entries (decodes) first, then the
multi-token entries (prefill chunks), each sequence's tokens contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from worker.engine.core.step_interrupt import StepInterrupt


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened batch
    end: int
    context_len: int  # tokens in the sequence after this chunk (cached + new)
    blocks: torch.Tensor | None  # the sequence's blocks holding its context; None when the chunk is all of it
    mask: torch.Tensor | None  # [n, context_len] bool causal mask offset by the cached part


@dataclass
class AttentionMetadata:
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, K and V, in the backend's cache_shape
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes (block * block_size + offset)
    block_size: int
    num_decodes: int  # the first num_decodes rows are single-token entries
    decode_blocks: torch.Tensor | None = None  # [B * max_blocks] each decode's block table, padded, flattened
    decode_context_lens: torch.Tensor | None = None  # [B] int64 tokens of context of each decode, its new one included
    decode_bias: torch.Tensor | None = None  # [1, B, 1, max_blocks * block_size] 0 on context, -inf on padding
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Flash-attn style views of the same batch (built only when a backend asks for them).
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor | None = None  # [num_seqs + 1] int32
    max_query_len: int = 0
    max_context_len: int = 0
    interrupt: StepInterrupt | None = None  # the engine's; None: the step always runs to its end
    lora: Any = None  # the step's ``lora.LoraStep`` when some row runs an adapter: fused paths then step aside

    def stop_if_interrupted(self, layer: int) -> None:
        """Every layer, before its attention: raises ``StepInterrupted`` when an urgent arrival asked
        and the step is in its first half of layers."""
        if self.interrupt is not None:
            self.interrupt.stop_if_requested(layer, len(self.kv_caches))


def heads_first(*token_major: torch.Tensor) -> list[torch.Tensor]:
    """[T, heads, D] tensors as transformers' [1, heads, T, D] views: ``forward_tokens`` of a backend
    whose own layout is transformers' passes them on to its ``forward``."""
    return [t.transpose(0, 1).unsqueeze(0) for t in token_major]


class AttentionBackend(Protocol):
    needs_flat_views: bool  # wants block_tables / cu_seqlens rather than gathered slots
    needs_decode_bias: bool  # wants decode_bias (the padding mask of the gathered decode contexts)

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]: ...

    def forward(
        self,
        meta: AttentionMetadata,
        layer: int,
        query: torch.Tensor,  # [1, Hq, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D]
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...

    def forward_tokens(
        self,
        meta: AttentionMetadata,
        layer: int,
        query: torch.Tensor,  # [T, Hq, D], token-major as a fused layer produces it
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...
