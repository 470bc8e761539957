"""The bf16 linear on AMX tiles (``amx_linear.cpp``) computes what a bf16 matmul computes: exact
products summed in fp32, the bias added, one rounding to bf16. ``PackedLinear`` sends it the calls
of more rows than ``decode_linear`` takes, up to ``tile_rows``, and keeps oneDNN for the rest.
On a CPU with AMX the tiles are what is tested; elsewhere the op's plain loop over the same layout
(the engine does not route to it there)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.ci_skips import missing
from tests.engine.test_decode_linear import assert_exact_rounded_once, ops_run
from worker.engine.model.fast_linear import (
    TILE_ROWS,
    PackedLinear,
    packed_linears_in_order,
    prepack_linears,
    prepack_supported,
    tile_rows_for,
)
from worker.engine.model.hardware import cpu_flags
from worker.engine.model.kernels.cpu_kernel import paged_decode_available
from worker.engine.model.model_loader import load_model

MAX_ROWS = 64  # the op's own limit (the engine routes up to TILE_ROWS)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the engine keeps oneDNN's matmul without one)", "apt-get install g++"))
    assert paged_decode_available(), "the CPU kernels failed to build although a compiler is present"


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 31, 32, 33, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 64), (576, 576), (200, 1536)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_each_output_is_the_exact_result_rounded_once(
    rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(1, rows, in_features, generator=gen).to(torch.bfloat16)

    tiles = torch.ops.inflightq.amx_linear_layout(weight)
    got = torch.ops.inflightq.amx_linear(x, tiles, bias.float() if bias is not None else None, out_features)

    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, out_features)
    assert_exact_rounded_once(got, x, weight, bias)


def test_calls_it_cannot_take_are_refused() -> None:
    tiles = torch.ops.inflightq.amx_linear_layout(torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=f"0 to {MAX_ROWS} rows"):
        torch.ops.inflightq.amx_linear(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), tiles, None, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.inflightq.amx_linear_layout(torch.zeros(8, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.inflightq.amx_linear(torch.zeros(1, 64, dtype=torch.bfloat16), tiles, None, 65)
    empty = torch.ops.inflightq.amx_linear(torch.zeros(0, 64, dtype=torch.bfloat16), tiles, None, 8)
    assert empty.shape == (0, 8)


def test_the_engine_takes_the_tiles_exactly_where_the_cpu_and_the_os_give_them() -> None:
    amx = {"amx_tile", "amx_bf16"} <= cpu_flags()
    assert torch.ops.inflightq.amx_linear_supported() is amx  # Linux grants the tiles' state when asked
    assert tile_rows_for(torch.bfloat16) == (TILE_ROWS if amx else 0)
    assert tile_rows_for(torch.float32) == 0 and tile_rows_for(torch.float64) == 0


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_packed_linear_sends_each_row_count_to_its_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(70, 96, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(70, generator=gen).to(torch.bfloat16)
    linear = PackedLinear(weight, bias, decode_rows=4, tile_rows=TILE_ROWS)
    cases = (
        (1, "decode_linear"),
        (4, "decode_linear"),
        (5, "amx_linear"),
        (TILE_ROWS, "amx_linear"),
        (TILE_ROWS + 1, None),
    )
    for rows, kernel in cases:
        x = torch.randn(1, rows, 96, generator=gen).to(torch.bfloat16)
        got, ops = ops_run(linear, x)
        used = {name for name in ("decode_linear", "amx_linear") if f"inflightq::{name}" in ops}
        assert used == ({kernel} if kernel else set()), (rows, ops)
        expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 70)
        assert torch.allclose(got.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_a_model_on_the_tiles_gives_the_same_logits(tiny_model_dir: Path) -> None:
    plain, _ = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    fast, _ = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    assert prepack_linears(fast, tile_rows=TILE_ROWS) == 2 * 7 + 1
    assert all(linear.tiles is not None for linear in packed_linears_in_order(fast))
    for length in (5, TILE_ROWS):  # a few streams' decode step, a speculating one's rows
        ids = torch.randint(3, 40_000, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = plain(ids).logits.float()
            got, ops = ops_run(fast, ids)
        assert "inflightq::amx_linear" in ops
        got = got.logits.float()
        assert torch.allclose(got, expected, atol=0.05 * expected.abs().max().item())
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.95


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
def test_an_engine_lays_out_the_tiles_only_where_a_third_copy_fits(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.engine import EngineConfig, LLMEngine
    from worker.engine.model import model_runner

    model, tokenizer = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
    weights = sum(m.weight.numel() * 2 for m in model.modules() if type(m) is torch.nn.Linear)

    def kernels_laid_out(engine: LLMEngine) -> tuple[bool, bool]:
        linears = packed_linears_in_order(engine.runner.model)
        return any(p.laid_out is not None for p in linears), any(p.tiles is not None for p in linears)

    monkeypatch.setattr(model_runner, "decode_rows_for", lambda dtype: 4)  # as on an AVX512-BF16 CPU
    monkeypatch.setattr(model_runner, "tile_rows_for", lambda dtype: TILE_ROWS)  # and one with AMX
    for free, expected in ((20 * weights, (True, True)), (19 * weights, (True, False)), (9 * weights, (False, False))):
        monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device, free=free: free)
        model, tokenizer = load_model(str(tiny_model_dir), torch.bfloat16, "cpu")
        assert kernels_laid_out(LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))) == expected, free
