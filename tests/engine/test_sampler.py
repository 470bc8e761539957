"""Sampler: every parameter changes what is drawn, seeded draws ignore the rest of the batch,
and logprobs are those of the raw logits."""

from __future__ import annotations

import math
import shutil
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from tests.ci_skips import missing
from worker.engine.model.kernels.cpu_kernel import paged_decode_available
from worker.engine.sampling.sampler import NUM_CANDIDATES, Sampler, SamplerOutput, SamplingRow
from worker.engine.sampling.sampling_filters import _top_p_full, _typical_p_full, filter_candidates, filter_full
from worker.engine.sampling.sampling_params import SamplingParams

VOCAB = 64
NEG = float("-inf")


def row(
    params: SamplingParams,
    *,
    rid: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    index: int | None = None,
) -> SamplingRow:
    output = output or []
    return SamplingRow(rid, params, prompt or [], output, len(output) if index is None else index)


@dataclass(frozen=True)
class Path:
    """Which way the sampler draws: the sample_rows kernel, or the torch path with K candidates."""

    kernel: bool
    num_candidates: int = NUM_CANDIDATES

    def sampler(self, vocab: int = VOCAB) -> Sampler:
        return Sampler(vocab, torch.device("cpu"), self.num_candidates, kernel=self.kernel)


KERNEL, TORCH = Path(kernel=True), Path(kernel=False)


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, path: Path = KERNEL) -> Counter[int]:
    """n independent draws from one logits row: n rows with seeds 0.. in one batch."""
    sampler = path.sampler(logits_row.shape[-1])
    rows = [row(SamplingParams(**{**vars(params), "seed": i}), rid=str(i)) for i in range(n)]
    out = sampler.sample(logits_row.expand(n, -1).clone(), rows)
    return Counter(out.token_ids)


def chi_square(counts: Counter[int], probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in enumerate(probs.tolist()) if p > 0)


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(VOCAB, torch.device("cpu"))


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    """The kernel path is tested wherever it can run: on a CPU with a compiler the sampler uses it."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the sampler keeps its torch path without one)", "apt-get install g++"))
    assert paged_decode_available(), "the CPU kernels failed to build although a compiler is present"


@pytest.fixture(
    params=[KERNEL, TORCH, Path(kernel=False, num_candidates=2)], ids=["kernel", "candidates", "few-candidates"]
)
def path(request: pytest.FixtureRequest) -> Path:
    """The kernel (sample_rows.cpp), or the torch path: filters on each row's top-K candidates when
    exact, else on the whole vocabulary (with K = 2 most of these cases take the latter)."""
    return request.param


# -- greedy ------------------------------------------------------------------------------------


def test_all_greedy_batch_is_argmax_through_the_fast_path(sampler: Sampler, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(sampler, "_sample_general", lambda *a: pytest.fail("fast path not taken"))
    out = sampler.sample(logits, [row(SamplingParams(), rid=str(i)) for i in range(8)])
    assert out == SamplerOutput(logits.argmax(-1).tolist(), None, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype_is_accepted(sampler: Sampler, dtype: torch.dtype) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)).to(dtype)
    rows = [row(SamplingParams(temperature=0.8, seed=i, logprobs=2), rid=str(i)) for i in range(4)]
    out = sampler.sample(logits, rows)
    assert len(out.token_ids) == 4 and all(0 <= t < VOCAB for t in out.token_ids)
    assert sampler.sample(logits, [row(SamplingParams())] * 4).token_ids == logits.argmax(-1).tolist()


def test_logits_wider_than_the_vocab_never_yield_padding_ids(sampler: Sampler) -> None:
    logits = torch.zeros(2, VOCAB + 8)
    logits[:, VOCAB:] = 100.0  # padded embedding rows of the model
    logits[:, 3] = 1.0
    greedy = sampler.sample(logits, [row(SamplingParams())] * 2)
    sampled = sampler.sample(logits, [row(SamplingParams(temperature=1.0, seed=1, logprobs=1))] * 2)
    assert greedy.token_ids == [3, 3]
    assert all(t < VOCAB for t in sampled.token_ids)


def test_greedy_rows_in_a_mixed_batch_are_still_argmax(sampler: Sampler) -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    rows = [row(SamplingParams(temperature=1.5 if i % 2 else 0.0, seed=i), rid=str(i)) for i in range(6)]
    out = sampler.sample(logits, rows)
    assert out.token_ids[0::2] == logits[0::2].argmax(-1).tolist()


def test_greedy_float64_is_exact_even_for_near_ties(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB, dtype=torch.float64)
    logits[0, 5] = 1.0
    logits[0, 9] = 1.0 + 1e-12  # collapses into a tie in float32
    out = sampler.sample(logits, [row(SamplingParams(logprobs=0))])
    assert out.token_ids == [9]


# -- temperature and filters --------------------------------------------------------------------


def test_temperature_reshapes_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    n = 3000
    for temperature in (0.5, 2.0):
        counts = draw_many(logits, SamplingParams(temperature=temperature), n)
        expected = torch.softmax(logits / temperature, -1)
        other = torch.softmax(logits / (2.5 - temperature), -1)  # 0.5 <-> 2.0
        # 5 degrees of freedom: 20.5 is the 0.999 quantile.
        assert chi_square(counts, expected, n) < 20.5
        assert chi_square(counts, other, n) > 200


def test_top_k_one_equals_greedy(path: Path) -> None:
    logits = torch.randn(50, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [row(SamplingParams(temperature=5.0, top_k=1, seed=i), rid=str(i)) for i in range(50)]
    assert path.sampler().sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_most_likely(path: Path) -> None:
    logits = torch.linspace(0.0, 1.0, VOCAB)  # nearly flat: without top_k, draws spread everywhere
    counts = draw_many(logits, SamplingParams(temperature=1.0, top_k=3), 600, path)
    assert set(counts) == {VOCAB - 1, VOCAB - 2, VOCAB - 3}
    assert len(draw_many(logits, SamplingParams(temperature=1.0), 600, path)) > 20


def test_tiny_top_p_equals_greedy(path: Path) -> None:
    logits = torch.randn(50, VOCAB, generator=torch.Generator().manual_seed(4))
    rows = [row(SamplingParams(temperature=5.0, top_p=1e-6, seed=i), rid=str(i)) for i in range(50)]
    assert path.sampler().sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_the_mass(path: Path) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = draw_many(probs.log(), SamplingParams(temperature=1.0, top_p=0.75), 1000, path)
    assert set(counts) == {0, 1}  # 0.5 < 0.75 <= 0.8
    assert set(draw_many(probs.log(), SamplingParams(temperature=1.0, top_p=0.85), 1000, path)) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_share_of_the_best(path: Path) -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.1])
    counts = draw_many(probs.log(), SamplingParams(temperature=1.0, min_p=0.5), 1000, path)
    assert set(counts) == {0, 1}  # threshold 0.2
    assert set(draw_many(probs.log(), SamplingParams(temperature=1.0), 1000, path)) == {0, 1, 2, 3, 4}


def test_typical_p_keeps_the_most_typical_tokens_not_the_most_likely(path: Path) -> None:
    # Entropy 1.09 nats; surprise of token 0 is 0.92, of tokens 1 and 2 is 1.20: tokens 1 and 2
    # are the typical ones, so typical_p=0.5 drops the most likely token.
    probs = torch.tensor([0.4, 0.3, 0.3])
    assert set(draw_many(probs.log(), SamplingParams(temperature=1.0, typical_p=0.5), 500, path)) == {1, 2}
    assert set(draw_many(probs.log(), SamplingParams(temperature=1.0), 500, path)) == {0, 1, 2}


def reference_keep(probs: list[float], mass: float, key: list[float]) -> set[int]:
    """Tokens in ``key`` order until their mass reaches ``mass``."""
    kept, total = set(), 0.0
    for t in sorted(range(len(probs)), key=lambda i: key[i]):
        if total >= mass:
            break
        kept.add(t)
        total += probs[t]
    return kept


@pytest.mark.parametrize("trial", range(5))
def test_top_p_and_typical_p_match_a_plain_reference(trial: int) -> None:
    logits = torch.randn(1, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(trial)) * 2
    probs = torch.softmax(logits, -1)[0].tolist()
    entropy = -sum(p * math.log(p) for p in probs)
    for mass in (0.3, 0.6, 0.9):
        x = logits.clone()
        _top_p_full(x, torch.tensor([[mass]], dtype=torch.float64))
        assert set(torch.isfinite(x[0]).nonzero().flatten().tolist()) == reference_keep(
            probs, mass, [-p for p in probs]
        )
        x = logits.clone()
        _typical_p_full(x, torch.tensor([[mass]], dtype=torch.float64))
        typical_key = [abs(-math.log(p) - entropy) for p in probs]
        assert set(torch.isfinite(x[0]).nonzero().flatten().tolist()) == reference_keep(probs, mass, typical_key)


def test_filtering_the_candidates_equals_filtering_the_whole_vocabulary() -> None:
    """Rows the candidate path calls exact get the very distribution the full path gives."""
    gen = torch.Generator().manual_seed(8)
    combos = [
        SamplingParams(temperature=1.0, top_k=10),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.0, typical_p=0.7),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.95, typical_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.02, typical_p=0.95),
    ]
    exact_seen = inexact_seen = 0
    for scale in (1.0, 3.0, 6.0):
        logits = torch.randn(len(combos), 500, dtype=torch.float64, generator=gen) * scale
        cands = filter_candidates(logits, combos, 32)
        full = logits.clone()
        filter_full(full, combos)
        for i, exact in enumerate(cands.exact):
            if not exact:
                inexact_seen += 1
                continue
            exact_seen += 1
            from_cands = torch.zeros(500, dtype=torch.float64)
            from_cands[cands.token_ids[i]] = torch.softmax(cands.logits[i], -1)
            assert torch.allclose(from_cands, torch.softmax(full[i], -1), atol=1e-12), combos[i]
    assert exact_seen > 8 and inexact_seen > 2  # both verdicts were exercised


@pytest.mark.parametrize(
    ("params", "peaked_exact", "flat_exact"),
    [
        (SamplingParams(temperature=1.0, top_k=10), True, True),
        (SamplingParams(temperature=1.0, top_k=40), False, False),  # more than the 32 candidates
        (SamplingParams(temperature=1.0, top_p=0.9), True, False),
        (SamplingParams(temperature=1.0, min_p=0.2), True, False),
        (SamplingParams(temperature=1.0, typical_p=0.9), True, False),
    ],
)
def test_the_candidates_settle_a_row_only_when_nothing_outside_them_survives(
    params: SamplingParams, peaked_exact: bool, flat_exact: bool
) -> None:
    flat = -torch.arange(500.0)[None] * 1e-3  # distinct values: no ties with the outside
    peaked = flat - 10.0
    peaked[0, :5] = torch.tensor([5.0, 4.0, 3.5, 3.0, 2.0])
    assert filter_candidates(peaked, [params], 32).exact == [peaked_exact]
    assert filter_candidates(flat, [params], 32).exact == [flat_exact]
    if params.top_k == 10:
        assert torch.isfinite(filter_candidates(flat, [params], 32).logits).sum() == 10


def test_sampling_follows_the_processed_distribution(path: Path) -> None:
    logits = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0, -3.0, -4.0])
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    n = 3000
    x = logits / 0.7
    x[6:] = NEG
    probs = torch.softmax(x, -1)
    # top_p=0.9 drops the tail beyond the 0.9 mass
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    x[order[before >= 0.9]] = NEG
    expected = torch.softmax(x, -1)
    counts = draw_many(logits, params, n, path)
    assert chi_square(counts, expected, n) < 25.0


# -- penalties --------------------------------------------------------------------------------


def crafted(values: dict[int, float], base: float = -5.0) -> torch.Tensor:
    logits = torch.full((1, VOCAB), base)
    for token, value in values.items():
        logits[0, token] = value
    return logits


@pytest.mark.parametrize("temperature", [0.0, 1e-4])
def test_repetition_penalty_divides_positive_logits_of_seen_tokens(sampler: Sampler, temperature: float) -> None:
    logits = crafted({5: 2.0, 6: 1.9})
    params = SamplingParams(temperature=temperature, repetition_penalty=1.2, seed=0)
    assert sampler.sample(logits, [row(SamplingParams())]).token_ids == [5]
    assert sampler.sample(logits, [row(params, rid="p", prompt=[5])]).token_ids == [6]  # seen in prompt
    assert sampler.sample(logits, [row(params, rid="o", output=[5])]).token_ids == [6]  # seen in output
    assert sampler.sample(logits, [row(params, rid="n", prompt=[7])]).token_ids == [5]  # not seen


def test_repetition_penalty_multiplies_negative_logits_of_seen_tokens(sampler: Sampler) -> None:
    logits = crafted({5: -1.0, 6: -1.1}, base=-9.0)
    params = SamplingParams(repetition_penalty=1.2)
    assert sampler.sample(logits, [row(params, prompt=[5])]).token_ids == [6]  # -1.2 < -1.1


def test_frequency_penalty_grows_with_the_count_in_the_output(sampler: Sampler) -> None:
    logits = crafted({5: 2.0, 6: 1.5})
    params = SamplingParams(frequency_penalty=0.2)
    assert sampler.sample(logits, [row(params, rid="once", output=[5])]).token_ids == [5]  # 1.8
    assert sampler.sample(logits, [row(params, rid="thrice", output=[5, 5, 5])]).token_ids == [6]  # 1.4
    assert sampler.sample(logits, [row(params, rid="prompt", prompt=[5, 5, 5])]).token_ids == [5]  # output only


def test_presence_penalty_ignores_the_count(sampler: Sampler) -> None:
    logits = crafted({5: 2.0, 6: 1.5})
    params = SamplingParams(presence_penalty=0.6)
    assert sampler.sample(logits, [row(params, rid="once", output=[5])]).token_ids == [6]  # 1.4
    assert sampler.sample(logits, [row(params, rid="thrice", output=[5, 5, 5])]).token_ids == [6]
    assert sampler.sample(logits, [row(params, rid="prompt", prompt=[5])]).token_ids == [5]


def test_negative_presence_penalty_favours_seen_tokens(sampler: Sampler) -> None:
    logits = crafted({5: 1.0, 6: 1.5})
    assert sampler.sample(logits, [row(SamplingParams(presence_penalty=-1.0), output=[5])]).token_ids == [5]


def test_cached_counts_follow_the_output_step_by_step() -> None:
    """The incremental cache gives what a fresh sampler computes from the full lists, and only
    the penalised rows of a batch are touched."""
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)
    incremental = Sampler(VOCAB, torch.device("cpu"))
    prompts = {"a": [1, 2, 3], "b": [4, 4, 9]}
    outputs: dict[str, list[int]] = {"a": [], "b": [], "g": []}
    for _ in range(30):
        logits = torch.randn(3, VOCAB, generator=gen)
        rows = [
            row(params, rid="a", prompt=prompts["a"], output=list(outputs["a"])),
            row(SamplingParams(), rid="g", output=list(outputs["g"])),
            row(params, rid="b", prompt=prompts["b"], output=list(outputs["b"])),
        ]
        got = incremental.sample(logits, rows).token_ids
        fresh = Sampler(VOCAB, torch.device("cpu")).sample(logits, rows).token_ids
        assert got == fresh
        assert got[1] == logits[1].argmax().item()
        for rid, token in zip(("a", "g", "b"), got, strict=True):
            outputs[rid].append(token)
    assert len(set(outputs["a"])) > 5  # the penalties really pushed it around


def test_release_forgets_a_request_and_a_reused_id_starts_clean(sampler: Sampler) -> None:
    logits = crafted({5: 2.0, 6: 1.5})
    params = SamplingParams(frequency_penalty=0.2)
    assert sampler.sample(logits, [row(params, rid="x", output=[5, 5, 5])]).token_ids == [6]
    sampler.release("x")
    assert sampler.sample(logits, [row(params, rid="x", output=[5])]).token_ids == [5]
    # A preempted request that comes back with a shorter history is rebuilt even without release.
    assert sampler.sample(logits, [row(params, rid="x", output=[5, 5, 5, 5])]).token_ids == [6]
    assert sampler.sample(logits, [row(params, rid="x", output=[])]).token_ids == [5]


def test_many_penalised_requests_grow_the_buffers(sampler: Sampler) -> None:
    logits = crafted({5: 2.0, 6: 1.5}).expand(40, -1).clone()
    rows = [row(SamplingParams(presence_penalty=1.0), rid=str(i), output=[5] if i % 2 else [6]) for i in range(40)]
    assert sampler.sample(logits, rows).token_ids == [6 if i % 2 else 5 for i in range(40)]
    for i in range(40):
        sampler.release(str(i))


# -- seeds ------------------------------------------------------------------------------------


def seeded_token(sampler: Sampler, logits: torch.Tensor, seed: int, index: int, neighbours: int, position: int) -> int:
    gen = torch.Generator().manual_seed(1000 + neighbours)
    batch = torch.randn(neighbours + 1, VOCAB, generator=gen)
    batch[position] = logits
    rows = [
        row(SamplingParams(temperature=1.0 + i % 3, seed=(None if i % 2 else i), top_k=i % 5), rid=f"n{i}")
        for i in range(neighbours + 1)
    ]
    rows[position] = row(SamplingParams(temperature=1.0, seed=seed), rid="me", index=index)
    return sampler.sample(batch, rows).token_ids[position]


def test_a_seeded_draw_ignores_batch_composition_and_position() -> None:
    logits = torch.zeros(VOCAB)  # uniform: the draw is all noise
    sampler = Sampler(VOCAB, torch.device("cpu"))
    for seed in (0, 1, 12345, 2**63 - 1):
        for index in (0, 7):
            alone = seeded_token(sampler, logits, seed, index, neighbours=0, position=0)
            assert seeded_token(sampler, logits, seed, index, neighbours=5, position=3) == alone
            assert seeded_token(sampler, logits, seed, index, neighbours=9, position=9) == alone
            assert seeded_token(Sampler(VOCAB, torch.device("cpu")), logits, seed, index, 2, 1) == alone


def test_seeded_draws_vary_with_index_and_seed() -> None:
    sampler = Sampler(VOCAB, torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    by_index = {
        sampler.sample(logits, [row(SamplingParams(temperature=1.0, seed=3), index=i)]).token_ids[0] for i in range(20)
    }
    by_seed = {
        sampler.sample(logits, [row(SamplingParams(temperature=1.0, seed=s), index=0)]).token_ids[0] for s in range(20)
    }
    assert len(by_index) > 10 and len(by_seed) > 10


def test_a_resumed_request_continues_identically() -> None:
    """Generating 12 tokens in one go, or 5 then a fresh sampler (another worker) from index 5."""
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=77)
    gen = torch.Generator().manual_seed(6)
    step_logits = [torch.randn(1, VOCAB, generator=gen) for _ in range(12)]

    def run(sampler: Sampler, output: list[int], start: int) -> list[int]:
        for i in range(start, 12):
            output.append(
                sampler.sample(step_logits[i], [row(params, prompt=[1, 2], output=list(output))]).token_ids[0]
            )
        return output

    straight = run(Sampler(VOCAB, torch.device("cpu")), [], 0)
    resumed = run(Sampler(VOCAB, torch.device("cpu")), list(straight[:5]), 5)
    assert resumed == straight


def test_unseeded_sampling_uses_the_global_generator(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    torch.manual_seed(0)
    first = [sampler.sample(logits, [row(SamplingParams(temperature=1.0))]).token_ids[0] for _ in range(10)]
    torch.manual_seed(0)
    again = [sampler.sample(logits, [row(SamplingParams(temperature=1.0))]).token_ids[0] for _ in range(10)]
    assert first == again and len(set(first)) > 3


# -- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_those_of_the_raw_logits_with_sorted_top_n(sampler: Sampler) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    rows = [
        row(SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5, seed=1, logprobs=4), rid="a", prompt=[1]),
        row(SamplingParams(logprobs=0), rid="b"),
        row(SamplingParams(), rid="c"),
    ]
    out = sampler.sample(logits, rows)
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(expected[i, token].item(), abs=1e-5)
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == expected[0].topk(4).indices.tolist()
    assert [v for _, v in top] == pytest.approx(expected[0].topk(4).values.tolist(), abs=1e-5)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []


def test_no_logprobs_when_no_row_asks(sampler: Sampler) -> None:
    out = sampler.sample(torch.randn(2, VOCAB), [row(SamplingParams(temperature=1.0, seed=1))] * 2)
    assert out.logprobs is None and out.top_logprobs is None


def test_stop_token_ids_and_ignore_eos_are_exposed_for_the_engine() -> None:
    params = SamplingParams(stop_token_ids=[7, 9], ignore_eos=True)
    assert params.stop_token_ids == [7, 9] and params.ignore_eos


def test_the_callers_logits_are_left_untouched(sampler: Sampler) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    rows = [
        row(SamplingParams(temperature=0.8, top_p=0.5, seed=1), rid="a"),
        row(SamplingParams(temperature=1.0, seed=2), rid="b"),
        row(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, logprobs=3), rid="c", output=[1, 2, 3]),
        row(SamplingParams(temperature=0.5, top_k=3, min_p=0.1, typical_p=0.9, seed=3), rid="d"),
    ]
    sampler.sample(logits, rows)
    assert torch.equal(logits, before)
