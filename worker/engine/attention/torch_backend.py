"""Paged attention in plain torch: runs on any device; the CPU path of the engine.

Decodes are attended together in one batched SDPA over their gathered context (padded to
the longest); each prefill chunk gets its own SDPA, and a chunk with no cached context
attends to its fresh K/V directly without touching the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    needs_flat_views = False

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
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
        v_new = value[0].transpose(0, 1)
        k_flat.index_copy_(0, meta.slot_mapping, k_new)
        v_flat.index_copy_(0, meta.slot_mapping, v_new)

        q = query[0]  # [Hq, T, D]
        out = q.new_empty(q.shape[1], q.shape[0], head_dim)
        nd = meta.num_decodes
        if nd:
            assert meta.decode_slots is not None
            qd = q[:, :nd].transpose(0, 1).unsqueeze(2)  # [B, Hq, 1, D]
            kd = k_flat[meta.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
            vd = v_flat[meta.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
            out[:nd] = od.squeeze(2)
        for chunk in meta.prefills:
            qp = q[:, chunk.start : chunk.end].unsqueeze(0)  # [1, Hq, n, D]
            if chunk.slots is None:
                kp = key[:, :, chunk.start : chunk.end]
                vp = value[:, :, chunk.start : chunk.end]
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kp = k_flat[chunk.slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
                vp = v_flat[chunk.slots].transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
            out[chunk.start : chunk.end] = op[0].transpose(0, 1)
        return out
