"""Where one engine step's time goes at batch 1, 8 and 32 (decode steps, default model).

Per batch size: wall time of ``LLMEngine.step`` split into the forward (with logits), sampling +
detokenisation + scheduling (the rest), and, inside the forward, torch's profiler's top ops.

    python -m bench.step_profile --dtype bfloat16 [--compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench.step_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args(argv)
    from worker.engine import EngineConfig, LLMEngine, SamplingParams
    from worker.engine.model.model_loader import load_model

    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), "cpu")
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(num_kv_blocks=2048, compile=args.compile, compile_buckets=tuple(batches))
    engine = LLMEngine(model, tokenizer, config)
    prompt = tokenizer.encode("Tell me a long story about a brave mouse who sails the sea.")
    report: dict[str, Any] = {"dtype": args.dtype, "compile": args.compile, "rows": []}
    for batch in batches:
        for i in range(batch):
            params = SamplingParams(max_new_tokens=args.steps + 4, ignore_eos=True)
            engine.add_request(f"{batch}-{i}", prompt, params)
        engine.step()  # the prefill
        engine.step()
        walls, forwards = [], []
        with torch.profiler.profile() as prof:
            for _ in range(args.steps):
                before = engine.stats.forward_time_s
                started = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - started)
                forwards.append(engine.stats.forward_time_s - before)
        while engine.has_unfinished():
            engine.step()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        row = {
            "batch": batch,
            "step_ms_median": round(statistics.median(walls) * 1e3, 1),
            "forward_ms_median": round(statistics.median(forwards) * 1e3, 1),
            "rest_ms_median": round(statistics.median(w - f for w, f in zip(walls, forwards, strict=True)) * 1e3, 2),
            "top_ops_share": {e.key: round(e.self_cpu_time_total / total, 3) for e in ops},
        }
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    return report


if __name__ == "__main__":
    main()
