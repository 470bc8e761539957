"""LoRA adapters in the batch: throughput and time per output token at 1, 8 and 32 streams with 0
(the base model alone), 1, 4 and 16 distinct adapters spread over the streams, same engine, same run.

One offline engine on the default model serves every cell (its adapters made with ``peft`` at the
start: random rank-8 A and B on every projection of every layer, so each costs what a real one
does); the cells alternate per round. Each cell submits ``streams`` requests at once (greedy, the
engine benchmark's questions) and runs them to the end: tokens/s over the wall time, and TPOT, each
request's time from its first to its last token over its tokens after the first. Speculative
decoding is off, so the figures are the adapters' alone. Reports each cell's ratio to the base
model's cell at the same streams.

    python -m bench.lora            # or: inflightq bench lora
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine import QUESTIONS
from bench.results_files import run_header
from bench.speculative import chat_prompts

STREAMS = (1, 8, 32)
ADAPTER_COUNTS = (0, 1, 4, 16)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: Any, count: int, root: Path, rank: int) -> list[Any]:
    """``count`` random adapters of ``model`` saved under ``root``, as ``LoRARequest`` s."""
    import torch
    from peft import LoraConfig, get_peft_model

    from worker.engine import LoRARequest

    out = []
    for i in range(count):
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(copy.deepcopy(model), config).save_pretrained(root / f"a{i}")
        out.append(LoRARequest(f"a{i}", str(root / f"a{i}")))
    return out


def run_cell(llm: Any, prompts: list[list[int]], loras: list[Any], streams: int, max_new: int) -> dict:
    """``streams`` requests at once, request i with ``loras[i % len(loras)]`` (none when empty)."""
    from worker.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    started = time.perf_counter()
    for i in range(streams):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompts[i % len(prompts)], params, lora=lora)
    while engine.has_unfinished():
        for event in engine.step():
            now = time.perf_counter()
            if event.token_id >= 0:
                first.setdefault(event.request_id, now)
                last[event.request_id] = now
                counts[event.request_id] = counts.get(event.request_id, 0) + 1
    elapsed = time.perf_counter() - started
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    tokens = sum(counts.values())
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "tpot_ms": 1000 * sum(tpots) / len(tpots)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the cells")
    parser.add_argument("--streams", default=",".join(map(str, STREAMS)))
    parser.add_argument("--adapters", default=",".join(map(str, ADAPTER_COUNTS)))
    parser.add_argument("--out", default="", help="a JSON file for the results; '' to print only")
    args = parser.parse_args(argv)
    header = run_header("bench.lora", argv)
    streams_list = [int(s) for s in args.streams.split(",")]
    counts = [int(c) for c in args.adapters.split(",")]

    from worker.engine import LLM
    from worker.engine.model.model_loader import load_model

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(streams_list), max_loras=max(counts), speculative_tokens=0)
    prompts = chat_prompts(llm.tokenizer, QUESTIONS)
    base, _ = load_model(args.model)  # a float32 copy for peft to shape the adapters on
    with tempfile.TemporaryDirectory(prefix="inflightq-bench-lora-") as root:
        adapters = make_adapters(base, max(counts), Path(root), args.rank)
        del base
        run_cell(llm, prompts, adapters, max(streams_list), 4)  # warm-up: every adapter loaded, every path run
        cells: dict[tuple[int, int], list[dict]] = {}
        for _ in range(args.rounds):
            for streams in streams_list:
                for count in counts:
                    cell = run_cell(llm, prompts, adapters[:count], streams, args.max_new_tokens)
                    cells.setdefault((streams, count), []).append(cell)
    rows = []
    print("| streams | adapters | tok/s | x base | TPOT ms | x base |\n|---|---|---|---|---|---|")
    for streams in streams_list:
        merged = {}
        for count in counts:
            runs = cells[streams, count]
            tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
            merged[count] = (tokens / seconds, sum(r["tpot_ms"] for r in runs) / len(runs))
        anchor = merged.get(0, merged[counts[0]])
        for count in counts:
            tok_s, tpot = merged[count]
            rows.append(
                {
                    "streams": streams,
                    "adapters": count,
                    "tok_s": round(tok_s, 2),
                    "tpot_ms": round(tpot, 2),
                    "throughput_vs_base": round(tok_s / anchor[0], 3),
                    "tpot_vs_base": round(tpot / anchor[1], 3),
                }
            )
            print(
                f"| {streams} | {count} | {tok_s:.1f} | {tok_s / anchor[0]:.2f} | {tpot:.1f} | {tpot / anchor[1]:.2f} |"
            )
    results = {"header": header, "rank": args.rank, "max_new_tokens": args.max_new_tokens, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
