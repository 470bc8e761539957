"""Greedy output of the engine equals transformers' ``generate`` token for token (float64),
whatever the batching: many ragged prompts at once, chunked prefill, preemption, prefix hits."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.engine.conftest import reference
from worker.engine import LLM, SamplingParams

MAX_NEW = 12


def random_prompts(n: int, seed: int, low: int = 1, high: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40_000) for _ in range(rng.randrange(low, high))] for _ in range(n)]


@pytest.fixture(scope="module")
def references(tiny_ref: Any) -> dict[tuple[int, ...], list[int]]:
    cache: dict[tuple[int, ...], list[int]] = {}
    return cache


def check(llm: LLM, prompts: list[list[int]], tiny_ref: Any, refs: dict[tuple[int, ...], list[int]]) -> None:
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, out in zip(prompts, outs, strict=True):
        key = tuple(prompt)
        if key not in refs:
            refs[key] = reference(tiny_ref, prompt, MAX_NEW)
        assert out.prompt_token_ids == prompt
        assert out.token_ids == refs[key], f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason in ("length", "eos_token")


@pytest.fixture(params=["cpu", "torch"])
def backend(request: pytest.FixtureRequest) -> str:
    """Both CPU attention paths: the compiled paged-decode kernel and the plain-torch fallback."""
    return request.param


def make_llm(make_engine: Any, backend: str = "auto", **kwargs: Any) -> LLM:
    engine = make_engine(attention_backend=backend, **kwargs)
    llm = LLM.__new__(LLM)  # wrap an engine built by the fixture, which checks blocks afterwards
    llm.engine, llm._next_id = engine, 0
    return llm


def test_many_ragged_prompts_in_one_batch_match_generate(
    make_engine: Any, tiny_ref: Any, references: Any, backend: str
) -> None:
    llm = make_llm(make_engine, backend, max_num_batched_tokens=4096, num_kv_blocks=1024)
    check(llm, random_prompts(32, seed=1), tiny_ref, references)
    assert llm.engine.stats.steps <= MAX_NEW + 1  # all 32 prefilled together, then decoded together


def test_chunked_prefill_matches_generate(make_engine: Any, tiny_ref: Any, references: Any, backend: str) -> None:
    llm = make_llm(make_engine, backend, max_num_batched_tokens=7)  # every prompt over 7 tokens is split
    check(llm, random_prompts(10, seed=1, low=20), tiny_ref, references)


def test_preemption_recomputes_exactly(make_engine: Any, tiny_ref: Any, references: Any, backend: str) -> None:
    llm = make_llm(make_engine, backend, num_kv_blocks=40, block_size=4, enable_prefix_caching=False)
    check(llm, random_prompts(12, seed=2, low=20, high=40), tiny_ref, references)
    assert llm.engine.stats.preemptions > 0


def test_shared_prefixes_hit_the_prefix_cache(make_engine: Any, tiny_ref: Any, references: Any, backend: str) -> None:
    llm = make_llm(make_engine, backend, block_size=4)
    system = random_prompts(1, seed=3, low=30, high=31)[0]
    first = [system + tail for tail in random_prompts(4, seed=4, high=10)]
    second = [system + tail for tail in random_prompts(6, seed=5, high=10)]
    check(llm, first, tiny_ref, references)
    assert llm.engine.stats.prefix_cache_hits == 0
    check(llm, second, tiny_ref, references)
    # Each prompt of the second round finds at least the system prompt's full blocks (tokens counted).
    assert llm.engine.stats.prefix_cache_hits >= 6 * (len(system) // 4) * 4


def test_prefix_cache_keeps_tenants_apart(make_engine: Any) -> None:
    engine = make_engine(block_size=4)
    prompt = random_prompts(1, seed=6, low=40, high=41)[0]
    for request_id, tenant in (("a", "acme"), ("b", "globex"), ("c", "acme")):
        engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=2), tenant=tenant)
        while engine.has_unfinished():
            engine.step()
        if request_id == "b":
            assert engine.stats.prefix_cache_hits == 0
    assert engine.stats.prefix_cache_hits == (len(prompt) - 1) // 4 * 4


def test_logits_at_last_positions_only(make_engine: Any, tiny_ref: Any) -> None:
    llm = make_llm(make_engine)
    prompt = random_prompts(1, seed=7, low=30, high=31)[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=1, logprobs=3))[0]
    with torch.no_grad():
        logits = tiny_ref(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits, -1)
    assert out.token_ids == [int(logits.argmax())]
    assert out.logprobs is not None and out.logprobs[0] == pytest.approx(float(expected.max()), abs=1e-6)
    assert out.top_logprobs is not None and [t for t, _, _ in out.top_logprobs[0]] == expected.topk(3).indices.tolist()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_chat_prompts_match_generate(default_model_name: str) -> None:
    from worker.engine.model.model_loader import load_model

    llm = LLM(default_model_name, dtype="float32", num_kv_blocks=128)
    ref, tokenizer = load_model(default_model_name, torch.float32, "cpu")
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colours."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=24))
    for prompt, out in zip(prompts, outs, strict=True):
        expected = reference(ref, prompt, 24)
        assert out.token_ids == expected
        assert out.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
