"""A decode step's forward without transformers' model code: embed, rotary, the fused layers, norm, head.

At one stream a decode step of a small model is a stream of its weights plus everything around
it, and transformers' ``LlamaForCausalLM`` / ``LlamaModel`` forwards add time of their own per
step: output-capturing decorators, the causal mask (which the engine's attention never reads),
kwargs through every layer's ``nn.Module`` calls with their hook checks, output dataclasses (see
docs/benchmarks.md, ``bench.step_ab``'s ``no decode forward`` variant). This calls the same
modules' rerouted forwards in the same order on the same tensors (so the values are
transformers' bit for bit), from one Python loop.

Taken only where it cannot differ: the model's, its body's and its rotary embedding's code is
Llama's own (source compared, as ``fused_decoder_layer`` does for layers), every layer is a
``FusedDecoderLayer``, no module involved has hooks, and the step is decode-only. A step that
fails the test (prefills, a layer put back by ``bench.step_ab``) runs transformers' forward.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from worker.engine.model.fused_decoder_layer import DecodeLayers, FusedDecoderLayer


@functools.cache
def _llama_sources() -> tuple[str, str, str]:
    from transformers.models.llama import modeling_llama as llama

    return (
        inspect.getsource(llama.LlamaForCausalLM.forward),
        inspect.getsource(llama.LlamaModel.forward),
        inspect.getsource(llama.LlamaRotaryEmbedding.forward),
    )


def _has_llama_code(model: nn.Module, body: nn.Module, rotary: nn.Module) -> bool:
    try:
        sources = tuple(inspect.getsource(type(m).forward) for m in (model, body, rotary))
    except (OSError, TypeError):  # no source: don't guess
        return False
    return sources == _llama_sources()


class DecodeForward:
    """Logits of a decode-only step through the model's rerouted pieces (``build`` checks they apply)."""

    def __init__(self, model: nn.Module, layers: list[tuple[nn.Module, FusedDecoderLayer]]) -> None:
        body: Any = model.model
        self.embed: nn.Module = body.embed_tokens
        self.rotary: nn.Module = body.rotary_emb
        self.norm: nn.Module = body.norm
        self.head: nn.Module = model.get_output_embeddings()
        self.layers = layers
        # All the layers as one op where every layer's one op applies (bf16 on decode_linear, few rows).
        self.all_layers = DecodeLayers.build([forward for _, forward in layers])
        self.enabled = True  # bench.step_ab turns it off in place to measure what it saves

    @classmethod
    def build(cls, model: nn.Module) -> DecodeForward | None:
        body = getattr(model, "model", None)
        parts = [getattr(body, name, None) for name in ("embed_tokens", "rotary_emb", "norm", "layers")]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if body is None or head is None or not all(isinstance(p, nn.Module) for p in parts):
            return None
        embed, rotary, norm, layer_list = parts
        if not _has_llama_code(model, body, rotary) or type(embed) is not nn.Embedding:
            return None
        if len(layer_list) != model.config.get_text_config().num_hidden_layers:
            return None
        layers = [(layer, layer.__dict__.get("forward")) for layer in layer_list]
        if not all(isinstance(forward, FusedDecoderLayer) for _, forward in layers):
            return None
        modules = [model, body, embed, rotary, norm, head, *layer_list]
        if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
            return None
        return cls(model, layers)  # type: ignore[arg-type]

    def __call__(
        self, meta: Any, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor | None:
        """Logits [len(keep), V], or None where the step must take transformers' forward."""
        if not self.enabled or meta.prefills or not all(m.__dict__.get("forward") is f for m, f in self.layers):
            return None
        hidden = self.embed(input_ids.unsqueeze(0))
        cos, sin = self.rotary(hidden, positions.unsqueeze(0))
        out = self.all_layers(meta, hidden, cos, sin) if self.all_layers is not None else None
        if out is not None:
            hidden = out
        else:
            for _, layer in self.layers:
                hidden = layer.step(meta, hidden, cos, sin)  # what its __call__ runs, without the kwargs
        # The norm is per row: norming the kept rows only gives the values transformers' norm-then-slice does.
        return self.head(self.norm(hidden[:, keep]))[0]
