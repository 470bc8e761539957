"""One matmul for sibling projections that read the same input (q/k/v, gate/up).

A decoder layer of a Llama-style model calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` on
the same tensor, then ``gate_proj(h)`` and ``up_proj(h)``: five small matmuls where two wider
ones do the same work. On CPU at decode-sized row counts the two wide ones are faster (oneDNN;
see docs/benchmarks.md), and on GPU they are fewer kernel launches. This is what vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` do, but without touching the model's
code: each sibling's ``forward`` is rerouted to a shared group that runs the wide matmul the
first time it sees an input and hands each sibling its column slice. A sibling called with an
input the group has not seen (a model that feeds them different tensors) still gets the right
answer: the group simply recomputes for that input.

The originals keep their ``.weight``: on GPU they become views into the fused weight (no extra
memory); on CPU the fused weight is packed for oneDNN beside them, as ``fast_linear`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.model.fast_linear import PackedLinear, prepack_supported

SIBLING_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjection:
    """The wide matmul of one sibling group and the column range of each sibling."""

    def __init__(self, linears: list[nn.Linear], *, pack: bool, decode_rows: int = 0, tile_rows: int = 0) -> None:
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        self.bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None  # type: ignore[misc]
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for m in linears:
            self.bounds.append((start, start + m.out_features))
            start += m.out_features
        self.packed: PackedLinear | None = None
        if pack and prepack_supported(weight.device, weight.dtype):
            self.packed = PackedLinear(weight, self.bias, decode_rows=decode_rows, tile_rows=tile_rows)
            self.weight = weight  # kept for F.linear fallbacks; the originals still hold theirs too
        else:
            # Point the originals into the fused weight so the fusion costs no memory.
            self.weight = weight
            for m, (lo, hi) in zip(linears, self.bounds, strict=True):
                m.weight = nn.Parameter(weight[lo:hi], requires_grad=False)
                if self.bias is not None:
                    m.bias = nn.Parameter(self.bias[lo:hi], requires_grad=False)
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._pending = 0  # siblings yet to take their slice of _output

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)

    def slice_for(self, index: int, x: torch.Tensor) -> torch.Tensor:
        # ``is``: the group holds a reference to its input, so a new tensor can't reuse its identity.
        if x is not self._input or self._output is None:
            self._input, self._output = x, self.matmul(x)
            self._pending = len(self.bounds)
        lo, hi = self.bounds[index]
        out = self._output[..., lo:hi]
        self._pending -= 1
        if self._pending <= 0:  # every sibling served: don't keep the activation alive until next step
            self._input = self._output = None
        return out


def _fusable(linears: list[nn.Module]) -> bool:
    # A forward already in the instance dict means someone rerouted it (an earlier fusion, packing).
    if not all(type(m) is nn.Linear and "forward" not in m.__dict__ for m in linears):
        return False
    first = linears[0]
    return all(
        m.in_features == first.in_features  # type: ignore[attr-defined]
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )


@torch.no_grad()
def fuse_sibling_projections(model: nn.Module, *, pack: bool = True, decode_rows: int = 0, tile_rows: int = 0) -> int:
    """Reroutes every sibling group of ``model`` through one wide matmul; returns how many groups.
    ``pack``: lay the fused weight out for oneDNN where ``prepack_supported`` says it helps;
    ``decode_rows`` / ``tile_rows``: and for ``decode_linear`` / ``amx_linear`` up to that many rows
    (``fast_linear.PackedLinear``)."""
    count = 0
    for parent in model.modules():
        for names in SIBLING_GROUPS:
            linears = [getattr(parent, name, None) for name in names]
            if any(m is None for m in linears) or not _fusable(linears):  # type: ignore[arg-type]
                continue
            group = FusedProjection(linears, pack=pack, decode_rows=decode_rows, tile_rows=tile_rows)  # type: ignore[arg-type]
            for index, module in enumerate(linears):
                module.forward = _SliceForward(group, index)  # type: ignore[union-attr, method-assign]
            count += 1
    return count


class _SliceForward:
    """A sibling's new forward: its slice of the group's wide matmul."""

    def __init__(self, group: FusedProjection, index: int) -> None:
        self.group, self.index = group, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.slice_for(self.index, x)
