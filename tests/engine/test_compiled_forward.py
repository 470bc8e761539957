"""The compiled forward (torch.compile over padded token-count buckets) gives transformers'
``generate`` output token for token, and no step compiles after the warm-up.

Two fp32 engines (one graph per bucket; one symbolic-size graph for 2+ tokens), each with two
small buckets, keep this to two compiles of two graphs each (about a minute each on a 2-core box;
seconds once inductor's cache holds them)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.engine.conftest import reference
from worker.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from worker.engine.core import step_interrupt
from worker.engine.model.compiled_forward import buckets_for
from worker.engine.model.model_loader import load_model

pytestmark = pytest.mark.slow

MAX_NEW = 10


@pytest.fixture(scope="module", params=[False, True], ids=["per-bucket", "dynamic"])
def compiled_llm(request: pytest.FixtureRequest, tiny_model_dir: Any) -> LLM:
    model, tokenizer = load_model(str(tiny_model_dir), torch.float32, "cpu")
    config = EngineConfig(
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=4,
        compile=True,
        compile_buckets=(1, 4),
        compile_dynamic=request.param,
    )
    llm = LLM.__new__(LLM)
    llm.engine, llm._next_id = LLMEngine(model, tokenizer, config), 0
    return llm


def test_compiled_forward_matches_generate_token_for_token(compiled_llm: LLM, tiny_model_dir: Any) -> None:
    ref_model, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    rng = random.Random(3)
    # 3 prompts decode in the 4-token bucket (one padding row; dynamic: the 2+ graph at size 3),
    # then 2, then 1 as they finish.
    prompts = [[rng.randrange(3, 40_000) for _ in range(n)] for n in (5, 11, 17)]
    params = [SamplingParams(max_new_tokens=n) for n in (MAX_NEW, MAX_NEW - 3, MAX_NEW - 6)]
    with torch._dynamo.config.patch(error_on_recompile=True):  # every shape was compiled at warm-up
        outs = compiled_llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.token_ids == reference(ref_model, prompt, p.max_new_tokens)
    assert compiled_llm.engine.runner.compiled is not None


def test_warmup_time_is_reported(compiled_llm: LLM) -> None:
    assert compiled_llm.engine.stats.warmup_s > 0
    compiled = compiled_llm.engine.runner.compiled
    assert compiled is not None
    assert compiled.buckets == ((1, 2) if compiled.dynamic else (1, 4))


def test_buckets_past_the_step_budget_are_dropped() -> None:
    assert buckets_for(16, (1, 2, 4, 8, 16, 32, 64)) == (1, 2, 4, 8, 16)
    assert buckets_for(512, (1, 8)) == (1, 8)


def test_the_eager_path_is_the_default(make_engine: Any) -> None:
    engine = make_engine()
    assert engine.runner.compiled is None and engine.stats.warmup_s == 0


def test_a_compiled_step_stopped_for_an_urgent_arrival_keeps_nothing(
    compiled_llm: LLM, tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stop is raised inside the compiled graph, by the opaque attention op at a layer's start.
    engine = compiled_llm.engine
    ref_model, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 40_000) for _ in range(n)] for n in (6, 9, 13)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"stopped-{i}", prompt, SamplingParams(max_new_tokens=MAX_NEW), priority=3)
    stop_if_requested = engine._interrupt.stop_if_requested

    def urgent_arrives(layer: int, num_layers: int) -> None:
        if layer == 0:
            engine.interrupt_for(0)
        stop_if_requested(layer, num_layers)

    monkeypatch.setattr(engine._interrupt, "stop_if_requested", urgent_arrives)
    monkeypatch.setattr(step_interrupt, "MAX_THROWN_AWAY_SHARE", 1.0)  # the tiny model's steps are too short for it
    tokens: dict[str, list[int]] = {}
    before = engine.stats.interrupted_steps
    with torch._dynamo.config.patch(error_on_recompile=True):
        while engine.has_unfinished():
            for event in engine.step():
                tokens.setdefault(event.request_id, []).append(event.token_id)
    assert engine.stats.interrupted_steps - before >= MAX_NEW  # every other step
    for i, prompt in enumerate(prompts):
        assert tokens[f"stopped-{i}"] == reference(ref_model, prompt, MAX_NEW)
