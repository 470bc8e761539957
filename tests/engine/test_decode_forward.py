"""A decode-only step runs ``decode_forward``'s loop instead of transformers' model forward, with
transformers' values to the last bit (greedy tokens and logprobs), and only where the model's
code is Llama's and nothing hooks it; every other step keeps transformers' forward."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaModel

from tests.ci_skips import missing
from tests.engine.conftest import reference, tiny_llm
from tests.engine.test_engine_exactness import random_prompts
from worker.engine import LLM, SamplingParams
from worker.engine.model.decode_forward import DecodeForward
from worker.engine.model.kernels.cpu_kernel import paged_decode_available
from worker.engine.model.model_loader import load_model


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(
            missing("a C++ compiler (the engine keeps transformers' forward without one)", "apt-get install g++")
        )
    assert paged_decode_available(), "the CPU kernels failed to build although a compiler is present"


def _llm(tiny_model_dir: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> LLM:
    # bf16: the decode layers' one op, as on an AVX-512 CPU. No prefix cache: the tests run the same
    # prompts twice, and a cached prompt's second prefill computes only its tail, a matmul of fewer rows,
    # whose last bits differ on CPUs whose matmuls are not batch-invariant (fp32 on the AVX512-BF16
    # EPYC, bf16 on AMX Xeons; the README's "Not supported yet") -- a difference of the prefill, not
    # of the decode steps these tests compare.
    return tiny_llm(
        tiny_model_dir,
        dtype,
        monkeypatch,
        decode_rows=4 if dtype == torch.bfloat16 else 0,
        enable_prefix_caching=False,
    )


def _count_model_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = LlamaModel.forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "forward", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_steps_skip_transformers_forward_and_give_its_values_bit_for_bit(
    tiny_model_dir: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 and 4 sequences (each layer one op in bf16) and 6 (more rows than the one op takes: each
    layer's Python forward, still under decode_forward's loop); the same run with it off."""
    llm = _llm(tiny_model_dir, dtype, monkeypatch)
    decode_forward = llm.engine.runner.decode_forward
    assert decode_forward is not None
    calls = _count_model_forwards(monkeypatch)
    params = SamplingParams(max_new_tokens=8, logprobs=3)
    results = {}
    for enabled in (True, False):
        decode_forward.enabled = enabled
        for batch in (1, 4, 6):
            calls[0] = 0
            outs = llm.generate(random_prompts(batch, seed=batch), params)
            # one prefill step, then 7 decode steps: transformers' forward runs them only when off
            assert calls[0] == (1 if enabled else 8), (enabled, batch, calls[0])
            results[enabled, batch] = [(o.token_ids, o.logprobs, o.top_logprobs) for o in outs]
    for batch in (1, 4, 6):
        assert results[True, batch] == results[False, batch]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_greedy_tokens_through_decode_forward_are_generates(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(tiny_model_dir, torch.float32, monkeypatch)
    assert llm.engine.runner.decode_forward is not None
    ref, _ = load_model(str(tiny_model_dir), torch.float32, "cpu")
    prompts = random_prompts(3, seed=11)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=12))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(ref, prompt, 12)


def test_a_hooked_model_or_a_layer_put_back_keeps_transformers_forward(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(tiny_model_dir, torch.float32, monkeypatch)
    model = llm.engine.runner.model
    handle = model.model.norm.register_forward_hook(lambda module, args, out: None)
    assert DecodeForward.build(model) is None  # a hook could change what the loop would skip
    handle.remove()
    assert DecodeForward.build(model) is not None

    layer = model.model.layers[1]
    fused = layer.__dict__.pop("forward")  # transformers' layer back, as bench.step_ab switches it
    calls = _count_model_forwards(monkeypatch)
    outs = llm.generate(random_prompts(1, seed=2), SamplingParams(max_new_tokens=4))
    assert len(outs[0].token_ids) == 4 and calls[0] == 4  # every step through transformers' forward
    layer.forward = fused
    calls[0] = 0
    llm.generate(random_prompts(1, seed=2), SamplingParams(max_new_tokens=4))
    assert calls[0] == 1
