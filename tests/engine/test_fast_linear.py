"""Prepacked linears compute what nn.Linear computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.engine.model.fast_linear import prepack_linears, prepack_supported
from worker.engine.model.model_loader import load_model


@pytest.mark.skipif(
    not prepack_supported(torch.device("cpu"), torch.bfloat16), reason="hardware: no oneDNN bf16 on this CPU"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepacked_model_gives_the_same_logits(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    plain, _ = load_model(str(tiny_model_dir), dtype, "cpu")
    packed, _ = load_model(str(tiny_model_dir), dtype, "cpu")
    assert prepack_linears(packed) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    ids = torch.randint(3, 40_000, (1, 37))
    with torch.no_grad():
        expected = plain(ids).logits.float()
        got = packed(ids).logits.float()
    tolerance = 0.05 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(got, expected, atol=tolerance * expected.abs().max().item())
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def onednn_bf16_matmul_available() -> bool:
    """oneDNN's bf16 matmul needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; an AVX2-only CPU has neither."""
    from worker.engine.model.fast_linear import pack_weight

    try:
        pack_weight(torch.zeros(8, 8, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.float32), reason="hardware: no oneDNN on this CPU")
@pytest.mark.parametrize("upcast", [True, False])
def test_bf16_linear_keeps_bf16_in_and_out_whichever_matmul_runs(upcast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine.model import fast_linear

    if not upcast and not onednn_bf16_matmul_available():
        pytest.skip("hardware: this CPU has no oneDNN bf16 matmul (the engine upcasts here, the upcast=True case)")

    # upcast=False on a CPU without bf16 units runs oneDNN's emulated bf16 matmul: slow, still right.
    monkeypatch.setattr(fast_linear, "upcast_bf16_matmuls", lambda: upcast)
    linear = torch.nn.Linear(96, 40, dtype=torch.bfloat16)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert prepack_linears(linear) == 1
    assert linear.forward.upcast is upcast  # type: ignore[attr-defined]
    with torch.no_grad():
        got = linear(x)
    assert got.dtype == torch.bfloat16
    # Products of bf16 values are exact in fp32; both paths accumulate in fp32 and round once.
    assert torch.allclose(got.float(), expected, atol=1e-2, rtol=1e-2)


def mkl_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@pytest.mark.slow
@pytest.mark.skipif(not mkl_available(), reason="this torch has no MKL")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), [(192, 576), (1536, 576), (576, 1536), (37, 40)])
def test_an_fp32_weight_packed_for_mkl_serves_every_row_count(out_features: int, in_features: int, bias: bool) -> None:
    # One packing (made for MKL_PACK_ROWS rows) is used at whatever rows a step brings: decode
    # steps of 1..64 streams, a prefill chunk's hundreds. A packing that only held for its own row
    # count would break here, at every count but 32.
    from worker.engine.model.fast_linear import PackedLinear

    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features) * 0.05
    b = torch.randn(out_features) if bias else None
    linear = PackedLinear(weight, b, mkl=True)
    assert linear.mkl and linear.packed.is_mkldnn
    for rows in [*range(0, 66), 129, 513]:
        x = torch.randn(rows, in_features)
        expected = torch.nn.functional.linear(x.double(), weight.double(), b.double() if b is not None else None)
        got = linear(x)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5 * in_features**0.5), rows
    # Leading dimensions are kept ([batch, seq, hidden], as a prefill's forward passes them).
    x = torch.randn(2, 3, in_features)
    assert linear(x).shape == (2, 3, out_features)
    assert torch.allclose(linear(x), torch.nn.functional.linear(x, weight, b), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not mkl_available(), reason="this torch has no MKL")
def test_fp32_matmuls_go_to_mkl_only_on_intel_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine.model import fast_linear

    weight = torch.randn(64, 32)
    for vendor, expected in (("GenuineIntel", True), ("AuthenticAMD", False), ("", False)):
        monkeypatch.setattr(fast_linear, "cpu_vendor", lambda vendor=vendor: vendor)
        assert fast_linear.mkl_fp32_matmuls() is expected
        assert fast_linear.PackedLinear(weight, None).mkl is expected
        # bf16 weights never take it: they have their own kernels (decode_linear, oneDNN's AMX/BF16).
        assert fast_linear.PackedLinear(weight.bfloat16(), None).mkl is False
        # Nor does a vocabulary-wide head, slower on MKL past 32 rows.
        head = torch.randn(fast_linear.MKL_MAX_OUT_FEATURES + 1, 32)
        assert fast_linear.PackedLinear(head, None).mkl is False
