"""Prepacked linear layers on CPU (oneDNN, MKL, or the engine's decode kernel), for bf16 and fp32.

``F.linear`` on CPU re-lays-out the weight for its kernel on every call; for the small row
counts of a decode step that costs as much as the multiply itself, so each weight is packed once
into oneDNN's blocked format. Packed copies live beside the originals, so code that reads
``.weight`` still works.

On a CPU without bf16 instructions (no AVX512_BF16 / AMX) oneDNN emulates a bf16 matmul, slower
than fp32; there the packed copy of a bf16 weight is its exact fp32 upcast and the matmul runs in
fp32 on the upcast input, rounding the output to bf16: the same products and fp32 accumulation a
native bf16 matmul does, at fp32 speed, for twice the weight memory.

With ``decode_rows`` (the engine sets it from ``decode_rows_for`` where the CPU kernels are
built), a bf16 weight also gets the layout of ``decode_linear.cpp``, and calls of 1 to
``decode_rows`` rows -- the decode steps of a few streams -- go through that kernel, which
streams the bf16 weight (with AVX-512 or AVX2 but no bf16 unit it reads half the bytes of the
fp32 upcast); larger calls stay on oneDNN. The cost is one more copy of the weights, so the engine
takes it only while that copy is a small share of the free memory (``decode_copy_fits``).

With ``tile_rows`` (``tile_rows_for``: a CPU with AMX whose kernel is built and allowed), a bf16
weight also gets ``amx_linear.cpp``'s layout of AMX tiles, and calls of more rows than
``decode_rows`` up to ``tile_rows`` -- the decode steps of several streams -- go through it,
which streams the weight nearer the memory's rate than oneDNN's AMX matmul at those row counts;
one more copy of the weights, under the same memory rule.

An fp32 weight on an Intel CPU is packed for MKL's sgemm (``cblas_sgemm_pack``, through torch's
``mkl::_mkl_linear``) instead of oneDNN, which it beats at decode and prefill-chunk row counts;
a vocabulary-wide weight (wider than ``MKL_MAX_OUT_FEATURES``) stays on oneDNN, which is faster
for it past a few dozen rows. One packing serves every row count. MKL asks for a few times a
weight's bytes but writes, so commits, about the weight's size. On other vendors' CPUs MKL is not
known to pick its tuned kernels, so oneDNN stays there. Figures: see docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.engine.core.memory import anonymous_memory
from worker.engine.model.hardware import cpu_has_fast_bf16, cpu_vendor, cpu_widens_bf16

PACKED_DTYPES = (torch.bfloat16, torch.float32)  # float64 stays on plain F.linear (exactness tests)
KERNEL_MAX_ROWS = 16  # the most rows the decode_linear op takes
# Rows up to which decode_linear beats oneDNN over a whole model's linears: against native bf16
# (AVX512-BF16) oneDNN's blocking wins past 4; against the fp32 upcast (AVX-512 or AVX2 without bf16)
# the kernel reads half the bytes and still wins at 16.
DECODE_ROWS_NATIVE_BF16 = 4
DECODE_ROWS_UPCAST = 16
DECODE_CHUNK = 32  # decode_linear (and amx_linear) read in_features in chunks of this many values
# Rows up to which amx_linear takes a bf16 matmul from oneDNN's AMX one: all the op takes. A decode
# step of that many sequences is faster on it, its layers then one op (docs/benchmarks.md).
TILE_ROWS = 64
DECODE_COPY_MAX_SHARE = 0.1  # of the free memory the decode layouts may take
# Rows MKL packs an fp32 weight for: a packing serves any row count; 32 is the fastest of 16, 32
# and 64 at decode and prefill-chunk row counts (see docs/benchmarks.md).
MKL_PACK_ROWS = 32
MKL_MAX_OUT_FEATURES = 16_384  # wider (a vocabulary head) stays on oneDNN, faster for it past a few dozen rows

LinearForward = Callable[[torch.Tensor], torch.Tensor]


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


def mkl_fp32_matmuls() -> bool:
    """Whether fp32 linears run through MKL's packed sgemm rather than oneDNN (Intel CPUs)."""
    return (
        torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        and cpu_vendor() == "GenuineIntel"
    )


def pack_weight_for_mkl(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed layout of an [out, in] fp32 linear weight (check ``mkl_fp32_matmuls`` first)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), MKL_PACK_ROWS)


def mkl_packed_linear(
    packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor:
    # torch's op multiplies by the packed copy only when its last argument equals the input's row
    # count (otherwise it falls back to F.linear on ``weight``): passing the rows themselves always
    # takes the packed copy, which MKL computes for any row count.
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.numel() // x.shape[-1])


def upcast_bf16_matmuls() -> bool:
    """Whether bf16 linears run as fp32 matmuls on upcast weights (CPUs without bf16 units)."""
    return not cpu_has_fast_bf16()


def decode_rows_for(dtype: torch.dtype) -> int:
    """Rows up to which ``decode_linear`` beats oneDNN for a bf16 linear on this CPU; 0 = never
    (without AVX2 its plain loop is only there to keep the op testable)."""
    if dtype != torch.bfloat16:
        return 0
    if cpu_has_fast_bf16():
        return DECODE_ROWS_NATIVE_BF16
    return DECODE_ROWS_UPCAST if cpu_widens_bf16() else 0


def tile_rows_for(dtype: torch.dtype) -> int:
    """Rows up to which ``amx_linear`` is used for a bf16 linear on this CPU; 0 = never (no AMX, or
    the kernel not built, or the OS did not grant the tiles' state). Call with the kernels loaded."""
    if dtype != torch.bfloat16 or not hasattr(torch.ops.inflightq, "amx_linear_supported"):
        return 0
    return TILE_ROWS if torch.ops.inflightq.amx_linear_supported() else 0


def decode_copy_fits(model: nn.Module, available_bytes: int, copies: int = 1) -> bool:
    """Whether ``copies`` more layouts of ``model``'s linear weights fit in DECODE_COPY_MAX_SHARE of
    ``available_bytes`` (the memory free before the engine sizes its KV cache)."""
    copy = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is nn.Linear)
    return copies * copy <= DECODE_COPY_MAX_SHARE * available_bytes


class PackedLinear:
    """``x -> x @ weight.T + bias`` through a packed copy of ``weight`` (and, with
    ``decode_rows``, ``decode_linear``'s layout of it for calls of up to that many rows; with
    ``tile_rows``, ``amx_linear``'s for calls of more rows, up to that many)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        decode_rows: int = 0,
        tile_rows: int = 0,
        mkl: bool | None = None,
    ) -> None:
        self.upcast = weight.dtype == torch.bfloat16 and upcast_bf16_matmuls()
        compute = torch.float32 if self.upcast else weight.dtype
        self.bias = bias.detach().to(compute) if bias is not None else None
        # ``mkl``: None = the engine's choice (an Intel CPU, not a vocabulary-wide weight); tests and
        # bench.linear_rows force either way.
        if mkl is None:
            mkl = mkl_fp32_matmuls() and weight.shape[0] <= MKL_MAX_OUT_FEATURES
        self.mkl = weight.dtype == torch.float32 and mkl
        # MKL's op needs the plain weight beside the packing (it checks shapes and dtypes on it).
        self.weight = weight.detach() if self.mkl else None
        self.packed = pack_weight_for_mkl(weight) if self.mkl else pack_weight(weight.detach().to(compute))
        self.out_features, self.in_features = weight.shape
        self.laid_out: torch.Tensor | None = None
        self.bias32: torch.Tensor | None = None
        if decode_rows and weight.dtype == torch.bfloat16 and self.in_features % DECODE_CHUNK == 0:
            self.laid_out = torch.ops.inflightq.decode_linear_layout(weight.detach())
            self.bias32 = bias.detach().float() if bias is not None else None
        self.decode_numel = min(decode_rows, KERNEL_MAX_ROWS) * self.in_features
        self.tiles: torch.Tensor | None = None
        if tile_rows and weight.dtype == torch.bfloat16 and self.in_features % DECODE_CHUNK == 0:
            self.tiles = torch.ops.inflightq.amx_linear_layout(weight.detach())
            if self.bias32 is None and bias is not None:
                self.bias32 = bias.detach().float()
        self.tile_numel = min(tile_rows, TILE_ROWS) * self.in_features

    def kernel_weight(self, numel: int) -> torch.Tensor | None:
        """The layout a call of ``numel`` input values runs on: ``laid_out`` (decode_linear) or
        ``tiles`` (amx_linear); None where it goes to oneDNN or MKL. ``decode_layer`` calls the
        kernel that the layout names, so its one op routes every matmul as this does."""
        if self.laid_out is not None and numel <= self.decode_numel:
            return self.laid_out
        if self.tiles is not None and numel <= self.tile_numel:
            return self.tiles
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.kernel_weight(x.numel())
        if weight is not None:
            kernel = torch.ops.inflightq.decode_linear if weight is self.laid_out else torch.ops.inflightq.amx_linear
            return kernel(x, weight, self.bias32, self.out_features)
        if self.upcast:
            return packed_linear(self.packed, self.bias, x.float()).to(torch.bfloat16)
        if self.weight is not None:
            return mkl_packed_linear(self.packed, self.weight, self.bias, x)
        return packed_linear(self.packed, self.bias, x)


@torch.no_grad()
def prepack_linears(model: nn.Module, *, decode_rows: int = 0, tile_rows: int = 0) -> int:
    """Routes every bf16/fp32 nn.Linear of ``model`` through a packed weight; returns how many.
    ``decode_rows``: bf16 calls of up to that many rows through ``decode_linear`` (``decode_rows_for``);
    ``tile_rows``: of more, up to that many, through ``amx_linear`` (``tile_rows_for``)."""
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.dtype not in PACKED_DTYPES:
            continue
        if "forward" in module.__dict__:  # already rerouted (a fused sibling projection)
            continue
        module.forward = PackedLinear(  # type: ignore[method-assign]
            module.weight, module.bias, decode_rows=decode_rows, tile_rows=tile_rows
        )
        count += 1
    return count


def packed_linears_in_order(model: nn.Module) -> list[PackedLinear]:
    """``model``'s packed linears, each once, in the order ``model.modules()`` reaches them: for
    Llama-style models the forward's order (each layer's fused q/k/v, o, fused gate/up, down; then
    the head)."""
    found: list[PackedLinear] = []
    seen: set[int] = set()
    for module in model.modules():
        forward = module.__dict__.get("forward")
        group = getattr(forward, "group", None)  # a fused sibling's slice: the group holds the matmul
        for linear in (getattr(group, "packed", None), forward):
            if isinstance(linear, PackedLinear) and id(linear) not in seen:
                seen.add(id(linear))
                found.append(linear)
    return found


def decode_layouts_in_order(model: nn.Module) -> list[PackedLinear]:
    """The linears laid out for ``decode_linear``, each once, in the forward's order."""
    return [linear for linear in packed_linears_in_order(model) if linear.laid_out is not None]


@torch.no_grad()
def gather_decode_layouts(model: nn.Module) -> int:
    """Moves every decode layout of ``model`` into one buffer, in the forward's order; returns its bytes.

    A decode step of a few rows is a stream of these weights. Allocated one by one they lie apart,
    and each call's stream starts cold; back to back in the order the step reads them, the stream
    runs on from one linear into the next (see docs/benchmarks.md).
    The buffer asks for 2 MB pages (``anonymous_memory``): in 4 KB ones the hardware prefetcher
    stops at every page, every 64 cache lines of the stream.
    Same values, so the same results. While copying, the buffer and the layouts not yet moved both
    exist: up to twice the second copy that ``decode_copy_fits`` admitted, for a moment."""
    linears = decode_layouts_in_order(model)  # each with a layout, so ``laid_out`` is never None below
    total = sum(linear.laid_out.numel() for linear in linears)  # type: ignore[union-attr]
    arena = anonymous_memory(total, torch.bfloat16)  # in 2 MB pages where the kernel has them
    offset = 0
    for linear in linears:
        old: torch.Tensor = linear.laid_out  # type: ignore[assignment]
        linear.laid_out = arena[offset : offset + old.numel()].view(old.shape).copy_(old)
        offset += old.numel()  # the old layout is freed here: at most one whole copy extra at any time
    return total * arena.element_size()
