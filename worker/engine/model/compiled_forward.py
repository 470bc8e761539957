"""The model's decoder compiled with torch.compile (inductor), one graph per token-count bucket.

A small batch's eager forward is partly per-op overhead: a decoder of a few dozen layers runs a
few hundred small ops per step. Inductor fuses the norms, rotary embedding and activations into a few C++
loops. The matmuls stay what the eager path runs, oneDNN on weights packed once
(``fast_linear``), sibling projections (q/k/v, gate/up) as one wide matmul: each is one opaque
op, ``torch.ops.inflightq.packed_linear`` (inductor's own bf16 matmuls are slower than the
packed ones), and the siblings' identical calls are merged by the
compiler's common-subexpression pass. The paged attention is one opaque op too
(``attention.custom_op``), so each bucket is one graph.

Shapes are bounded: a step of T tokens runs the smallest bucket >= T, its extra rows padding
(token 0 at position 0, never attended to, never written to the cache); a step larger than the
largest bucket runs the eager forward (long prefills, where matmuls dominate and compiling buys
little). Every bucket is compiled at warm-up, before the engine takes work, so no step waits
on a compile. Compiled artefacts go to inductor's caches under ``cache_dir``, so a restart on
the same machine, model and torch reloads them instead of compiling again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from worker.engine.model.fast_linear import PackedLinear, prepack_supported
from worker.engine.model.fused_projections import SIBLING_GROUPS

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path("~/.cache/inflightq/inductor")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


_PACKED: list[PackedLinear] = []  # what packed_linear's index refers to; weights live as long as the process


@torch.library.custom_op("inflightq::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return _PACKED[index](x)


@packed_linear_op.register_fake
def _(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class _MergeSiblingMatmuls(CustomGraphPass):
    """Inductor pass: identical ``packed_linear`` calls (a sibling group's q/k/v or gate/up) become one."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[tuple[Any, ...], torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.inflightq.packed_linear.default:
                continue
            key = (node.args, tuple(sorted(node.kwargs.items())))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> bytes:
        return b"inflightq-merge-sibling-matmuls-1"


class _OpLinear:
    """A linear's (or a sibling's) new forward: its columns of a packed matmul, as one opaque op.
    Run eagerly (steps past the largest bucket), siblings share the last wide result by input
    identity, as ``fused_projections`` does; compiled, the graph pass merges their calls."""

    def __init__(self, index: int, out_features: int, lo: int, hi: int, last: list[Any]) -> None:
        self.index, self.out_features, self.lo, self.hi = index, out_features, lo, hi
        self.last = last  # [input, output] of the group's last eager call, shared by the siblings

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            y = packed_linear_op(x, self.index, self.out_features)
        elif self.last[0] is x:
            y = self.last[1]
        else:
            y = packed_linear_op(x, self.index, self.out_features)
            self.last[:] = [x, y] if (self.lo, self.hi) != (0, self.out_features) else [None, None]
        if self.hi == self.out_features and self.last[0] is x:
            self.last[:] = [None, None]  # the group's last sibling: don't keep the activation alive
        return y if (self.lo, self.hi) == (0, self.out_features) else y[..., self.lo : self.hi]


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    _PACKED.append(PackedLinear(weight, bias))
    return len(_PACKED) - 1


@torch.no_grad()
def route_linears_through_ops(model: nn.Module) -> int:
    """Packs every plain bf16/fp32 linear of ``model`` (siblings as one wide weight) and reroutes its
    forward through ``packed_linear``; returns how many matmuls remain. No-op where packing isn't
    supported (fp64, GPU): inductor then compiles the linears itself."""
    first = next(model.parameters())
    if not prepack_supported(first.device, first.dtype):
        return 0
    count = 0
    for parent in model.modules():
        for names in SIBLING_GROUPS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(type(m) is nn.Linear and "forward" not in m.__dict__ for m in linears):
                continue
            if any(m.bias is not None for m in linears) or len({m.in_features for m in linears}) != 1:
                continue
            index = _pack(torch.cat([m.weight for m in linears]), None)
            total, lo, last = sum(m.out_features for m in linears), 0, [None, None]
            for m in linears:
                m.forward = _OpLinear(index, total, lo, lo + m.out_features, last)  # type: ignore[method-assign]
                lo += m.out_features
            count += 1
    for m in model.modules():
        if type(m) is nn.Linear and "forward" not in m.__dict__:
            m.forward = _OpLinear(_pack(m.weight, m.bias), m.out_features, 0, m.out_features, [None, None])  # type: ignore
            count += 1
    return count


def buckets_for(max_tokens: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a step of at most ``max_tokens`` tokens can use."""
    return tuple(b for b in buckets if b <= max_tokens) or (1,)


def use_cache_dir(cache_dir: str | None) -> Path:
    """Points inductor's on-disk caches (FX graphs, compiled kernels) at ``cache_dir``; set before compiling."""
    path = Path(cache_dir or DEFAULT_CACHE).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    # Inductor reads its cache root from this variable only; other processes' compiles are unaffected.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


class CompiledForward:
    """``hidden = forward(input_ids [T], positions [T])`` over padded buckets; ``None`` past the largest."""

    def __init__(
        self, model: Any, buckets: Sequence[int], *, cache_dir: str | None = None, dynamic: bool = False
    ) -> None:
        """``dynamic``: one graph for 2..max(buckets) tokens (no padding) plus one for a single token,
        instead of one graph per bucket: two compiles instead of len(buckets)."""
        self.decoder = model.get_decoder()
        self.dynamic = dynamic
        self.max_tokens = max(buckets)
        self.buckets = (1, 2) if dynamic and self.max_tokens >= 2 else tuple(sorted(buckets))
        self.device = next(model.parameters()).device
        self.cache_dir = use_cache_dir(cache_dir)
        self.warmup_s: float | None = None
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.buckets))
        self._compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.compile(
            self._body,
            dynamic=None if dynamic else False,
            fullgraph=True,
            # Single-threaded fused loops: at decode sizes they are microseconds of work, and an OpenMP
            # barrier per loop on shared cores costs many times that (see docs/benchmarks.md).
            # The matmuls and the attention kernel keep torch's threads.
            options={"post_grad_custom_pre_pass": _MergeSiblingMatmuls(), "cpp.threads": 1},
        )

    def _body(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.decoder(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        return out.last_hidden_state[0]

    def bucket(self, num_tokens: int) -> int | None:
        if self.dynamic:
            return num_tokens if num_tokens <= self.max_tokens else None
        return next((b for b in self.buckets if b >= num_tokens), None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [T_padded, H]; rows past T are padding. Call inside ``step_metadata``."""
        n = input_ids.numel()
        size = self.bucket(n)
        if size is None:
            return None
        if size > n:
            pad = size - n
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            positions = torch.nn.functional.pad(positions, (0, pad))
        if self.dynamic and size > 1:
            torch._dynamo.mark_dynamic(input_ids, 0, min=2, max=self.max_tokens)
            torch._dynamo.mark_dynamic(positions, 0, min=2, max=self.max_tokens)
        return self._compiled(input_ids, positions)

    def warmup(self, run_bucket: Callable[[int], None]) -> float:
        """Compiles every bucket (``run_bucket(size)`` runs one step of that many tokens); returns seconds."""
        started = time.perf_counter()
        for size in self.buckets:
            t0 = time.perf_counter()
            run_bucket(size)
            log.info("compiled forward: bucket of %d tokens ready in %.1f s", size, time.perf_counter() - t0)
        self.warmup_s = time.perf_counter() - started
        log.info(
            "compiled forward: %d buckets %s warmed up in %.1f s (cache %s)",
            len(self.buckets),
            list(self.buckets),
            self.warmup_s,
            self.cache_dir,
        )
        return self.warmup_s
