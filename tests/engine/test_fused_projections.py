"""Fusing sibling projections (q/k/v, gate/up) into one matmul changes no result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.engine.model.fast_linear import prepack_linears, prepack_supported
from worker.engine.model.fused_projections import fuse_sibling_projections
from worker.engine.model.model_loader import load_model


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


def test_fused_model_gives_the_same_logits_in_float64(tiny_model_dir: Path) -> None:
    plain, _ = load_model(str(tiny_model_dir), torch.float64, "cpu")
    fused, _ = load_model(str(tiny_model_dir), torch.float64, "cpu")
    layers = fused.config.num_hidden_layers
    assert fuse_sibling_projections(fused, pack=False) == 2 * layers  # q/k/v and gate/up per layer
    assert fuse_sibling_projections(fused, pack=False) == 0  # a second pass leaves rerouted layers alone
    ids = torch.randint(3, 40_000, (1, 29))
    assert torch.allclose(logits(fused, ids), logits(plain, ids), atol=1e-12, rtol=0)


def test_unpacked_fusion_costs_no_memory(tiny_model_dir: Path) -> None:
    model, _ = load_model(str(tiny_model_dir), torch.float64, "cpu")
    fuse_sibling_projections(model, pack=False)
    attn = model.model.layers[0].self_attn
    storages = {m.weight.untyped_storage().data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert len(storages) == 1  # all three weights are views into the fused one


def test_a_sibling_fed_another_input_still_gets_its_own_projection(tiny_model_dir: Path) -> None:
    model, _ = load_model(str(tiny_model_dir), torch.float64, "cpu")
    attn = model.model.layers[0].self_attn
    weights = [m.weight.detach().clone() for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    fuse_sibling_projections(model, pack=False)
    x, y = torch.randn(2, 3, weights[0].shape[1], dtype=torch.float64).unbind(0)
    with torch.inference_mode():
        q = attn.q_proj(x)
        k = attn.k_proj(y)  # not the input q_proj saw
        v = attn.v_proj(x)
        v_again = attn.v_proj(x)  # called twice with the same input
    assert torch.allclose(q, F.linear(x, weights[0]))
    assert torch.allclose(k, F.linear(y, weights[1]))
    assert torch.allclose(v, F.linear(x, weights[2]))
    assert torch.allclose(v_again, F.linear(x, weights[2]))


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_packed_fusion_matches_the_plain_model_in_float32(tiny_model_dir: Path) -> None:
    plain, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    fused, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    layers = fused.config.num_hidden_layers
    assert fuse_sibling_projections(fused, pack=True) == 2 * layers
    assert prepack_linears(fused) == 2 * layers + 1  # only o_proj, down_proj per layer and lm_head were left
    ids = torch.randint(3, 40_000, (1, 37))
    expected, got = logits(plain, ids), logits(fused, ids)
    assert torch.allclose(got, expected, atol=1e-4 * expected.abs().max().item())
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
