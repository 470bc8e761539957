"""Engine fixtures: the tiny Llama loaded twice in float64 (one copy drives our engine, one runs
transformers' own ``generate`` as the reference), and an engine factory that checks, after each
test, that every KV block went back to the free list."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.engine import LLM, EngineConfig, LLMEngine
from worker.engine.model.model_loader import load_model


@pytest.fixture(scope="session")
def tiny_f64(tiny_model_dir: Path) -> tuple[Any, Any]:
    return load_model(str(tiny_model_dir), torch.float64, "cpu")


@pytest.fixture(scope="session")
def tiny_ref(tiny_model_dir: Path) -> Any:
    model, _ = load_model(str(tiny_model_dir), torch.float64, "cpu")
    return model


@pytest.fixture
def make_engine(tiny_f64: tuple[Any, Any]) -> Iterator[Callable[..., LLMEngine]]:
    engines: list[LLMEngine] = []

    def make(**kwargs: Any) -> LLMEngine:
        model, tokenizer = tiny_f64
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("block_size", 4)
        clock = kwargs.pop("clock", time.time)
        engine = LLMEngine(model, tokenizer, EngineConfig(**kwargs), clock=clock)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        for request_id in list(engine._seqs):
            engine.abort(request_id)
        assert engine.num_free_blocks == engine.num_total_blocks, "KV blocks leaked"
        assert not any(engine.block_manager.ref_counts), "a block still has references"


def reference(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` for one prompt (stops at EOS, which it keeps)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.config.eos_token_id,
    )
    return out[0, len(prompt) :].tolist()


def run_to_end(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[Any]]:
    """Steps until idle; returns each request's events in order."""
    events: dict[str, list[Any]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return events
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    raise AssertionError("engine did not finish")


def tiny_llm(
    tiny_model_dir: Path,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    *,
    decode_rows: int = 0,
    tile_rows: int = 0,
    enable_prefix_caching: bool = True,
    max_loras: int = 0,
) -> LLM:
    """The tiny Llama in ``dtype`` in an ``LLM`` on the CPU kernels; ``decode_rows``: bf16 matmuls of up to
    that many rows on decode_linear (and decode steps' layers as one op), as on an AVX-512 CPU; with it,
    ``tile_rows``: those of more rows, up to that many, on amx_linear, as on an AMX CPU (0: none, on
    any CPU; the kernel's plain loop gives the tiles' values where there is no AMX)."""
    from worker.engine.model import model_runner

    if decode_rows:
        monkeypatch.setattr(model_runner, "decode_rows_for", lambda dtype: decode_rows)
        monkeypatch.setattr(model_runner, "tile_rows_for", lambda dtype: tile_rows)
        monkeypatch.setattr(model_runner, "decode_copy_fits", lambda model, available, copies=1: True)
    model, tokenizer = load_model(str(tiny_model_dir), dtype, "cpu")
    llm = LLM.__new__(LLM)
    config = EngineConfig(
        num_kv_blocks=256, block_size=4, enable_prefix_caching=enable_prefix_caching, max_loras=max_loras
    )
    llm.engine, llm._next_id = LLMEngine(model, tokenizer, config), 0
    return llm
