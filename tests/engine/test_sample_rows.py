"""The sample_rows kernel draws what the filters leave, as a float64 reference of the same rules draws
it: temperature, top_k (ties with the k-th kept), top_p (a token is kept while the mass of strictly
larger ones is below top_p), min_p (a share of the best), then the first token whose running sum
passes u times the total. On fp32 and bf16 logits, full vocabularies and rows shorter than a vector,
flat and peaked rows; and the edge rows (NaN, infinite logits, strided rows, bad arguments)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.ci_skips import missing
from tests.engine.avx2_build import REPO, run_avx2_check
from worker.engine.model.kernels.cpu_kernel import paged_decode_available


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the sampler keeps its torch path without one)", "apt-get install g++"))
    assert paged_decode_available(), "the CPU kernels failed to build although a compiler is present"


def draw(
    logits: torch.Tensor,
    u: list[float],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    rows: list[int] | None = None,
) -> list[int]:
    """One draw per entry of ``u``, each of row ``rows[i]`` (default: row 0 for every draw)."""
    ids = rows if rows is not None else [0] * len(u)
    settings = [[temperature, top_k, top_p, min_p, ui] for ui in u]
    return torch.ops.inflightq.sample_rows(
        logits, torch.tensor(ids, dtype=torch.long), torch.tensor(settings, dtype=torch.float64)
    ).tolist()


def reference(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> tuple[torch.Tensor, float]:
    """The kept tokens' weights (0 = dropped), in float64 from the fp32 tempered logits, and how close
    any kept/dropped decision came to its threshold (relative): a case closer than float rounding is
    one the test skips, as either answer is right."""
    y = (row.float() / temperature).double()
    y = torch.where(torch.isnan(y), torch.tensor(float("-inf"), dtype=torch.float64), y)
    margin = float("inf")
    if 0 < top_k < len(y):
        kth = y.sort(descending=True).values[top_k - 1]
        y = torch.where(y < kth, torch.tensor(float("-inf"), dtype=torch.float64), y)
    w = torch.exp(y - y.max())
    if top_p < 1.0:
        values = w.unique()  # ascending
        ascending = w.sort().values
        at_most = ascending.cumsum(0)[torch.searchsorted(ascending, values, right=True) - 1]
        larger = w.sum() - at_most  # the mass of the weights strictly larger than each value
        limit = top_p * float(w.sum())
        kept_values = values[larger < limit]
        margin = min(margin, float(((larger - limit).abs() / w.sum()).min()))
        w = torch.where(w >= kept_values.min(), w, torch.zeros_like(w))
    if min_p > 0.0:
        positive = w[w > 0]
        margin = min(margin, float(((positive - min_p).abs()).min()))
        w = torch.where(w >= min_p, w, torch.zeros_like(w))
    return w, margin


def expected_token(w: torch.Tensor, u: float) -> tuple[int, float]:
    """The first token whose running sum passes u * total, and how far u is from the nearest boundary."""
    cdf = w.cumsum(0) / w.sum()
    token = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    return min(token, len(w) - 1), float((cdf - u).abs().min())


CASES = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.5, "top_k": 40},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_p": 0.95},
    {"temperature": 0.8, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "min_p": 0.02},
    {"temperature": 2.0, "top_k": 2000, "top_p": 0.99},
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "scale"), [(49152, 1.0), (49152, 4.0), (49152, 12.0), (37, 2.0), (5, 1.0)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_draws_match_a_float64_reference(dtype: torch.dtype, vocab: int, scale: float, case: dict) -> None:
    params = (case.get("temperature", 1.0), case.get("top_k", 0), case.get("top_p", 1.0), case.get("min_p", 0.0))
    # A row where some filter's decision falls within float rounding of its threshold can go either
    # way; the next seed's row is taken instead (a handful of the 90 rows here need one).
    for seed in range(vocab, vocab + 10):
        gen = torch.Generator().manual_seed(seed + int(scale * 10))
        row = (torch.randn(vocab, generator=gen) * scale).to(dtype)
        w, margin = reference(row, *params)
        if margin >= 1e-6:  # fp32 weights: the kernel is ~1e-7 (relative) off the float64 ones
            break
    else:
        pytest.fail("ten rows in a row had a decision within rounding of its threshold")
    u = [*torch.rand(200, generator=gen, dtype=torch.float64).tolist(), 0.0, 0.5, 1 - 2**-40]
    got = draw(row[None], u, **case)
    compared = 0
    for ui, token in zip(u, got, strict=True):
        assert w[token] > 0, f"drew a token the filters dropped ({token})"
        want, distance = expected_token(w, ui)
        if distance > 1e-6:  # else u sits on a boundary between two tokens: either is right
            assert token == want, (ui, token, want)
            compared += 1
    assert compared > 150


def test_every_kept_token_can_be_drawn_and_no_other() -> None:
    row = torch.tensor([3.0, 2.0, 2.0, 1.0, -1.0, -2.5, 2.0, 0.5])
    u = [i / 4000 for i in range(4000)]
    assert set(draw(row[None], u, top_k=3)) == {0, 1, 2, 6}  # ties with the 3rd are kept
    assert set(draw(row[None], u)) == set(range(8))
    w = torch.exp(row.double() - 3.0)
    p = w / w.sum()
    # Mass of strictly larger weights: token 0: 0; tokens 1, 2, 6 (equal): p0, below 0.5 -> kept; 3: p0 + 3 p1.
    assert float(p[0]) < 0.5 < float(p[0] + 3 * p[1])
    assert set(draw(row[None], u, top_p=0.5)) == {0, 1, 2, 6}
    assert set(draw(row[None], u, min_p=0.3)) == {0, 1, 2, 6}  # e^-1 = 0.37 of the best


def test_the_draw_follows_the_probabilities() -> None:
    row = torch.tensor([1.0, 0.0, -1.0, 0.5]).log_softmax(0)
    n = 20000
    counts = torch.bincount(torch.tensor(draw(row[None], torch.rand(n, dtype=torch.float64).tolist())), minlength=4)
    probs = row.exp()
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 16.3  # 3 degrees of freedom: the 0.999 quantile


def test_nan_and_infinite_logits() -> None:
    nan, inf = float("nan"), float("inf")
    u = [i / 100 for i in range(100)]
    assert set(draw(torch.tensor([[nan, 1.0, nan, 1.0]]), u)) == {1, 3}  # NaN is never drawn
    assert set(draw(torch.tensor([[0.0, inf, 5.0]]), u)) == {1}  # an infinite logit takes all the mass
    assert set(draw(torch.tensor([[-inf, -inf, 2.0, -inf]]), u)) == {2}
    assert draw(torch.tensor([[nan, nan]]), [0.3]) == [0]  # nothing drawable: still a valid id


def test_row_ids_pick_rows_of_a_strided_batch() -> None:
    padded = torch.full((3, 70), -30.0)
    padded[:, 64:] = 100.0  # a model's padded vocabulary, sliced off as the sampler slices it
    for r, hot in enumerate((5, 17, 63)):
        padded[r, hot] = 10.0
    logits = padded[:, :64]
    assert logits.stride(0) == 70
    assert draw(logits, [0.5, 0.5, 0.5, 0.5], rows=[2, 0, 1, 2]) == [63, 5, 17, 63]


def test_bad_arguments_are_errors_not_crashes() -> None:
    op = torch.ops.inflightq.sample_rows
    x = torch.zeros(2, 8)
    one = torch.tensor([0])
    good = torch.tensor([[1.0, 0, 1.0, 0.0, 0.5]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="row id out of range"):
        op(x, torch.tensor([2]), good)
    with pytest.raises(RuntimeError, match="one row per sampled row"):
        op(x, torch.tensor([0, 1]), good)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(x.double(), one, good)
    with pytest.raises(RuntimeError, match="float64"):
        op(x, one, good.float())
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        op(x, one, torch.tensor([[0.0, 0, 1.0, 0.0, 0.5]], dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"u in \[0, 1\)"):
        op(x, one, torch.tensor([[1.0, 0, 1.0, 0.0, 1.0]], dtype=torch.float64))


AVX2_CHECK = """
import itertools, sys, torch
from torch.utils import cpp_extension
source, folder = sys.argv[1], sys.argv[2]
cpp_extension.load(name="sample_rows_avx2", sources=[source], build_directory=folder, is_python_module=False,
                   extra_cflags=["-O3", "-march=haswell", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"])
import tests.engine.test_sample_rows as t
for dtype, (vocab, scale), case in itertools.product(
    [torch.float32, torch.bfloat16], [(49152, 4.0), (37, 2.0)], t.CASES
):
    t.test_draws_match_a_float64_reference(dtype, vocab, scale, case)
t.test_every_kept_token_can_be_drawn_and_no_other()
t.test_nan_and_infinite_logits()
t.test_row_ids_pick_rows_of_a_strided_batch()
print("ok")
"""


@pytest.mark.slow
def test_a_build_without_avx512_draws_the_same(tmp_path: Path) -> None:
    """This box builds the kernels for its AVX-512; CPUs with AVX2 only get the other code paths (an
    8-wide exp, scalar selection and sums). Built for Haswell in a fresh process, they pass the same
    reference checks."""
    run_avx2_check(AVX2_CHECK, REPO / "worker" / "engine" / "model" / "kernels" / "sample_rows.cpp", tmp_path)
