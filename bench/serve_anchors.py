"""The anchors, in this process, on the serving benchmark's own prompts: our offline engine
(``LLM.generate``, every request at once) and transformers' continuous batching (bench/engine.py's
runner), plus one request alone in the engine (the time-to-first-token floor any serving path adds
to; bench/serve_low_load.py interleaves it with the stack's ways in)."""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.serve_dataset import ChatSample
from bench.serve_metrics import RequestResult
from shared.settings import Settings


def load_offline(settings: Settings, dtype: torch.dtype) -> Any:
    """An ``LLM`` sized exactly as ``inflightq worker`` sizes its engine from the same settings."""
    from worker.engine import LLM
    from worker.engine_config import engine_config

    return LLM.from_config(engine_config(settings, dtype=dtype, device="cpu"))


def warm_up(llm: Any, vocab_size: int) -> None:
    from worker.engine import SamplingParams

    # Token ids no benchmark prompt starts with, so the warm-up leaves nothing useful in the prefix cache.
    llm.generate([[vocab_size - 1 - i for i in range(24)]], SamplingParams(max_new_tokens=4, ignore_eos=True))


def offline_generate(llm: Any, samples: list[ChatSample]) -> dict[str, Any]:
    """Throughput of ``LLM.generate`` with every request submitted at once (the saturation anchor)."""
    from worker.engine import SamplingParams

    params = [SamplingParams(max_new_tokens=s.output_len, ignore_eos=True) for s in samples]
    stats = llm.engine.stats
    steps, step_s = stats.steps, stats.step_time_s
    started = time.perf_counter()
    outs = llm.generate([s.prompt_token_ids for s in samples], params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    steps, step_s = stats.steps - steps, stats.step_time_s - step_s
    return {
        # Compared with the worker's own count (its log's last line) these tell whether the stack
        # lost throughput to slower steps (CPU taken by the rest) or to more, smaller ones.
        "engine_steps": steps,
        "mean_step_ms": round(1000 * step_s / max(1, steps), 2),
        "requests": len(samples),
        "completed": sum(1 for o in outs if o.finish_reason is not None),
        "total_output_tokens": tokens,
        "duration_s": round(wall, 3),
        "output_throughput": round(tokens / wall, 2),
        "request_throughput": round(len(samples) / wall, 3),
    }


def offline_one(llm: Any, sample: ChatSample, request_id: str, tenant: str) -> RequestResult:
    """One request alone in the engine, timed per token event as a streaming client would see it:
    the low-load floor. ``tenant`` salts the prefix cache so earlier requests' blocks are not reused."""
    from worker.engine import SamplingParams

    engine = llm.engine
    result = RequestResult(sample.prompt_len, sample.output_len)
    params = SamplingParams(max_new_tokens=sample.output_len, ignore_eos=True)
    started = last = time.perf_counter()
    engine.add_request(request_id, sample.prompt_token_ids, params, tenant=tenant)
    while engine.has_unfinished():
        for event in engine.step():
            if event.token_id >= 0:
                last = result.record_token(started, time.perf_counter(), last)
    result.latency, result.success = last - started, True
    return result


def transformers_cb(settings: Settings, dtype: torch.dtype, samples: list[ChatSample]) -> dict[str, Any]:
    from bench import engine

    prompts, lengths = [s.prompt_token_ids for s in samples], [s.output_len for s in samples]
    # bench/engine.py sizes transformers' KV cache by its module constant: give it the room our engine has here.
    engine.KV_TOKENS = settings.num_kv_blocks * settings.block_size if settings.num_kv_blocks else engine.KV_TOKENS
    # bench/engine.py is being reshaped (function -> class); take whichever this tree has.
    if hasattr(engine, "TransformersCB"):
        out = engine.TransformersCB(settings.model, dtype).run(prompts, lengths)
    else:
        out = engine.run_transformers_cb(settings.model, dtype, prompts, lengths)
    return {
        "requests": len(samples),
        "total_output_tokens": out["tokens"],
        "duration_s": out["seconds"],
        "output_throughput": out["tok_per_s"],
        "request_throughput": round(len(samples) / out["seconds"], 3),
    }


def transformers_cb_online(
    settings: Settings, dtype: torch.dtype, samples: list[ChatSample], offsets: list[float]
) -> tuple[list[RequestResult], float]:
    """transformers' continuous batching fed on an arrival schedule (``offsets``, seconds from the start), in
    this process (no HTTP, no Redis): FCFS, as it has no priorities. Each token is timed by transformers'
    own per-token timestamps (``record_timestamps``, perf_counter), each request from when it was added.
    Returns every request's result, in order, and the wall time from the first arrival to the last token."""
    import threading

    from transformers import GenerationConfig

    from bench import engine

    engine.KV_TOKENS = settings.num_kv_blocks * settings.block_size if settings.num_kv_blocks else engine.KV_TOKENS
    cb = engine.TransformersCB(settings.model, dtype)
    cb._generate([s.prompt_token_ids for s in samples[:2]], [4, 4])  # warm-up
    config = GenerationConfig(
        max_new_tokens=max(s.output_len for s in samples), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    results = [RequestResult(s.prompt_len, s.output_len) for s in samples]
    sent = [0.0] * len(samples)
    with cb.model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb.cb_config, block=True, timeout=30
    ) as manager:
        start = time.perf_counter()

        def submit() -> None:
            for i, (sample, offset) in enumerate(zip(samples, offsets, strict=True)):
                time.sleep(max(0.0, start + offset - time.perf_counter()))
                sent[i] = time.perf_counter()
                ids, n = sample.prompt_token_ids, sample.output_len
                manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True)

        feeder = threading.Thread(target=submit, daemon=True)
        feeder.start()
        done, end = 0, start
        while done < len(samples):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died")
                continue
            if not out.is_finished():
                continue
            i = int(out.request_id[1:])
            result, last = results[i], sent[i]
            for stamp in out.timestamps or []:
                last = result.record_token(sent[i], stamp, last)
            result.latency, result.reported_tokens = last - sent[i], len(out.generated_tokens)
            result.success, result.error = out.error is None, out.error or ""
            end = max(end, last)
            done += 1
        feeder.join()
    return results, end - start
