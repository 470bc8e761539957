"""The greedy pick is torch.argmax's pick exactly: the first index of the largest value, the first NaN
where a row has one, on fp32 and bf16 logits, strided rows, rows shorter than a vector and with a tail."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.ci_skips import missing
from worker.engine.model.kernels.cpu_kernel import paged_decode_available
from worker.engine.sampling.sampler import greedy_pick


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the sampler keeps torch's argmax without one)", "apt-get install g++"))
    assert paged_decode_available(), "the CPU kernels failed to build although a compiler is present"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 49152), (32, 49152), (3, 17), (2, 5), (4, 16), (5, 33), (9, 1)])
def test_greedy_argmax_is_torchs_argmax(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    op = torch.ops.inflightq.greedy_argmax
    for trial in range(40):
        x = torch.randint(-3, 4, (rows, width), generator=gen).float()  # few values: many ties
        if trial % 4 == 0:
            x[trial % rows, (trial * 7) % width] = float("nan")
            x[trial % rows, (trial * 11) % width] = float("nan")
        if trial % 5 == 0:
            x[(trial + 1) % rows] = -float("inf")
        if trial % 7 == 0:
            x[trial % rows] = -0.0
            x[trial % rows, (trial * 3) % width] = 0.0  # equal to -0.0: the first of them wins
        if trial % 9 == 0:
            x = torch.randn(rows, width, generator=gen) * 1e3
        x = x.to(dtype)
        assert torch.equal(op(x), x.float().argmax(-1)), trial
        wide = torch.cat([x, torch.full((rows, 7), 9.0, dtype=dtype)], -1)[:, :width]  # rows with a stride
        assert torch.equal(op(wide), x.float().argmax(-1)), trial


def test_the_sampler_picks_with_the_kernel_and_falls_back_to_torch() -> None:
    logits = torch.randn(4, 1000).bfloat16()
    with torch.profiler.profile() as prof:
        picks = greedy_pick(logits)
    assert torch.equal(picks, logits.float().argmax(-1))
    assert "inflightq::greedy_argmax" in {e.key for e in prof.key_averages()}
    doubles = torch.randn(3, 50, dtype=torch.float64)  # exactness runs in fp64: torch's argmax
    assert torch.equal(greedy_pick(doubles), doubles.argmax(-1))
    with pytest.raises(RuntimeError, match="greedy_argmax"):
        torch.ops.inflightq.greedy_argmax(torch.zeros(2, 0))
