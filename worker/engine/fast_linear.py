"""Prepacked linear layers on CPU (oneDNN), for bf16 and fp32.

``F.linear`` on CPU re-lays-out the weight for its kernel on every call; for the small row
counts of a decode step that costs as much as the multiply itself. Packing each weight once
into oneDNN's blocked format makes a 1..8-row bf16 matmul about 2x faster and a 32-row one
15-40% faster, fp32 1.3-1.6x at 8-32 rows (measured on the 2-core AVX-512-BF16 box).
Packed copies live beside the originals, so code that reads ``.weight`` still works.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float32)  # float64 stays on plain F.linear (exactness tests)


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of an [out, in] linear weight (check ``prepack_supported`` first)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.no_grad()
def prepack_linears(model: nn.Module) -> int:
    """Routes every bf16/fp32 nn.Linear of ``model`` through a packed weight; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.dtype not in PACKED_DTYPES:
            continue
        if "forward" in module.__dict__:  # already rerouted (a fused sibling projection)
            continue
        bias = module.bias.detach() if module.bias is not None else None
        module.forward = functools.partial(packed_linear, pack_weight(module.weight), bias)  # type: ignore[method-assign]
        count += 1
    return count
