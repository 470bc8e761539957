"""What sampling costs a step: the ``sample_rows`` kernel against the sampler's torch path, same process.

Two measurements, both interleaved round by round:

1. The sampler alone on the default model's own logits (the last position of real chat prompts,
   one row per prompt) at 1, 8 and 32 rows, for the parameter sets clients send: OpenAI's default
   (temperature 1.0, nothing else), temperature 0.7 with top_p 0.95, HF's top_k 50, min_p 0.05, and
   greedy as the floor. Median microseconds per call.
2. ``LLM.generate`` on 32 requests (128-token prompts, 64 new tokens; ``--generate-requests``,
   ``--input-len``, ``--output-len``) at temperature 1.0 and top_p 0.95, with the engine's sampler
   on the kernel and on the torch path: output tokens per second.

    python -m bench.sampling --dtype bfloat16 --rounds 20 --out bench/results --tag X
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_files import pyplot, run_header, save, stem, write_figure

PARAMS = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "t 0.7, top_p 0.95": {"temperature": 0.7, "top_p": 0.95},
    "top_k 50": {"temperature": 1.0, "top_k": 50},
    "min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
}
PATHS = ("kernel", "torch")


def real_logits(name: str, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """The model's next-token logits after ``rows`` different chat prompts: [rows, vocab], from the
    transformers model itself (the engine's copy has its layers swapped for the fused ones)."""
    from bench.serve_dataset import synthetic_chat
    from worker.engine.model.model_loader import load_model

    model, tokenizer = load_model(name, dtype, "cpu")
    samples = synthetic_chat(tokenizer, rows, input_len=(40, 120), output_len=(1, 1), seed=3)
    out = []
    with torch.inference_mode():
        for s in samples:
            ids = torch.tensor([s.prompt_token_ids])
            out.append(model(input_ids=ids).logits[0, -1])
    return torch.stack(out)


def time_sampler(logits: torch.Tensor, vocab: int, rows: int, rounds: int) -> list[dict[str, Any]]:
    from worker.engine.sampling.sampler import Sampler, SamplingRow
    from worker.engine.sampling.sampling_params import SamplingParams

    samplers = {path: Sampler(vocab, "cpu", kernel=path == "kernel") for path in PATHS}
    out = []
    for name, kwargs in PARAMS.items():
        batch = [SamplingRow(f"r{i}", SamplingParams(**kwargs), [1], [], 0) for i in range(rows)]
        x = logits[:rows]
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        for sampler in samplers.values():
            sampler.sample(x, batch)  # warm
        for round_index in range(rounds):
            order = PATHS if round_index % 2 == 0 else tuple(reversed(PATHS))
            for path in order:
                started = time.perf_counter()
                samplers[path].sample(x, batch)
                times[path].append(time.perf_counter() - started)
        us = {path: round(statistics.median(t) * 1e6, 1) for path, t in times.items()}
        row = {"rows": rows, "params": name, "us": us, "torch_over_kernel": round(us["torch"] / us["kernel"], 2)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def time_generate(llm: Any, rounds: int, requests: int, input_len: int, output_len: int) -> dict[str, Any]:
    from bench.serve_dataset import synthetic_chat
    from worker.engine import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=output_len, ignore_eos=True)
    sampler = llm.engine.sampler
    tok_s: dict[str, list[float]] = {path: [] for path in PATHS}
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm
    for round_index in range(rounds):
        order = PATHS if round_index % 2 == 0 else tuple(reversed(PATHS))
        for path in order:
            # Fresh prompts each run: nothing comes from the prefix cache.
            samples = synthetic_chat(
                llm.tokenizer,
                requests,
                input_len=(input_len, input_len),
                output_len=(output_len, output_len),
                seed=100 + round_index * 2 + (path == "torch"),
            )
            sampler.kernel = path == "kernel"
            started = time.perf_counter()
            outs = llm.generate([s.prompt_token_ids for s in samples], params)
            wall = time.perf_counter() - started
            tok_s[path].append(sum(len(o.token_ids) for o in outs) / wall)
    sampler.kernel = True
    best = {path: round(max(v), 1) for path, v in tok_s.items()}
    result = {
        "workload": f"{requests} requests, {input_len}-token prompts, {output_len} new tokens, "
        "temperature 1.0, top_p 0.95",
        "tok_s_per_round": {path: [round(v, 1) for v in vals] for path, vals in tok_s.items()},
        "best_tok_s": best,
        "kernel_over_torch": round(best["kernel"] / best["torch"], 3),
    }
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.sampling", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=20, help="calls per path and case")
    parser.add_argument("--generate-rounds", type=int, default=2, help="LLM.generate runs per path (0: skip)")
    parser.add_argument("--generate-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128, help="the LLM.generate run's prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="the LLM.generate run's new tokens")
    parser.add_argument("--out", default="bench/results", help="folder for sampling-<date>.*; '' to skip writing")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    from worker.engine import LLM

    llm = LLM(args.model, dtype=getattr(torch, args.dtype), device="cpu")
    if not hasattr(torch.ops.inflightq, "sample_rows"):
        raise SystemExit("the CPU kernels did not build: there is no sample_rows to measure")
    rows_list = [int(r) for r in args.rows.split(",")]
    vocab = llm.engine.sampler.vocab_size
    logits = real_logits(args.model, getattr(torch, args.dtype), max(rows_list))[:, :vocab]
    sampler_rows = [row for rows in rows_list for row in time_sampler(logits, vocab, rows, args.rounds)]
    report = {
        **run_header("bench.sampling", argv),
        "model": args.model,
        "dtype": args.dtype,
        "sampler": sampler_rows,
        "generate": (
            time_generate(llm, args.generate_rounds, args.generate_requests, args.input_len, args.output_len)
            if args.generate_rounds
            else None
        ),
    }
    if args.out:
        save(stem(args.out, "sampling", report["date"], args.tag), report, markdown(report), plot)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"# Sampling: the sample_rows kernel against the torch path, {report['date']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; model `{report['model']}`, {report['dtype']} logits (the model's own,",
        "after real chat prompts).",
        "",
        "Median microseconds per `Sampler.sample` call, both paths interleaved:",
        "",
        "| rows | parameters | kernel | torch path | torch / kernel |",
        "|---|---|---|---|---|",
    ]
    for row in report["sampler"]:
        lines.append(
            f"| {row['rows']} | {row['params']} | {row['us']['kernel']} | {row['us']['torch']} | "
            f"{row['torch_over_kernel']}x |"
        )
    gen = report.get("generate")
    if gen:
        lines += [
            "",
            f"`LLM.generate`, {gen['workload']}: kernel {gen['best_tok_s']['kernel']} tok/s, torch path "
            f"{gen['best_tok_s']['torch']} tok/s (best of {len(gen['tok_s_per_round']['kernel'])} alternating runs "
            f"each): **{gen['kernel_over_torch']}x**. Per run: kernel {gen['tok_s_per_round']['kernel']}, torch "
            f"{gen['tok_s_per_round']['torch']}.",
        ]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows_list = sorted({r["rows"] for r in report["sampler"]})
    fig, axes = plt.subplots(1, len(rows_list), figsize=(4.5 * len(rows_list), 4), squeeze=False)
    for ax, rows in zip(axes[0], rows_list, strict=True):
        cases = [r for r in report["sampler"] if r["rows"] == rows]
        names = [r["params"] for r in cases]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r["us"]["kernel"] for r in cases], 0.4, label="sample_rows kernel")
        ax.bar([x + 0.2 for x in xs], [r["us"]["torch"] for r in cases], 0.4, label="torch path")
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("us per step's sampling")
        ax.set_title(f"{rows} rows")
        ax.legend(fontsize=8)
    write_figure(fig, path)


if __name__ == "__main__":
    main()
