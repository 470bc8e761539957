"""Decode steps on padded batch-size buckets with static inputs (what a CUDA graph replays): the
tokens equal transformers' ``generate``, padding rows touch no sequence's KV, and every decode-only
step takes that path. On a CPU the padded step runs uncaptured (``cuda_graphs="eager"``); the capture
itself is checked where a CUDA device is present."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.conftest import reference, run_to_end
from tests.engine.test_engine_exactness import random_prompts
from worker.engine import LLM, SamplingParams
from worker.engine.model.decode_graphs import DecodeGraphs, context_widths, graph_buckets
from worker.engine.model.model_loader import load_model


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(decodes, padded batch size, context width) of every step the padded path ran."""
    runs: list[tuple[int, int, int]] = []
    original = DecodeGraphs._fill

    def counted(self: DecodeGraphs, seqs: list[Any], b: int, w: int) -> None:
        runs.append((len(seqs), b, w))
        original(self, seqs, b, w)

    monkeypatch.setattr(DecodeGraphs, "_fill", counted)
    return runs


def test_buckets_pad_by_at_most_seven_rows_past_eight() -> None:
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert graph_buckets(3) == (1, 2, 3)


def test_gathered_tables_come_in_widths_of_four_times() -> None:
    assert context_widths(512) == (16, 64, 256, 512)
    assert context_widths(256) == (16, 64, 256)
    assert context_widths(10) == (10,)


@pytest.mark.slow
@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch-attention", "cpu-kernel-attention"])
def test_padded_decode_steps_give_generates_tokens(
    make_engine: Any, tiny_ref: Any, monkeypatch: pytest.MonkeyPatch, cpu_kernels: bool
) -> None:
    runs = _count_runs(monkeypatch)
    # 11 ragged prompts: decode steps of 11, 10, ... sequences pad to 16, 8, 4, 2 rows as they finish.
    prompts = random_prompts(11, seed=3)
    budgets = [6 + 3 * i for i in range(len(prompts))]
    engine = make_engine(cuda_graphs="eager", cpu_kernels=cpu_kernels, max_num_seqs=16, max_num_batched_tokens=64)
    assert engine.runner.decode_graphs is not None
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=budget, ignore_eos=True))
    events = run_to_end(engine)
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        tokens = [e.token_id for e in events[f"r{i}"] if e.token_id >= 0]
        assert tokens == reference(tiny_ref, prompt, budget)[: len(tokens)]
        assert len(tokens) == budget
    assert runs, "no decode step took the padded path"
    assert {b for _, b, _ in runs} >= {16, 8, 4, 2}
    assert any(n < b for n, b, _ in runs), "no step needed padding rows"
    widths = {w for _, _, w in runs}
    # The plain-torch backend gathers whole tables: short contexts take the narrow graphs (the
    # tiny model admits 256 blocks of 4); the CPU kernel reads in place, one width for all.
    assert widths == ({16, 64} if not cpu_kernels else {256})


def test_padding_rows_write_only_the_scratch_block(make_engine: Any) -> None:
    engine = make_engine(cuda_graphs="eager", max_num_seqs=8)
    graphs = engine.runner.decode_graphs
    assert graphs.scratch_block == engine.num_total_blocks  # past every block the manager hands out
    for name, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12, 13])):
        engine.add_request(name, prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()  # the three prefills
    before = [k.clone() for k, _ in engine.runner.kv_caches]
    engine.step()  # three decodes padded to four rows
    seqs = [engine._seqs[r] for r in ("a", "b", "c")]
    own = {s.block_table[(s.num_computed_tokens - 1) // 4] for s in seqs}  # where each decode's K/V went
    assert graphs.bucket_for(3) == 4
    for k0, (k1, _) in zip(before, engine.runner.kv_caches, strict=True):
        blocks0 = k0.view(k0.shape[0], -1, 4, k0.shape[-1])
        blocks1 = k1.view(k1.shape[0], -1, 4, k1.shape[-1])
        changed = {b for b in range(blocks0.shape[1]) if not torch.equal(blocks0[:, b], blocks1[:, b])}
        assert graphs.scratch_block in changed  # the padding row wrote there
        assert changed <= own | {graphs.scratch_block}
    run_to_end(engine)


def test_seeded_sampling_is_the_same_with_padded_decode_steps(make_engine: Any) -> None:
    prompts = random_prompts(5, seed=9)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    outputs = []
    for mode in ("eager", False):
        engine = make_engine(cuda_graphs=mode, max_num_seqs=8)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        events = run_to_end(engine)
        outputs.append({r: [e.token_id for e in evs] for r, evs in events.items()})
    assert outputs[0] == outputs[1]


def test_cuda_graphs_on_a_cpu_is_refused(make_engine: Any) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        make_engine(cuda_graphs=True)


def test_auto_leaves_a_cpu_engine_without_graphs(make_engine: Any) -> None:
    assert make_engine().runner.decode_graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="hardware: CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_captured_decode_graphs_give_generates_tokens(tiny_model_dir: Any, dtype: torch.dtype) -> None:
    model, tokenizer = load_model(str(tiny_model_dir), dtype, "cuda")
    ref, _ = load_model(str(tiny_model_dir), dtype, "cuda")
    llm = LLM(model, tokenizer=tokenizer, cuda_graphs=True, max_num_seqs=16, num_kv_blocks=512)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.capture and graphs.warmup_s > 0
    prompts = random_prompts(11, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=12))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        mask = torch.ones_like(ids)
        expected = ref.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert out.token_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("env", "field"), [("auto", "auto"), ("on", True), ("off", False), ("eager", "eager")])
def test_the_workers_setting_reaches_the_engine(
    env: str, field: object, tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.settings import Settings
    from worker.engine_config import engine_config

    monkeypatch.setenv("INFLIGHTQ_CUDA_GRAPHS", env)
    assert engine_config(Settings(model=str(tiny_model_dir))).cuda_graphs == field


def test_an_unknown_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from shared.settings import Settings

    monkeypatch.setenv("INFLIGHTQ_CUDA_GRAPHS", "sometimes")
    with pytest.raises(ValidationError, match="cuda_graphs"):
        Settings()


def _failing_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a GPU whose capture fails (a host sync inside the forward, say)."""
    from worker.engine.model import model_runner

    def refuse(self: DecodeGraphs) -> float:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(model_runner, "decode_graphs_mode", lambda setting, device: "capture" if setting else None)
    monkeypatch.setattr(DecodeGraphs, "warmup", refuse)


def test_a_failed_capture_by_default_leaves_decode_steps_eager(
    make_engine: Any, tiny_ref: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failing_capture(monkeypatch)
    engine = make_engine(cuda_graphs="auto")
    assert engine.runner.decode_graphs is None
    prompt = random_prompts(1, seed=4)[0]
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    tokens = [e.token_id for e in run_to_end(engine)["r"] if e.token_id >= 0]
    assert tokens == reference(tiny_ref, prompt, 6)


def test_a_failed_capture_asked_for_fails_the_start(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_capture(monkeypatch)
    with pytest.raises(RuntimeError, match="capturing"):
        make_engine(cuda_graphs=True)
