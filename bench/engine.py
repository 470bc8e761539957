"""Engine throughput: our LLM.generate vs transformers' own continuous batching, same process.

Workload: 32 chat prompts on the default model, 32..256 new tokens each (seeded), greedy,
ignore_eos, all submitted at once. Reports tok/s for both, the ratio, and the share of the
engine's step time spent in the model forward, for each dtype asked.

    python -m bench.engine            # or: inflightq bench engine
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about the sea.",
    "How do vaccines work?",
    "Give me three tips for a job interview.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "How does a bicycle stay upright?",
    "Suggest a name for a bakery.",
    "What are prime numbers?",
    "Describe the water cycle.",
    "How do I make a cup of tea?",
    "What causes earthquakes?",
    "Write a short poem about autumn leaves.",
    "What is machine learning?",
    "List some healthy breakfast ideas.",
    "Why do cats purr?",
    "How do airplanes fly?",
    "What is the Pythagorean theorem?",
    "Give me a fun fact about octopuses.",
    "How can I improve my sleep?",
    "What is inflation in economics?",
    "Explain what a black hole is.",
    "Write a limerick about a programmer.",
    "What are the planets of the solar system?",
    "How does recycling help the environment?",
    "What is the tallest mountain on Earth?",
    "Describe a good way to learn a new language.",
    "What is the role of the heart in the body?",
    "Tell me a story about a brave mouse.",
    "Why do we have seasons?",
]


KV_TOKENS = 16384  # KV cache room for both engines: the workload needs about 32 x 300 tokens
MAX_BATCH_TOKENS = 1024


def workload(tokenizer: Any, num_prompts: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts, [rng.randint(32, 256) for _ in prompts]


def run_ours(model_name: str, dtype: torch.dtype, prompts: list[list[int]], lengths: list[int]) -> dict:
    from worker.engine import LLM, SamplingParams

    llm = LLM(
        model_name,
        dtype=dtype,
        device="cpu",
        max_num_seqs=len(prompts),
        max_num_batched_tokens=MAX_BATCH_TOKENS,
        num_kv_blocks=KV_TOKENS // 16,
        block_size=16,
    )
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up: first-call costs
    stats = llm.engine.stats
    before = (stats.forward_time_s, stats.step_time_s, stats.steps)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    forward, step_time = stats.forward_time_s - before[0], stats.step_time_s - before[1]
    return {
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tok_per_s": round(tokens / wall, 1),
        "steps": stats.steps - before[2],
        "forward_share_of_step": round(forward / step_time, 3),
        "step_share_of_wall": round(step_time / wall, 3),
        "sample_text": outs[0].text[:120],
    }


def run_transformers_cb(model_name: str, dtype: torch.dtype, prompts: list[list[int]], lengths: list[int]) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from worker.engine.model_loader import load_model

    model, _ = load_model(model_name, dtype, "cpu")
    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Left to itself it takes 90% of free RAM for its cache; give it the same room and token budget as ours.
    cb_config = ContinuousBatchingConfig(num_blocks=KV_TOKENS // 256, max_batch_tokens=MAX_BATCH_TOKENS)

    def run(batch: list[list[int]], news: list[int]) -> int:
        tokens = 0
        with model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, block=True, timeout=30
        ) as manager:
            for i, (ids, n) in enumerate(zip(batch, news, strict=True)):
                manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n)
            done = 0
            while done < len(batch):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done += 1
                    tokens += len(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop died")
        return tokens

    run(prompts[:2], [4, 4])  # warm-up
    started = time.perf_counter()
    tokens = run(prompts, lengths)
    wall = time.perf_counter() - started
    return {"tokens": tokens, "seconds": round(wall, 3), "tok_per_s": round(tokens / wall, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench.engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both engines (0: torch's default)")
    parser.add_argument("--skip-transformers", action="store_true", help="run only our engine (for profiling)")
    parser.add_argument("--out", default="bench/results", help="folder for engine-<date>.json/.md; '' to skip")
    args = parser.parse_args(argv)
    from worker.engine.model_loader import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(args.model)
    prompts, lengths = workload(tokenizer, args.num_prompts, args.seed)
    results: dict[str, Any] = {
        "command": "python -m bench.engine "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}",
        "workload": {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "new_tokens": sum(lengths)},
        "runs": {},
    }
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        row: dict[str, Any] = {"load_average_before": os.getloadavg()[0]}
        row["ours"] = run_ours(args.model, dtype, prompts, lengths)
        print(f"[{name}] ours: {row['ours']['tok_per_s']} tok/s, forward share {row['ours']['forward_share_of_step']}")
        if not args.skip_transformers:
            row["transformers_cb"] = run_transformers_cb(args.model, dtype, prompts, lengths)
            row["load_average_after"] = os.getloadavg()[0]
            row["ratio"] = round(row["ours"]["tok_per_s"] / row["transformers_cb"]["tok_per_s"], 2)
            print(f"[{name}] transformers CB: {row['transformers_cb']['tok_per_s']} tok/s -> ratio {row['ratio']}x")
        results["runs"][name] = row
    if args.out:
        write(results, Path(args.out))
    return results


def write(results: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"engine-{results['date'][:10]}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        f"# Engine benchmark, {results['date']}",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}  ",
        f"Workload: {json.dumps(results['workload'])}, greedy, ignore_eos, all submitted at once",
        "",
        "| dtype | ours tok/s | transformers CB tok/s | ratio | forward share of step | load avg before/after |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results["runs"].items():
        cb = row.get("transformers_cb", {}).get("tok_per_s", "-")
        share = row["ours"]["forward_share_of_step"]
        load = f"{row['load_average_before']:.1f} / {row.get('load_average_after', float('nan')):.1f}"
        lines.append(f"| {name} | {row['ours']['tok_per_s']} | {cb} | {row.get('ratio', '-')} | {share:.0%} | {load} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
