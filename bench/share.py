"""The stack's share of the offline engine on a burst, the two alternating round by round.

``inflightq bench serve`` measures the offline engine once and the stack after it, minutes apart. On
the shared 2-core boxes a minute can move throughput by a third (two back-to-back runs there gave
98% and 72%), so one such ratio says little. Here each round sends the same fresh burst (new
prompts every round, so neither side reuses the other's prefix blocks) once to ``LLM.generate`` in
this process and once through the API to the worker pool, alternating which goes first, and the
share is the median of the rounds' ratios. The offline engine is sized from the same settings as the
worker (``bench.serve_anchors.load_offline``).

    INFLIGHTQ_MAX_NUM_SEQS=32 python -m bench.share --dtype bfloat16 --num-requests 32 --input-len 128 \\
        --output-len 64 --rounds 6 --out bench/results --tag X
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

from bench.results_files import pyplot, save, stem, write_figure

SYSTEMS = ("offline", "stack")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.share", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: INFLIGHTQ_MODEL")
    parser.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: INFLIGHTQ_DTYPE)")
    parser.add_argument("--num-requests", type=int, default=32, help="the burst: all sent at once")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--endpoint", default="chat", choices=("chat", "generate_stream", "queue"))
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="bench/results", help="folder for share-<date>.*; '' to skip writing")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    args.base_url, args.num_kv_blocks = None, None  # what bench.serve's settings helper reads

    import torch

    from bench.serve import Runner, bench_settings, report_head, stop_on_sigterm, warm_stack
    from bench.serve_anchors import load_offline, offline_generate, warm_up
    from bench.serve_dataset import synthetic_chat
    from bench.serve_stack import Stack
    from shared.model_source import load_tokenizer
    from shared.startup_objects import freeze_startup_objects
    from worker.engine_config import settings_dtype

    stop_on_sigterm()
    settings = bench_settings(args)
    tokenizer = load_tokenizer(settings.model)

    def burst(round_index: int) -> list[Any]:
        n, i, o = args.num_requests, args.input_len, args.output_len
        return synthetic_chat(tokenizer, n, input_len=(i, i), output_len=(o, o), seed=1000 + round_index)

    head_args = argparse.Namespace(
        seed=1000, input_len=f"{args.input_len},{args.input_len}", output_len=f"{args.output_len},{args.output_len}"
    )
    report = report_head("python -m bench.share", argv, settings, burst(0), head_args)
    dtype: torch.dtype = settings_dtype(settings)
    report["dtype"] = str(dtype).replace("torch.", "")
    llm = load_offline(settings, dtype)
    warm_up(llm, len(llm.tokenizer))
    keys = [f"bench-{uuid.uuid4().hex[:12]}" for _ in range(64)]
    stack = Stack(settings, keys)
    rounds: list[dict[str, Any]] = []
    try:
        stack.start(workers=args.workers)
        runner = Runner(settings, stack.base_url, keys, None)
        warm_stack(runner, [args.endpoint], synthetic_chat(tokenizer, 8, input_len=(40, 60), output_len=(4, 4), seed=1))
        # This process is also the load generator: its objects (the offline model's among them) out of
        # the collector's full walks, which took ~0.3-0.4 s of a core during the stack's runs otherwise.
        freeze_startup_objects()
        for r in range(args.rounds):
            samples = burst(r + 1)
            order = SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))
            tok_s: dict[str, float] = {}
            for system in order:
                if system == "offline":
                    tok_s[system] = offline_generate(llm, samples)["output_throughput"]
                else:
                    out = asyncio.run(runner.run(args.endpoint, samples, rate=math.inf, concurrency=args.num_requests))
                    if out.get("failed"):
                        raise SystemExit(f"round {r}: {out['failed']} requests failed through the stack")
                    tok_s[system] = out["output_throughput"]
            row = {"order": list(order), "tok_s": tok_s, "share": round(tok_s["stack"] / tok_s["offline"], 3)}
            print(json.dumps(row), flush=True)
            rounds.append(row)
    finally:
        stack.stop()
    shares = [row["share"] for row in rounds]
    report |= {
        "endpoint": args.endpoint,
        "workers": args.workers,
        "rounds": rounds,
        "share_median": round(statistics.median(shares), 3),
        "share_range": [min(shares), max(shares)],
    }
    print(f"stack / offline engine: median {report['share_median']} over {len(shares)} rounds {shares}")
    if args.out:
        save(stem(args.out, "share", report["date"], args.tag), report, markdown(report), plot)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"# The stack's share of the offline engine, interleaved, {report['date']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; model `{report['model']}`, {report['dtype']}; "
        f"engine {json.dumps(report['engine'])}  ",
        f"Each round: one fresh burst of {report['dataset']['requests']} requests "
        f"({report['dataset']['input_len'][0]}-token prompts, {report['dataset']['output_len'][0]} new tokens, "
        f"greedy, ignore_eos) to `LLM.generate` in the benchmark's process and through the API "
        f"(`{report['endpoint']}`, {report['workers']} worker(s)), in the order shown.",
        "",
        "| round | order | offline tok/s | stack tok/s | stack / offline |",
        "|---|---|---|---|---|",
    ]
    for i, row in enumerate(report["rounds"]):
        lines.append(
            f"| {i + 1} | {' then '.join(row['order'])} | {row['tok_s']['offline']} | {row['tok_s']['stack']} | "
            f"{row['share']} |"
        )
    lines += [
        "",
        f"Median share: **{report['share_median']}** (range {report['share_range'][0]}-{report['share_range'][1]}).",
    ]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(1, len(report["rounds"]) + 1)
    for system in SYSTEMS:
        ax.plot(list(xs), [row["tok_s"][system] for row in report["rounds"]], marker="o", label=system)
    ax.set_xlabel("round")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"stack / offline: median {report['share_median']}")
    ax.legend()
    write_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])
