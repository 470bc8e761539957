"""The small-row bf16 linear (``decode_linear.cpp``) computes what a bf16 matmul computes: exact
products summed in fp32, the bias added, one rounding to bf16. So each output is the exact
result rounded once, give or take an ulp where the fp32 sum lands next to a rounding boundary;
``PackedLinear`` sends only calls of up to ``decode_rows`` rows to it and keeps oneDNN for the rest.
The kernel this machine builds is the one tested: AVX512-BF16's dot product, AVX-512F's or AVX2's
widening FMAs or the plain loop, by the CPU's flags."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.ci_skips import missing
from worker.engine.core.memory import HUGE_PAGE_BYTES
from worker.engine.model.fast_linear import (
    DECODE_ROWS_NATIVE_BF16,
    DECODE_ROWS_UPCAST,
    KERNEL_MAX_ROWS,
    PackedLinear,
    decode_copy_fits,
    decode_layouts_in_order,
    decode_rows_for,
    prepack_linears,
    prepack_supported,
)
from worker.engine.model.hardware import cpu_has_fast_bf16, cpu_widens_bf16
from worker.engine.model.kernels.cpu_kernel import paged_decode_available
from worker.engine.model.model_loader import load_model


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the engine keeps oneDNN's matmul without one)", "apt-get install g++"))
    assert paged_decode_available(), "the CPU kernels failed to build although a compiler is present"


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.pow(2.0, exponent - 7)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 64), (576, 576), (96, 1536)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_each_output_is_the_exact_result_rounded_once(
    rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(1, rows, in_features, generator=gen).to(torch.bfloat16)

    laid_out = torch.ops.inflightq.decode_linear_layout(weight)
    got = torch.ops.inflightq.decode_linear(x, laid_out, bias.float() if bias is not None else None, out_features)

    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, out_features)
    assert_exact_rounded_once(got, x, weight, bias)


def assert_exact_rounded_once(
    got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """``got`` is x @ weight.T + bias computed exactly and rounded once to bf16: within an ulp of the
    result, plus what summing in fp32 may lose where the terms cancel (an output far smaller than its
    terms): a few fp32 ulps of the sum of their magnitudes; and equal to it almost everywhere."""
    exact = x.double() @ weight.double().T + (bias.double() if bias is not None else 0.0)
    magnitudes = x.double().abs() @ weight.double().abs().T + (bias.double().abs() if bias is not None else 0.0)
    assert ((got.double() - exact).abs() <= bf16_ulp(exact) + 2.0**-20 * magnitudes).all()
    assert (got == exact.to(torch.bfloat16)).float().mean() >= 0.99


def test_calls_it_cannot_take_are_refused() -> None:
    laid_out = torch.ops.inflightq.decode_linear_layout(torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=f"0 to {KERNEL_MAX_ROWS} rows"):
        torch.ops.inflightq.decode_linear(torch.zeros(KERNEL_MAX_ROWS + 1, 64, dtype=torch.bfloat16), laid_out, None, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.inflightq.decode_linear_layout(torch.zeros(8, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.inflightq.decode_linear(torch.zeros(1, 64, dtype=torch.bfloat16), laid_out, None, 9)


def ops_run(fn: object, *args: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    with torch.profiler.profile() as prof:
        out = fn(*args)  # type: ignore[operator]
    return out, {event.key for event in prof.key_averages()}


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_packed_linear_sends_only_small_calls_to_the_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(40, 96, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)
    decode_rows = 6
    linear = PackedLinear(weight, bias, decode_rows=decode_rows)
    for rows, kernel in ((0, True), (1, True), (decode_rows, True), (decode_rows + 1, False), (37, False)):
        x = torch.randn(1, rows, 96, generator=gen).to(torch.bfloat16)
        got, ops = ops_run(linear, x)
        assert ("inflightq::decode_linear" in ops) is kernel, (rows, ops)
        expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 40)
        assert torch.allclose(got.float(), expected, atol=1e-2, rtol=1e-2)
    # Without the setting (the engine's choice on CPUs without AVX2) nothing goes to it.
    _, ops = ops_run(PackedLinear(weight, bias), torch.randn(1, 1, 96, generator=gen).to(torch.bfloat16))
    assert "inflightq::decode_linear" not in ops


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_a_model_on_the_kernel_gives_the_same_decode_logits(tiny_model_dir: Path) -> None:
    plain, _ = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    fast, _ = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    assert prepack_linears(fast, decode_rows=4) == 2 * 7 + 1
    for length in (1, 3):  # decode-sized calls: every linear goes through the kernel
        ids = torch.randint(3, 40_000, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = plain(ids).logits.float()
            got, ops = ops_run(fast, ids)
        assert "inflightq::decode_linear" in ops
        got = got.logits.float()
        assert torch.allclose(got, expected, atol=0.05 * expected.abs().max().item())
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() == 1.0


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_the_second_copy_is_taken_only_where_it_fits(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine import EngineConfig, LLMEngine
    from worker.engine.model import model_runner

    model, tokenizer = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    weights = sum(m.weight.numel() * 2 for m in model.modules() if type(m) is torch.nn.Linear)
    assert decode_copy_fits(model, 10 * weights) and not decode_copy_fits(model, 9 * weights)

    def laid_out(engine: LLMEngine) -> int:
        packed = [m.__dict__.get("forward") for m in engine.runner.model.modules()]
        return sum(isinstance(p, PackedLinear) and p.laid_out is not None for p in packed)

    monkeypatch.setattr(model_runner, "decode_rows_for", lambda dtype: 4)  # as on an AVX512-BF16 CPU
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: 9 * weights)
    assert laid_out(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))) == 0
    model, tokenizer = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: 10 * weights)
    assert laid_out(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))) > 0


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_a_bf16_engine_on_the_kernel_serves_prompts_longer_than_a_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill: a step whose only chunk ends mid-prompt samples nothing, so the head is
    called with zero rows; the kernel returns an empty result instead of failing the step."""
    from tests.engine.test_engine_exactness import random_prompts
    from worker.engine import LLM, EngineConfig, LLMEngine, SamplingParams
    from worker.engine.model import model_runner

    monkeypatch.setattr(model_runner, "decode_rows_for", lambda dtype: 4)  # as on an AVX512-BF16 CPU
    outputs = []
    for kernel in (True, False):
        monkeypatch.setattr(model_runner, "decode_copy_fits", lambda model, available, copies=1, kernel=kernel: kernel)
        model, tokenizer = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
        engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=128, block_size=4, max_num_batched_tokens=8))
        llm = LLM.__new__(LLM)
        llm.engine, llm._next_id = engine, 0
        prompts = random_prompts(3, seed=5, low=20, high=40)  # each longer than a step's 8 tokens
        with torch.profiler.profile() as prof:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=6))
        ran = {event.key for event in prof.key_averages()}
        assert ("inflightq::decode_linear" in ran) is kernel
        assert all(len(out.token_ids) == 6 for out in outs)
        outputs.append([out.token_ids for out in outs])
    assert outputs[0] == outputs[1]  # bf16 sums in another order, the same greedy tokens here


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_an_engine_keeps_its_decode_layouts_back_to_back_in_the_forward_order(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.engine import EngineConfig, LLMEngine
    from worker.engine.model import fast_linear, model_runner
    from worker.engine.model.fused_projections import fuse_sibling_projections

    monkeypatch.setattr(model_runner, "decode_rows_for", lambda dtype: 4)  # as on an AVX512-BF16 CPU
    monkeypatch.setattr(model_runner, "decode_copy_fits", lambda model, available, copies=1: True)
    reference, _ = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    fuse_sibling_projections(reference, decode_rows=4)
    prepack_linears(reference, decode_rows=4)
    expected = [linear.laid_out.clone() for linear in decode_layouts_in_order(reference)]  # type: ignore[union-attr]

    model, tokenizer = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    linears = decode_layouts_in_order(model)
    layer = model.model.layers[0]
    # Each layer's q/k/v, o, gate/up, down, then the head: the order a decode step reads them.
    assert len(linears) == 4 * len(model.model.layers) + 1
    assert linears[0] is layer.self_attn.q_proj.forward.group.packed and linears[1] is layer.self_attn.o_proj.forward
    assert linears[2] is layer.mlp.gate_proj.forward.group.packed and linears[3] is layer.mlp.down_proj.forward
    assert linears[-1] is model.lm_head.forward
    layouts = [linear.laid_out for linear in linears]
    storage = layouts[0].untyped_storage().data_ptr()  # type: ignore[union-attr]
    offset = layouts[0].storage_offset()  # type: ignore[union-attr]
    assert layouts[0].data_ptr() % HUGE_PAGE_BYTES == 0  # type: ignore[union-attr]  # memory that can take 2 MB pages
    for layout, before in zip(layouts, expected, strict=True):
        assert layout is not None and layout.untyped_storage().data_ptr() == storage
        assert layout.storage_offset() == offset and layout.is_contiguous()
        assert torch.equal(layout, before)  # the same values: the kernel's results cannot change
        offset += layout.numel()
    assert fast_linear.gather_decode_layouts(torch.nn.Linear(4, 4)) == 0  # nothing laid out: nothing moved


def test_the_kernel_takes_the_rows_it_beats_onednn_at_on_this_cpu() -> None:
    """Measured: against native bf16 (AVX512-BF16) up to 4 rows; against the fp32 upcast that a
    CPU with AVX-512 or AVX2 but no bf16 unit runs, up to 16; never in fp32 or without them."""
    expected = DECODE_ROWS_NATIVE_BF16 if cpu_has_fast_bf16() else DECODE_ROWS_UPCAST if cpu_widens_bf16() else 0
    assert decode_rows_for(torch.bfloat16) == expected
    assert decode_rows_for(torch.float32) == 0 and decode_rows_for(torch.float64) == 0
