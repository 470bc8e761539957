"""Paged attention with flash-attn on CUDA (imported lazily; not exercised on CPU-only machines).

Prefill chunks go through flash_attn_varlen_func reading K/V straight from the paged cache
via block_table; a step of pure decodes uses flash_attn_with_kvcache, whose fixed-shape
inputs are what a CUDA-graph capture of the decode step would replay. flash-attn 2 requires
the cache's block size to be a multiple of 256 for paged K/V.
"""

from __future__ import annotations

import torch

from worker.engine.model.attention.metadata import AttentionMetadata, heads_first


class FlashAttentionBackend:
    needs_flat_views = True
    needs_decode_bias = False

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._kvcache = flash_attn_with_kvcache

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)  # what flash-attn's paged kernels read

    def forward_tokens(
        self,
        meta: AttentionMetadata,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return self.forward(meta, layer, *heads_first(query, key, value), scale)

    def forward(
        self,
        meta: AttentionMetadata,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        assert meta.block_tables is not None and meta.context_lens is not None and meta.cu_seqlens_q is not None
        k_cache, v_cache = meta.kv_caches[layer]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_new = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
        v_new = value[0].transpose(0, 1).contiguous()
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k_new)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v_new)
        q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
        if meta.max_query_len == 1:  # pure decode: one query per sequence
            out = self._kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.context_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        cu_k = torch.nn.functional.pad(meta.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_context_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )
