"""The fused RMSNorm computes what transformers' Llama norm module computes, with the same rounding
steps. The row's mean of squares is summed in another order, which moves the fp32 scale by an ulp
now and then: in bf16/fp16 that almost never survives the rounding (every value within one ulp,
>= 99.9% bit for bit), in fp32 every value stays within a few ulps (two roundings follow);
only norms with the Llama formula are rerouted, and float64 models keep the module."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.ci_skips import missing
from worker.engine.model.fused_norms import fuse_rms_norms
from worker.engine.model.kernels.cpu_kernel import paged_decode_available
from worker.engine.model.model_loader import load_model


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the engine keeps the module's norm without one)", "apt-get install g++"))
    assert paged_decode_available(), "the CPU kernels failed to build although a compiler is present"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_norm_matches_the_module(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    module = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    module.weight.data = torch.randn(576, generator=gen).to(dtype)
    x = (torch.randn(1, rows, 576, generator=gen) * 4).to(dtype)
    expected = module(x)
    got = torch.ops.inflightq.rms_norm(x, module.weight, 1e-5)
    assert got.dtype == dtype and got.shape == expected.shape
    ulps = 4 if dtype == torch.float32 else 1
    bound = ulps * torch.finfo(dtype).eps * expected.float().abs() + torch.finfo(dtype).tiny
    assert ((got.float() - expected.float()).abs() <= bound).all()
    assert (got == expected).float().mean() > (0.8 if dtype == torch.float32 else 0.999)


def test_only_llama_style_norms_of_non_float64_models_are_rerouted(tiny_model_dir: Path) -> None:
    gemma = GemmaRMSNorm(64)
    assert fuse_rms_norms(gemma) == 0  # another formula (1 + weight): kept
    f64, _ = load_model(str(tiny_model_dir), torch.float64, "cpu")
    assert fuse_rms_norms(f64) == 0  # the exactness tests' dtype: kept
    model, _ = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    layers = model.config.num_hidden_layers
    assert fuse_rms_norms(model) == 2 * layers + 1  # two per layer and the final norm
    assert fuse_rms_norms(model) == 0  # already rerouted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_model_with_fused_norms_gives_the_same_logits(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    plain, _ = load_model(str(tiny_model_dir), dtype, "cpu")
    fused, _ = load_model(str(tiny_model_dir), dtype, "cpu")
    fuse_rms_norms(fused)
    ids = torch.randint(3, 40_000, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = plain(ids).logits
        got = fused(ids).logits
    tolerance = 0.05 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(got.float(), expected.float(), atol=tolerance * expected.abs().max().item())
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
