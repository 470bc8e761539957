"""Prepacked linears compute what nn.Linear computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.engine.fast_linear import prepack_linears, prepack_supported
from worker.engine.model_loader import load_model


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 on this CPU")
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
