"""RMSNorm in one op on CPU: transformers' Llama-style norm module, rerouted to ``rms_norm.cpp``.

The module computes the norm as eight tensor ops (to fp32, pow, mean, add, rsqrt, mul, back to
the model's dtype, times the weight). At decode row counts each costs its dispatch, not its
arithmetic, and a forward runs the norm twice per layer: the fused op pays one dispatch (bf16
bit-identical to the module; fp32 within an ulp, the reduction order differs; figures: see
docs/benchmarks.md).

Only modules whose ``forward`` is the Llama norm's own code are rerouted (transformers copies it
verbatim into Qwen2, Mistral and others); a norm with another formula (Gemma's ``1 + weight``)
keeps its module. float64 stays on the module: the exactness tests compare it with ``generate``.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _llama_norm_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return inspect.getsource(LlamaRMSNorm.forward)


@functools.cache
def _is_llama_norm(cls: type) -> bool:
    try:
        return inspect.getsource(cls.forward) == _llama_norm_source()
    except (OSError, TypeError):  # no source (a compiled class): don't guess
        return False


def fused_rms_norm_available() -> bool:
    """Whether the CPU kernels' library (built by ``kernels.cpu_kernel``) is loaded with the op."""
    return hasattr(torch.ops, "inflightq") and hasattr(torch.ops.inflightq, "rms_norm")


class FusedRMSNorm:
    """``x -> weight * rms_norm(x)`` with the module's rounding steps, in one op."""

    def __init__(self, module: nn.Module) -> None:
        self.weight = module.weight
        self.eps = float(module.variance_epsilon)
        self.module_forward = module.forward  # the class's own, bound before the reroute

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:  # the module would promote; keep its answer
            return self.module_forward(hidden_states)
        return torch.ops.inflightq.rms_norm(hidden_states, self.weight, self.eps)


@torch.no_grad()
def fuse_rms_norms(model: nn.Module) -> int:
    """Reroutes every Llama-style RMSNorm of a CPU bf16/fp16/fp32 ``model``; returns how many."""
    if not fused_rms_norm_available():
        return 0
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (
            isinstance(weight, torch.Tensor)
            and weight.dim() == 1
            and weight.device.type == "cpu"
            and weight.dtype in FUSED_DTYPES
            and hasattr(module, "variance_epsilon")
            and "forward" not in module.__dict__
            and _is_llama_norm(type(module))
        ):
            continue
        module.forward = FusedRMSNorm(module)  # type: ignore[method-assign]
        count += 1
    return count
