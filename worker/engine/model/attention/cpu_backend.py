"""The CPU attention backend: the plain-torch backend with decodes done by the compiled
paged-decode kernel (``paged_decode.cpp``), which reads each cached K/V row in place instead
of gathering every decode's context into a padded copy first.

The gather and its two batched matmuls move several times the bytes of the cache they read; on a
memory-bound CPU the kernel's one pass is faster per layer (see docs/benchmarks.md). Prefill
chunks still use SDPA through the plain-torch path.
"""

from __future__ import annotations

import torch

from worker.engine.model.attention.metadata import AttentionMetadata
from worker.engine.model.attention.torch_backend import TorchAttentionBackend


class CpuKernelAttentionBackend(TorchAttentionBackend):
    needs_decode_bias = False

    def forward_tokens(
        self,
        meta: AttentionMetadata,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """A decode-only step in the fused layer's token-major layout, which is the kernels' own:
        four ops per layer instead of a dozen views and copies around them."""
        if meta.prefills:
            return super().forward_tokens(meta, layer, query, key, value, scale)
        self._write_cache(meta, layer, key, value)
        out = torch.empty_like(query)
        self._paged_decode(meta, layer, query, out, scale)
        return out

    def _write_cache(self, meta: AttentionMetadata, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        k_cache, v_cache = meta.kv_caches[layer]
        torch.ops.inflightq.cache_write(key, value, k_cache, v_cache, meta.slot_mapping)

    def _attend_decodes(
        self, meta: AttentionMetadata, layer: int, q: torch.Tensor, out: torch.Tensor, scale: float
    ) -> None:
        query = q[:, : meta.num_decodes].transpose(0, 1).contiguous()  # [B, Hq, D]; already contiguous for HF's layout
        self._paged_decode(meta, layer, query, out[: meta.num_decodes], scale)

    def _paged_decode(
        self, meta: AttentionMetadata, layer: int, query: torch.Tensor, out: torch.Tensor, scale: float
    ) -> None:
        """Decodes' attention, query and out [B, Hq, D] contiguous, straight from the paged cache."""
        assert meta.decode_blocks is not None and meta.decode_context_lens is not None
        k_cache, v_cache = meta.kv_caches[layer]
        torch.ops.inflightq.paged_decode(
            query,
            k_cache,
            v_cache,
            meta.decode_blocks.view(meta.num_decodes, -1),
            meta.decode_context_lens,
            meta.block_size,
            scale,
            out,
        )
