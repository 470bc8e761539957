"""Paged attention behind one interface, plugged into Hugging Face models through AttentionInterface.

The model runner builds one ``AttentionMetadata`` per step and passes it as the forward kwarg
``inflightq_meta``; transformers hands every kwarg down to each attention call, where
``paged_attention`` writes the step's K/V into the layer's cache and lets the backend attend.
A compiled forward passes no such kwarg: it goes through the opaque op of ``custom_op``, which
reads the same metadata from ``step_metadata``.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.engine.model.attention.custom_op import paged_attention_op
from worker.engine.model.attention.metadata import AttentionBackend, AttentionMetadata

ATTN_IMPLEMENTATION = "inflightq_paged"


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    inflightq_meta: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    scale = scaling or query.shape[-1] ** -0.5
    if inflightq_meta is None:  # a compiled forward: one opaque op, the metadata set around the step
        out = paged_attention_op(query, key, value, module.layer_idx, scale)
    else:
        inflightq_meta.stop_if_interrupted(module.layer_idx)
        out = inflightq_meta.backend.forward(inflightq_meta, module.layer_idx, query, key, value, scale)
    return out.unsqueeze(0), None  # [1, T, Hq, D], as transformers' attention functions return


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def make_backend(
    name: str, device: torch.device, block_size: int, *, cpu_kernels: bool = True, kernel_cache_dir: str | None = None
) -> AttentionBackend:
    """``cpu_kernels=False``: never build the compiled CPU kernel (``auto`` then picks torch on CPU)."""
    # flash-attn's paged kernels take blocks of a multiple of 256 tokens only.
    flash_ok = device.type == "cuda" and block_size % 256 == 0
    if name == "auto":
        if device.type == "cpu":
            name = "cpu" if cpu_kernels and cpu_kernels_available(kernel_cache_dir) else "torch"
        else:
            name = "flash" if flash_ok and _has_flash_attn() else "torch"
    if name == "flash" and not flash_ok:
        raise ValueError("the flash backend needs a CUDA device and a block_size that is a multiple of 256")
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("the cpu backend runs on CPU tensors only")
        if not cpu_kernels:
            raise ValueError("the cpu backend is the compiled CPU kernel, which cpu_kernels=False turns off")
        if not cpu_kernels_available(kernel_cache_dir):
            raise RuntimeError("the cpu backend's kernel could not be built (see the warning above); use torch")
        from worker.engine.model.attention.cpu_backend import CpuKernelAttentionBackend

        return CpuKernelAttentionBackend()
    if name == "torch":
        from worker.engine.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "flash":
        from worker.engine.model.attention.flash_backend import FlashAttentionBackend

        return FlashAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (torch, cpu, flash, auto)")


def cpu_kernels_available(cache_dir: str | None = None) -> bool:
    """Builds (once per machine) and loads the CPU kernels' library; False if it can't be built."""
    from worker.engine.model.kernels.cpu_kernel import paged_decode_available

    return paged_decode_available(cache_dir)


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


__all__ = ["ATTN_IMPLEMENTATION", "AttentionBackend", "AttentionMetadata", "make_backend", "register"]
