"""What the engine loses when other processes take a share of the cores it runs on.

A serving stack on a small box shares the worker's cores with the API, Redis and the clients
(``inflightq bench serve`` reports how much CPU each of them takes). The engine's torch threads
work in fork-join steps: every parallel region waits for its slowest thread, so a thread that loses
its core to another process for a moment holds the other threads up too, and the throughput lost
can be larger than the CPU taken. This measures that factor, offline and without Redis or HTTP:
``LLM.generate`` on a burst of requests, alone and beside a process that burns a set share of the
machine's cores in 1 ms bursts (as a stream of tokens asks the API for short bursts of work),
interleaved round by round. Every run gets fresh prompts (its own seed), so no run reuses
another's prefix-cached KV blocks.

    python -m bench.contention --dtype bfloat16 --shares 0.05,0.1 --rounds 2 --out bench/results --tag X
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.results_files import pyplot, run_header, save, stem, write_figure

BURST_MS = 1.0
# One thread of a child process: busy BURST_MS, then asleep, over and over.
_BURNER = """
import sys, time
busy, idle = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(idle)
"""


def burners(share: float, cores: int) -> list[float]:
    """The sleeps after each BURST_MS burst of as many one-thread processes as it takes (each busy
    at most half the time) to take ``share`` of ``cores`` cores together."""
    if not 0 < share < 1:
        raise ValueError(f"a share of the cores must be in (0, 1), not {share}")
    of_one_core = share * cores
    count = math.ceil(of_one_core / 0.5)
    return [BURST_MS * (count / of_one_core - 1)] * count


class Burner:
    """Child processes that take ``share`` of the machine's cores while they live."""

    def __init__(self, share: float, cores: int) -> None:
        self.share, self.cores = share, cores
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Burner:
        if self.share > 0:
            for idle in burners(self.share, self.cores):
                self.processes.append(subprocess.Popen([sys.executable, "-c", _BURNER, str(BURST_MS), str(idle)]))
            time.sleep(0.3)  # their interpreters started and burning before the run begins
        return self

    def __exit__(self, *_: object) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.contention", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shares", default="0.05,0.1", help="shares of the machine's cores another process takes")
    parser.add_argument("--requests", type=int, default=32, help="requests per burst, all submitted at once")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the engine (0 = torch's default)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench.serve_anchors import load_offline, offline_generate, warm_up
    from bench.serve_dataset import synthetic_chat
    from shared.model_source import load_tokenizer
    from shared.settings import Settings

    settings = Settings(model=args.model, dtype=args.dtype, max_num_seqs=max(args.requests, 1))
    llm = load_offline(settings, getattr(torch, args.dtype))
    tokenizer = load_tokenizer(settings.model)
    warm_up(llm, len(tokenizer))
    cores = os.cpu_count() or 1
    shares = [0.0, *(float(s) for s in args.shares.split(","))]
    runs: dict[float, list[dict[str, Any]]] = {share: [] for share in shares}
    seed = 1000
    for _ in range(args.rounds):
        for share in shares:
            seed += 1
            samples = synthetic_chat(
                tokenizer,
                args.requests,
                input_len=(args.input_len, args.input_len),
                output_len=(args.output_len, args.output_len),
                seed=seed,
            )
            with Burner(share, cores):
                run = offline_generate(llm, samples)
            runs[share].append(run)
            print(
                f"share {share:.0%}: {run['output_throughput']} tok/s, mean step {run['mean_step_ms']} ms", flush=True
            )
    alone = statistics.median(r["output_throughput"] for r in runs[0.0])
    rows = []
    for share in shares:
        throughput = statistics.median(r["output_throughput"] for r in runs[share])
        lost = 1 - throughput / alone
        rows.append(
            {
                "share_taken": share,
                "output_throughput": round(throughput, 2),
                "vs_alone": round(throughput / alone, 3),
                "mean_step_ms": round(statistics.median(r["mean_step_ms"] for r in runs[share]), 2),
                # Throughput lost per unit of CPU taken: 1 = the engine loses just the CPU it was denied.
                "amplification": round(lost / share, 2) if share else None,
                "runs": [r["output_throughput"] for r in runs[share]],
            }
        )
    report = {
        **run_header("bench.contention", argv),
        "cores": cores,
        "model": args.model,
        "dtype": args.dtype,
        "workload": {"requests": args.requests, "input_len": args.input_len, "output_len": args.output_len},
        "rounds": args.rounds,
        "rows": rows,
    }
    if args.out:
        save(stem(args.out, "contention", report["date"], args.tag), report, markdown(report), plot)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    w = report["workload"]
    lines = [
        f"# The engine beside other processes, {report['date']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; model `{report['model']}`, {report['dtype']}; {w['requests']} requests at "
        f"once, {w['input_len']}-token prompts, {w['output_len']} new tokens, fresh prompts each run; "
        f"{report['rounds']} rounds, interleaved, medians.",
        "",
        "| share of the cores another process takes | out tok/s | vs alone | mean step ms | loss / share taken |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        amplification = "-" if row["amplification"] is None else f"{row['amplification']}x"
        lines.append(
            f"| {row['share_taken']:.0%} | {row['output_throughput']} | {row['vs_alone']:.0%} "
            f"| {row['mean_step_ms']} | {amplification} |"
        )
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    shares = [100 * r["share_taken"] for r in rows]
    ax.plot(shares, [100 * r["vs_alone"] for r in rows], marker="o", label="engine throughput (measured)")
    ax.plot(shares, [100 - s for s in shares], linestyle="--", label="losing only the CPU taken")
    ax.set_xlabel("share of the cores another process takes (%)")
    ax.set_ylabel("throughput vs alone (%)")
    ax.set_title(f"{report['model']}, {report['dtype']}, {report['workload']['requests']} requests")
    ax.legend()
    write_figure(fig, path)


if __name__ == "__main__":
    main()
