"""The fused decoder layer computes what transformers' Llama layer computes, with its rounding steps,
bit for bit: the rotary split, the residual add and SiLU (whose exp is the one torch's vectorized
SiLU calls); an fp32 engine on it gives ``generate``'s greedy tokens, ragged batches and chunked
prefills included; only Llama-code layers with fused projections and norms are rerouted."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.ci_skips import missing
from tests.engine.conftest import reference, tiny_llm
from tests.engine.test_engine_exactness import random_prompts
from worker.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from worker.engine.model.fused_decoder_layer import DecodeLayers, FusedDecoderLayer, fuse_decoder_layers
from worker.engine.model.fused_norms import fuse_rms_norms
from worker.engine.model.fused_projections import fuse_sibling_projections
from worker.engine.model.kernels.cpu_kernel import paged_decode_available
from worker.engine.model.model_loader import load_model

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the engine keeps transformers' layer without one)", "apt-get install g++"))
    assert paged_decode_available(), "the CPU kernels failed to build although a compiler is present"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_rotary_split_is_transformers_rotary_bit_for_bit(dtype: torch.dtype, tokens: int) -> None:
    heads, kv_heads, dim = 9, 3, 64
    gen = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(1, tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
    angles = torch.rand(1, tokens, dim // 2, generator=gen) * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    expected_q, expected_k = apply_rotary_pos_emb(
        q.view(1, tokens, heads, dim).transpose(1, 2), k.view(1, tokens, kv_heads, dim).transpose(1, 2), cos, sin
    )

    got_q, got_k, got_v = torch.ops.inflightq.rotary_split(qkv, cos, sin, heads, kv_heads, dim)

    assert got_q.shape == (tokens, heads, dim) and got_k.shape == got_v.shape == (tokens, kv_heads, dim)
    assert torch.equal(got_q, expected_q[0].transpose(0, 1))
    assert torch.equal(got_k, expected_k[0].transpose(0, 1))
    assert torch.equal(got_v, v.view(tokens, kv_heads, dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [7, 300])  # a decode step's rows (one thread), a prefill's (split between threads)
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual = ((torch.randn(1, rows, 576, generator=gen) * 4).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(dtype)
    normed, total = torch.ops.inflightq.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, torch.ops.inflightq.rms_norm(residual + x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (3, 1536), (33, 1536), (512, 1536), (2, 96), (2, 100), (5, 7)])
def test_silu_mul_is_the_mlp_activation_times_up(dtype: torch.dtype, rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(1, rows, 2 * inter, generator=gen) * 4).to(dtype)
    # Values that round up, overflow or are not numbers, where the vector roundings could part from torch's.
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 90.0, -90.0, 3e38, -3e38])
    n = min(len(specials), inter)
    gate_up[0, 0, :n] = specials[:n].to(dtype)  # in the gate
    gate_up[0, -1, inter : inter + n] = specials[:n].to(dtype)  # in the up half of the last row
    gate, up = gate_up.chunk(2, -1)
    expected = torch.nn.functional.silu(gate.contiguous()) * up
    got = torch.ops.inflightq.silu_mul(gate_up)
    assert got.shape == expected.shape and got.dtype == dtype
    if inter % 32 == 0:  # whole vectors, as models' widths are: torch's values exactly (NaN where torch's is)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    else:  # a row's tail takes libm's exp here, torch's flat loop may take SLEEF's: an ulp apart
        finite = expected.isfinite()
        torch.testing.assert_close(got[~finite], expected[~finite], rtol=0, atol=0, equal_nan=True)
        bound = torch.finfo(dtype).eps * expected[finite].float().abs() + torch.finfo(dtype).tiny
        assert ((got[finite].float() - expected[finite].float()).abs() <= bound).all()


def fused_model(model_dir: Path, dtype: torch.dtype) -> tuple[Any, int]:
    model, _ = load_model(str(model_dir), dtype, "cpu")
    fuse_sibling_projections(model)
    fuse_rms_norms(model)
    return model, fuse_decoder_layers(model)


def test_only_llama_layers_with_fused_parts_are_rerouted(tiny_model_dir: Path) -> None:
    model, count = fused_model(tiny_model_dir, torch.float32)
    assert count == model.config.num_hidden_layers
    assert fuse_decoder_layers(model) == 0  # already rerouted

    f64, count64 = fused_model(tiny_model_dir, torch.float64)
    assert count64 == 0 and fuse_decoder_layers(f64) == 0  # the exactness tests' dtype: norms unfused, layers kept

    unfused, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    assert fuse_decoder_layers(unfused) == 0  # projections and norms not fused: nothing to call

    hooked, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    fuse_sibling_projections(hooked)
    fuse_rms_norms(hooked)
    hooked.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert fuse_decoder_layers(hooked) == hooked.config.num_hidden_layers - 1  # a hook would be skipped


def test_a_call_without_the_engine_metadata_runs_transformers_layer(tiny_model_dir: Path) -> None:
    plain, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    model, count = fused_model(tiny_model_dir, torch.float32)
    assert count
    ids = torch.randint(3, 40_000, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-4)


@pytest.mark.parametrize(("chunk", "backend"), [(None, "cpu"), (7, "cpu"), (7, "torch")])
def test_an_fp32_engine_on_fused_layers_matches_generate(tiny_model_dir: Path, chunk: int | None, backend: str) -> None:
    """Decode-only steps take the kernels' token-major path; steps with prefills the backend's own."""
    model, tokenizer = load_model(str(tiny_model_dir), torch.float32, "cpu")
    ref, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    config = EngineConfig(
        num_kv_blocks=256, block_size=4, max_num_batched_tokens=chunk or 2048, attention_backend=backend
    )
    engine = LLMEngine(model, tokenizer, config)
    assert sum(isinstance(m.__dict__.get("forward"), FusedDecoderLayer) for m in model.modules()) == 2
    llm = LLM.__new__(LLM)
    llm.engine, llm._next_id = engine, 0
    prompts = random_prompts(6, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(ref, prompt, 10)
    assert engine.num_free_blocks == engine.num_total_blocks


def _bf16_engine_on_decode_linear(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tile_rows: int = 0, enable_prefix_caching: bool = True
) -> LLM:
    return tiny_llm(
        tiny_model_dir, torch.bfloat16, monkeypatch, decode_rows=4, tile_rows=tile_rows,
        enable_prefix_caching=enable_prefix_caching,
    )  # fmt: skip


@pytest.mark.parametrize("tile_rows", [0, 8], ids=["decode_linear", "and amx_linear"])
def test_a_decode_step_runs_each_layer_as_one_op_with_the_same_values(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, tile_rows: int
) -> None:
    """Decode steps of up to decode_rows sequences (on decode_linear) or tile_rows (on amx_linear): all
    layers in one decode_layers call, or (with that off) one decode_layer call per layer -- the same
    ops in the same order as the Python forward, so the same logprobs to the last bit. Steps with a
    prefill, or more sequences than the kernels take, keep the Python forward."""
    # No prefix cache: each mode's prefill is then the same matmul of the same rows.
    llm = _bf16_engine_on_decode_linear(tiny_model_dir, monkeypatch, tile_rows, enable_prefix_caching=False)
    layers = [m.__dict__["forward"] for m in llm.engine.runner.model.modules() if "forward" in m.__dict__]
    layers = [f for f in layers if isinstance(f, FusedDecoderLayer)]
    assert len(layers) == 2
    decode_forward = llm.engine.runner.decode_forward
    assert decode_forward is not None and decode_forward.all_layers is not None
    params = SamplingParams(max_new_tokens=8, logprobs=3)
    results = {}
    for mode in ("all layers", "each layer", "ops one by one"):
        decode_forward.all_layers.enabled = mode == "all layers"
        for layer in layers:
            layer.one_op = mode != "ops one by one"
        for batch in (1, 4, 6, 10):
            with torch.profiler.profile() as prof:
                outs = llm.generate(random_prompts(batch, seed=batch), params)
            counts = {e.key: e.count for e in prof.key_averages()}
            calls = (counts.get("inflightq::decode_layers", 0), counts.get("inflightq::decode_layer", 0))
            # 7 decode steps of 2 layers; past 4 sequences the rows go to amx_linear (up to tile_rows)
            fits = batch <= max(4, tile_rows)
            expected = {"all layers": (7, 0) if fits else (0, 0), "each layer": (0, 2 * 7) if fits else (0, 0)}
            assert calls == expected.get(mode, (0, 0)), (mode, batch, calls)
            amx = counts.get("inflightq::amx_linear", 0)
            # 4 matmuls a layer in each decode step, and the head's in each step
            assert amx == ((4 * 2 + 1) * 7 + 1 if 4 < batch <= tile_rows else 0), (mode, batch, amx)
            results[mode, batch] = [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]
    decode_forward.all_layers.enabled = True
    for batch in (1, 4, 6, 10):
        assert results["all layers", batch] == results["ops one by one", batch]
        assert results["each layer", batch] == results["ops one by one", batch]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_a_layer_whose_matmuls_are_not_all_on_decode_linear_keeps_the_python_forward(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _bf16_engine_on_decode_linear(tiny_model_dir, monkeypatch)
    layer = next(
        m.__dict__["forward"]
        for m in llm.engine.runner.model.modules()
        if isinstance(m.__dict__.get("forward"), FusedDecoderLayer)
    )
    layer.packed[1].laid_out = None  # its o_proj back on oneDNN (as bench.step_ab switches it)
    with torch.profiler.profile() as prof:
        outs = llm.generate(random_prompts(1, seed=0), SamplingParams(max_new_tokens=4))
    assert len(outs[0].token_ids) == 4
    # 3 decode steps; not all layers as one op, but the other layer still takes its own
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts["inflightq::decode_layer"] == 3 and "inflightq::decode_layers" not in counts


def test_layers_that_differ_in_a_constant_are_not_run_as_one_op(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_layers takes the eps, scale and sizes once for all layers: layers that differ keep one
    op each."""
    llm = _bf16_engine_on_decode_linear(tiny_model_dir, monkeypatch)
    forwards = [m.__dict__.get("forward") for m in llm.engine.runner.model.modules()]
    layers = [f for f in forwards if isinstance(f, FusedDecoderLayer)]
    assert DecodeLayers.build(layers) is not None
    layers[1].post_eps *= 2
    assert DecodeLayers.build(layers) is None


def _rotate_twice(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1).flip(-1)


def test_the_source_check_sees_through_a_module_wrapping_the_function() -> None:
    """transformers >= 5.25 with the ``kernels`` package wraps ``apply_rotary_pos_emb`` in an
    ``nn.Module`` calling it from a closure; the check reads the wrapped function's source."""
    import inspect
    from types import SimpleNamespace

    from worker.engine.model.fused_decoder_layer import _function_source

    def wrap(func: Any) -> torch.nn.Module:
        class Func(torch.nn.Module):
            def forward(self, *args: Any) -> Any:
                return func(*args)

        return Func()

    source = inspect.getsource(_rotate_twice)
    assert _function_source(SimpleNamespace(_rotate_twice=_rotate_twice), "_rotate_twice") == source
    assert _function_source(SimpleNamespace(_rotate_twice=wrap(_rotate_twice)), "_rotate_twice") == source
    with pytest.raises(TypeError):
        _function_source(SimpleNamespace(_rotate_twice=torch.nn.Identity()), "_rotate_twice")
