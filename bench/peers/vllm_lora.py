"""bench.lora's vLLM side: the same cells on vLLM's offline ``LLM`` with ``enable_lora``, run by the vLLM
venv's python (bench/peers/install.sh), never imported by the project: it imports only vllm and stdlib.

Reads one JSON spec on stdin (written by bench/lora.py):

    {"model": HF dir, "dtype": "bfloat16", "rank": 8, "max_loras": 16, "max_num_seqs": 32,
     "max_num_batched_tokens": 1024, "max_model_len": 512, "enable_prefix_caching": true,
     "prompts": [[token ids], ...], "adapters": [peft dir, ...], "streams": [1, 8, 32],
     "counts": [0, 1, 4, 16], "max_new_tokens": 32, "rounds": 1}

and writes one JSON object on stdout: ``{"version", "start_s", "cells": [{"streams", "adapters", "tokens",
"seconds", "tok_s", "tpot_ms"}, ...]}`` (one entry per cell per round), or ``{"error", "stage"}`` when vLLM
cannot start or run with LoRA here (exit status 3). vLLM's own logs go to stderr.

A cell submits ``streams`` requests at once (request i on adapter i mod k, none when k = 0), greedy,
``ignore_eos``, and steps the engine to the end: tokens/s over the wall time, and TPOT from each request's
first to last token as the step loop receives them, the way bench/lora.py times our engine.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def run_cell(llm: Any, prompts: list[list[int]], loras: list[Any], streams: int, max_new: int) -> dict:
    """``streams`` requests at once, request i with ``loras[i % len(loras)]`` (none when empty)."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    # DELTA: each step's output holds only that step's new tokens, so each arrival can be timed.
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    started = time.perf_counter()
    for i in range(streams):
        lora = loras[i % len(loras)] if loras else None
        prompt = TokensPrompt(prompt_token_ids=prompts[i % len(prompts)])
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            new = sum(len(c.token_ids) for c in out.outputs)
            if new:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] = counts.get(out.request_id, 0) + new
    elapsed = time.perf_counter() - started
    # A step that hands over several tokens of one request at once counts them all at its arrival time.
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    tokens = sum(counts.values())
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "tok_s": tokens / elapsed,
        "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None,
    }


def main() -> int:
    spec = json.load(sys.stdin)
    # vLLM prints to stdout too: everything written to fd 1 from here on goes to stderr, the JSON to the real one.
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(payload: dict, status: int) -> int:
        result_out.write(json.dumps(payload) + "\n")
        result_out.flush()
        return status

    stage = "import"
    try:
        import vllm
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        stage = "start"
        started = time.perf_counter()
        llm = LLM(
            model=spec["model"],
            dtype=spec["dtype"],
            enable_lora=True,
            max_loras=max(1, spec["max_loras"]),
            max_lora_rank=spec["rank"],
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            max_model_len=spec["max_model_len"],
            enable_prefix_caching=spec["enable_prefix_caching"],
            seed=0,
        )
        start_s = time.perf_counter() - started
        # lora_int_id must be > 0 and unique per adapter.
        adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(spec["adapters"])]
        prompts, max_new = spec["prompts"], spec["max_new_tokens"]
        stage = "warm-up"
        run_cell(llm, prompts, adapters, max(spec["streams"]), 4)  # every adapter loaded, every path run
        stage = "cells"
        cells = []
        for _ in range(spec["rounds"]):
            for streams in spec["streams"]:
                for count in spec["counts"]:
                    cell = run_cell(llm, prompts, adapters[:count], streams, max_new)
                    cells.append({"streams": streams, "adapters": count, **cell})
    except Exception as exc:  # vLLM without LoRA on this CPU, or a failure mid-run: the caller records why
        traceback.print_exc()
        return answer({"error": f"{type(exc).__name__}: {exc}"[:2000], "stage": stage}, 3)
    return answer({"version": vllm.__version__, "start_s": round(start_s, 1), "cells": cells}, 0)


if __name__ == "__main__":  # vLLM's engine core runs in a spawned process that re-imports this file
    sys.exit(main())
