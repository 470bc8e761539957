"""Paged attention in plain torch: runs on any device; the CPU path of the engine.

The cache is laid out [Hkv, blocks * block_size, D] so that the model's K/V for the step
([1, Hkv, T, D]) is written with one index_copy_ and a sequence's context is gathered with
one index_select over whole blocks (far cheaper than per-token fancy indexing). Decodes are
attended together with two batched matmuls over (kv head, sequence), grouped-query heads
sharing their kv head's context; softmax runs in fp32 (fp64 for fp64 models). Each prefill
chunk gets its own SDPA; a chunk with no cached context attends to its fresh K/V directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engine.model.attention.metadata import AttentionMetadata, heads_first


class TorchAttentionBackend:
    needs_flat_views = False
    needs_decode_bias = True

    def cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks * block_size, head_dim)

    def forward(
        self,
        meta: AttentionMetadata,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        k_cache, v_cache = meta.kv_caches[layer]
        num_kv_heads, _, head_dim = k_cache.shape
        self._write_cache(meta, layer, key, value)
        blocks_k = k_cache.view(num_kv_heads, -1, meta.block_size, head_dim)
        blocks_v = v_cache.view(num_kv_heads, -1, meta.block_size, head_dim)

        q = query[0]  # [Hq, T, D]
        num_heads = q.shape[0]
        out = q.new_empty(q.shape[1], num_heads, head_dim)
        if meta.num_decodes:
            self._attend_decodes(meta, layer, q, out, scale)
        for chunk in meta.prefills:
            qp = q[:, chunk.start : chunk.end].unsqueeze(0)  # [1, Hq, n, D]
            if chunk.blocks is None:
                kp = key[:, :, chunk.start : chunk.end]
                vp = value[:, :, chunk.start : chunk.end]
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
            else:
                ctx = chunk.context_len
                kp = blocks_k.index_select(1, chunk.blocks).view(1, num_kv_heads, -1, head_dim)[:, :, :ctx]
                vp = blocks_v.index_select(1, chunk.blocks).view(1, num_kv_heads, -1, head_dim)[:, :, :ctx]
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
            out[chunk.start : chunk.end] = op[0].transpose(0, 1)
        return out

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

    def _write_cache(self, meta: AttentionMetadata, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        k_cache, v_cache = meta.kv_caches[layer]
        k_cache.index_copy_(1, meta.slot_mapping, key[0])
        v_cache.index_copy_(1, meta.slot_mapping, value[0])

    def _attend_decodes(
        self, meta: AttentionMetadata, layer: int, q: torch.Tensor, out: torch.Tensor, scale: float
    ) -> None:
        """Writes the attention of the first ``num_decodes`` rows of ``q`` ([Hq, T, D]) into ``out``."""
        assert meta.decode_blocks is not None and meta.decode_bias is not None
        k_cache, v_cache = meta.kv_caches[layer]
        num_kv_heads, _, head_dim = k_cache.shape
        num_heads, nd = q.shape[0], meta.num_decodes
        group = num_heads // num_kv_heads
        blocks_k = k_cache.view(num_kv_heads, -1, meta.block_size, head_dim)
        blocks_v = v_cache.view(num_kv_heads, -1, meta.block_size, head_dim)
        # Batched over (kv head, sequence), the layout the block gather produces, with plain matmuls:
        # for one query per sequence this is faster on CPU than SDPA's flash kernel.
        qd = q[:, :nd].view(num_kv_heads, group, nd, head_dim).transpose(1, 2)  # [Hkv, B, G, D]
        kd = blocks_k.index_select(1, meta.decode_blocks).view(num_kv_heads, nd, -1, head_dim)
        vd = blocks_v.index_select(1, meta.decode_blocks).view(num_kv_heads, nd, -1, head_dim)
        scores = torch.matmul(qd, kd.transpose(-1, -2)).to(meta.decode_bias.dtype) * scale + meta.decode_bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        od = torch.matmul(probs, vd)  # [Hkv, B, G, D]
        out[:nd] = od.permute(1, 0, 2, 3).reshape(nd, num_heads, head_dim)
