"""A Llama-style decoder layer's forward in a dozen ops on CPU, instead of about forty-five.

At one to a few streams a decode step of a small model is mostly dispatch: transformers' layer
runs its norm, three projections, the rotary embedding (views, slices, negations, cats), the
attention call, the residual adds and the MLP as ~45 tensor ops and 8 module calls, each a few
microseconds of Python and dispatcher for a few hundred values of arithmetic. This forward
calls the same weights through the fused pieces the engine already has (the q/k/v and gate/up
groups of ``fused_projections``, the ``rms_norm`` op) and three more ops of
``decoder_layer_ops.cpp`` / ``rms_norm.cpp``: ``rotary_split`` (split q/k/v, rotate q and k),
``add_rms_norm`` (the residual add and the next norm) and ``silu_mul``. Each keeps the module
code's rounding steps, so a bf16 model gives the module's values (bit for bit but for an ulp
where the order of a sum or the exp differs).

Only layers whose code is Llama's own are rerouted (transformers copies it verbatim into
Mistral, Qwen2 and others): the layer's, its attention's and its MLP's ``forward`` and the
rotary function must have Llama's source, the activation must be SiLU, and the projections and
norms must already be fused. Anything else (Qwen3's q/k norms, Gemma's scaled embeddings,
float64 models, a call without the engine's attention metadata) keeps transformers' forward.

A decode-only step whose four projections all go through ``decode_linear`` (bf16, a few rows) or
``amx_linear`` (bf16 on AMX, a few dozen rows) on the CPU kernel attention backend runs the whole
layer as one op instead (``decode_layer.cpp``): the same ops in the same order, called from C++,
which saves each one's call from Python (bit for bit the same values). ``decode_forward`` goes one
further: all the layers as one op (``DecodeLayers``, ``decode_layers`` in ``decode_layer.cpp``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
from torch import nn

from worker.engine.model.attention.cpu_backend import CpuKernelAttentionBackend
from worker.engine.model.fast_linear import PackedLinear
from worker.engine.model.fused_norms import FusedRMSNorm
from worker.engine.model.fused_projections import FusedProjection

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fused_layer_ops_available() -> bool:
    """Whether the CPU kernels' library (built by ``kernels.cpu_kernel``) is loaded with the ops."""
    ops = getattr(torch.ops, "inflightq", None)
    names = ("rotary_split", "add_rms_norm", "silu_mul", "decode_layer", "decode_layers")
    return ops is not None and all(hasattr(ops, name) for name in names)


def _function_source(module: Any, name: str) -> str:
    """The source of ``module.name``, a function; transformers >= 5.25 (with the ``kernels`` package)
    wraps some, ``apply_rotary_pos_emb`` among them, in an ``nn.Module`` whose ``forward`` calls the
    function from its closure: the source is then that function's."""
    obj = getattr(module, name)
    if inspect.isfunction(obj):
        return inspect.getsource(obj)
    forward = getattr(type(obj), "forward", None)
    for cell in getattr(forward, "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner) and inner.__name__ == name:
            return inspect.getsource(inner)
    raise TypeError(f"{name} is neither a function nor a module wrapping one")


@functools.cache
def _llama_sources() -> dict[str, str]:
    from transformers.models.llama import modeling_llama as llama

    return {
        "layer": inspect.getsource(llama.LlamaDecoderLayer.forward),
        "attention": inspect.getsource(llama.LlamaAttention.forward),
        "mlp": inspect.getsource(llama.LlamaMLP.forward),
        "rotary": _function_source(llama, "apply_rotary_pos_emb") + _function_source(llama, "rotate_half"),
    }


@functools.cache
def _has_llama_code(layer_cls: type, attention_cls: type, mlp_cls: type) -> bool:
    try:
        module = sys.modules[attention_cls.__module__]
        rotary = _function_source(module, "apply_rotary_pos_emb") + _function_source(module, "rotate_half")
        sources = {
            "layer": inspect.getsource(layer_cls.forward),
            "attention": inspect.getsource(attention_cls.forward),
            "mlp": inspect.getsource(mlp_cls.forward),
            "rotary": rotary,
        }
    except (AttributeError, OSError, TypeError):  # no source, no rotary function: don't guess
        return False
    return sources == _llama_sources()


def _group(module: nn.Module, size: int) -> FusedProjection | None:
    """The fused group ``module`` is the first sibling of, if it has ``size`` siblings."""
    forward = module.__dict__.get("forward")
    group = getattr(forward, "group", None)
    if not isinstance(group, FusedProjection) or getattr(forward, "index", None) != 0 or len(group.bounds) != size:
        return None
    return group


def _is_silu(act: object) -> bool:
    from transformers.activations import SiLUActivation

    return type(act) in (nn.SiLU, SiLUActivation) and "forward" not in act.__dict__


def _no_hooks(*modules: nn.Module) -> bool:
    return all(not (m._forward_hooks or m._forward_pre_hooks) for m in modules)


class FusedDecoderLayer:
    """The rerouted ``forward`` of one decoder layer."""

    def __init__(self, layer: nn.Module, qkv: FusedProjection, gate_up: FusedProjection, num_heads: int) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        in_norm, post_norm = layer.input_layernorm.forward, layer.post_attention_layernorm.forward
        self.module_forward = layer.forward  # the class's own, bound before the reroute
        self.layer_idx: int = attention.layer_idx
        self.scale = float(attention.scaling)
        self.head_dim: int = attention.head_dim
        self.num_heads = num_heads
        self.num_kv_heads = (qkv.bounds[1][1] - qkv.bounds[1][0]) // self.head_dim
        self.dtype = qkv.weight.dtype
        self.in_weight, self.in_eps = in_norm.weight, in_norm.eps
        self.post_weight, self.post_eps = post_norm.weight, post_norm.eps
        self.qkv, self.gate_up = qkv, gate_up
        # The projection modules, by which a step's LoRA adapters name their weights (lora.py).
        self.lora_qkv = [
            (m, lo, hi)
            for m, (lo, hi) in zip((attention.q_proj, attention.k_proj, attention.v_proj), qkv.bounds, strict=True)
        ]
        self.lora_gate_up = [
            (m, lo, hi) for m, (lo, hi) in zip((mlp.gate_proj, mlp.up_proj), gate_up.bounds, strict=True)
        ]
        self.lora_o, self.lora_down = attention.o_proj, mlp.down_proj
        # Their forwards, called directly: a module call costs more than the packed matmul's dispatch.
        self.o_proj, self.down_proj = attention.o_proj.forward, mlp.down_proj.forward
        # The four matmuls in the layer's order, where each is a PackedLinear (the one-op decode step).
        projections = (qkv.packed, self.o_proj, gate_up.packed, self.down_proj)
        self.packed: tuple[PackedLinear, ...] = (
            projections if all(isinstance(p, PackedLinear) for p in projections) else ()  # type: ignore[assignment]
        )
        self.one_op = True  # bench.step_ab turns it off in place to measure what it saves

    def __call__(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        meta = kwargs.get("inflightq_meta")
        if meta is None or position_embeddings is None or hidden_states.dtype != self.dtype:
            return self.module_forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        cos, sin = position_embeddings
        return self.step(meta, hidden_states, cos, sin)

    def step(self, meta: Any, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The layer on the engine's metadata (``__call__`` once it has checked it applies;
        ``decode_forward`` calls it directly): the one op where it applies, else the ops one by one."""
        meta.stop_if_interrupted(self.layer_idx)
        weights = self._one_op_weights(hidden_states) if self._one_op_applies(meta) else None
        if weights is not None:
            return self._one_op(meta, hidden_states, cos, sin, weights)
        ops = torch.ops.inflightq
        lora = meta.lora  # the step's LoRA rows, if any: each projection's output gets their deltas
        normed = ops.rms_norm(hidden_states, self.in_weight, self.in_eps)
        qkv = self.qkv.matmul(normed)
        if lora is not None:
            qkv = lora.siblings(self.lora_qkv, normed, qkv)
        q, k, v = ops.rotary_split(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)  # [T, heads, D]
        attended = meta.backend.forward_tokens(meta, self.layer_idx, q, k, v, self.scale)  # [T, heads, D]
        attended = attended.view(*hidden_states.shape[:-1], -1)
        attn_out = self.o_proj(attended)
        if lora is not None:
            attn_out = lora.module(self.lora_o, attended, attn_out)
        normed, residual = ops.add_rms_norm(attn_out, hidden_states, self.post_weight, self.post_eps)
        gate_up = self.gate_up.matmul(normed)
        if lora is not None:
            gate_up = lora.siblings(self.lora_gate_up, normed, gate_up)
        activated = ops.silu_mul(gate_up)
        down = self.down_proj(activated)
        if lora is not None:
            down = lora.module(self.lora_down, activated, down)
        return residual + down

    def _one_op_applies(self, meta: Any, lora_ok: bool = False) -> bool:
        """A decode-only step on the CPU kernel backend (``_one_op_weights`` then says whether every
        matmul goes to a kernel the one op calls); with LoRA rows only where the caller adds their
        deltas (``lora_ok``: DecodeLayers does, decode_layer does not)."""
        return (
            self.one_op
            and bool(self.packed)
            and not meta.prefills
            and (meta.lora is None or lora_ok)
            and isinstance(meta.backend, CpuKernelAttentionBackend)
        )

    def _one_op_weights(self, hidden_states: torch.Tensor) -> list[torch.Tensor] | None:
        """The layouts the four matmuls of a step of these rows run on, each as its PackedLinear routes
        it (decode_linear's or amx_linear's; decode_layer calls the kernel a layout names), or None
        where any goes to oneDNN."""
        rows = hidden_states.numel() // hidden_states.shape[-1]
        weights = [p.kernel_weight(rows * p.in_features) for p in self.packed]
        return None if any(w is None for w in weights) else weights  # type: ignore[return-value]

    def _one_op(
        self, meta: Any, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: list[torch.Tensor]
    ) -> torch.Tensor:
        qkv, o, gate_up, down = self.packed
        k_cache, v_cache = meta.kv_caches[self.layer_idx]
        return torch.ops.inflightq.decode_layer(
            hidden_states, self.in_weight, self.in_eps,
            weights[0], qkv.bias32, qkv.out_features,
            cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
            k_cache, v_cache, meta.slot_mapping,
            meta.decode_blocks.view(meta.num_decodes, -1), meta.decode_context_lens, meta.block_size, self.scale,
            weights[1], o.bias32, o.out_features,
            self.post_weight, self.post_eps,
            weights[2], gate_up.bias32, gate_up.out_features,
            weights[3], down.bias32, down.out_features,
        )  # fmt: skip


@torch.no_grad()
def fuse_decoder_layers(model: nn.Module) -> int:
    """Reroutes every Llama-style decoder layer of a CPU bf16/fp16/fp32 ``model`` whose projections
    and norms are already fused; returns how many."""
    if not fused_layer_ops_available():
        return 0
    config = model.config.get_text_config()
    count = 0
    for layer in model.modules():
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or mlp is None or "forward" in layer.__dict__:
            continue
        if not _has_llama_code(type(layer), type(attention), type(mlp)):
            continue
        qkv = _group(getattr(attention, "q_proj", nn.Identity()), 3)
        gate_up = _group(getattr(mlp, "gate_proj", nn.Identity()), 2)
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        if (
            qkv is None
            or gate_up is None
            or not all(isinstance(n, nn.Module) and isinstance(n.__dict__.get("forward"), FusedRMSNorm) for n in norms)
            or not _is_silu(getattr(mlp, "act_fn", None))
            or qkv.weight.device.type != "cpu"
            or qkv.weight.dtype not in FUSED_DTYPES
            or qkv.bounds[0][1] != config.num_attention_heads * attention.head_dim
            or not _no_hooks(layer, attention, mlp, *norms, attention.o_proj, mlp.down_proj)  # type: ignore[arg-type]
        ):
            continue
        layer.forward = FusedDecoderLayer(layer, qkv, gate_up, config.num_attention_heads)  # type: ignore[method-assign]
        count += 1
    return count


class DecodeLayers:
    """A model's fused layers, in order, run as one op (``decode_layers``) on a decode step where
    every layer's one op applies: the same decode_layer per layer, looped in C++ instead of Python.
    The sizes and constants it passes once are checked, at build, to be every layer's."""

    def __init__(self, layers: list[FusedDecoderLayer]) -> None:
        self.layers = layers
        # What stays put, gathered once: per projection (q/k/v, o, gate/up, down) its PackedLinears and
        # fp32 biases, and the norms' weights. The laid-out weights are read per step (bench.step_ab
        # swaps them in place).
        self.columns: list[list[PackedLinear]] = [
            list(c) for c in zip(*(layer.packed for layer in layers), strict=True)
        ]
        self.biases = [[p.bias32 for p in column] for column in self.columns]
        self.out_features = [column[0].out_features for column in self.columns]
        self.in_weights = [layer.in_weight for layer in layers]
        self.post_weights = [layer.post_weight for layer in layers]
        # Per layer, its four projection groups as LoRA names them (module, columns lo:hi): a step with
        # adapter rows passes their weights tables, every layer's stacked (LoraStep.stacked_tables).
        self.lora_groups = [
            [layer.lora_qkv, [(layer.lora_o, 0, o_out)], layer.lora_gate_up, [(layer.lora_down, 0, down_out)]]
            for layer, o_out, down_out in (
                (layer, layer.packed[1].out_features, layer.packed[3].out_features) for layer in layers
            )
        ]
        self.enabled = True  # bench.step_ab turns it off in place to measure what it saves

    @classmethod
    def build(cls, layers: list[FusedDecoderLayer]) -> DecodeLayers | None:
        if not layers or not all(len(layer.packed) == 4 for layer in layers):
            return None

        def constants(layer: FusedDecoderLayer) -> tuple[Any, ...]:
            sizes = tuple(p.out_features for p in layer.packed)
            return (layer.in_eps, layer.post_eps, layer.scale, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                    sizes)  # fmt: skip

        if len({constants(layer) for layer in layers}) != 1:
            return None
        return cls(layers)

    def __call__(self, meta: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """The last layer's output, or None where any layer's one op does not apply (the caller then
        runs the layers one by one)."""
        first = self.layers[0]
        lora: dict[str, Any] = {}
        if meta.lora is not None:  # a step with adapter rows: their deltas after each group's matmul, in C++ too
            stacked = meta.lora.stacked_tables(self.lora_groups) if meta.lora.kernel_applies(hidden) else None
            if stacked is None:
                return None
            if stacked is not False:  # False: no adapter of the step targets any of these projections
                tables, (qkv_bounds, gate_up_bounds), dtype = stacked
                lora = dict(zip(("lora_qkv", "lora_o", "lora_gate_up", "lora_down"), tables, strict=True))
                lora.update(lora_slots=meta.lora.slots, lora_qkv_bounds=qkv_bounds,
                            lora_gate_up_bounds=gate_up_bounds, lora_dtype=dtype)  # fmt: skip
        if not self.enabled or not first._one_op_applies(meta, lora_ok=True):  # the step's, and layer 0's
            return None
        layers = self.layers
        if not all(layer.one_op for layer in layers):
            return None
        # Each layer's layouts as its PackedLinears route a call of these rows (read per step:
        # bench.step_ab swaps layouts in place), then per projection across the layers.
        per_layer = [layer._one_op_weights(hidden) for layer in layers]
        if any(w is None for w in per_layer):
            return None
        weights = [list(column) for column in zip(*per_layer, strict=True)]  # type: ignore[misc]
        caches = [meta.kv_caches[layer.layer_idx] for layer in layers]
        qkv, o, gate_up, down = self.out_features
        return torch.ops.inflightq.decode_layers(
            hidden, self.in_weights, first.in_eps,
            weights[0], self.biases[0], qkv,
            cos, sin, first.num_heads, first.num_kv_heads, first.head_dim,
            [k for k, _ in caches], [v for _, v in caches], meta.slot_mapping,
            meta.decode_blocks.view(meta.num_decodes, -1), meta.decode_context_lens, meta.block_size, first.scale,
            weights[1], self.biases[1], o,
            self.post_weights, first.post_eps,
            weights[2], self.biases[2], gate_up,
            weights[3], self.biases[3], down,
            **lora,
        )  # fmt: skip
