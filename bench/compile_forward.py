"""Forward-only cost of one decode step, eager vs compiled, in the same process, interleaved.

Two copies of the model: one behind the eager runner, one behind the compiled runner (buckets
as asked, all compiled before timing). For each batch size B, B sequences with ``--context``
cached tokens decode one token; the two runners alternate, best and median of ``--repeats``.
The compiled figures are the engine's forward-only bound at that batch size.

    python -m bench.compile_forward --dtype bfloat16 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench.results_files import pyplot, save


def runner(
    model_name: str, dtype: torch.dtype, compiled: bool, buckets: tuple[int, ...], dynamic: bool = False
) -> tuple[Any, float]:
    from worker.engine.core.config import EngineConfig
    from worker.engine.model.model_loader import load_model
    from worker.engine.model.model_runner import ModelRunner

    model, _ = load_model(model_name, dtype, "cpu")
    started = time.perf_counter()
    config = EngineConfig(num_kv_blocks=4096, compile=compiled, compile_buckets=buckets, compile_dynamic=dynamic)
    return ModelRunner(model, config), time.perf_counter() - started


def decoding(batch: int, context: int, block_size: int = 16) -> list[SimpleNamespace]:
    blocks = -(-(context + 1) // block_size)
    return [
        SimpleNamespace(
            num_computed_tokens=context,
            token_ids=[5] * (context + 1),
            block_table=list(range(i * blocks, (i + 1) * blocks)),
            draft=[],
        )
        for i in range(batch)
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench.compile_forward", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dynamic", action="store_true", help="the compiled runner's one symbolic-size graph")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    dtype = getattr(torch, args.dtype)
    batches = tuple(int(b) for b in args.batches.split(","))
    eager, _ = runner(args.model, dtype, False, batches)
    compiled, warmup_s = runner(args.model, dtype, True, batches, args.dynamic)
    results: dict[str, Any] = {
        "command": "python -m bench.compile_forward " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}",
        "dtype": args.dtype,
        "context": args.context,
        "warmup_s": round(warmup_s, 1),
        "buckets": list(batches),
        "dynamic": args.dynamic,
        "load_average_before": os.getloadavg()[0],
        "rows": [],
    }
    for batch in batches:
        seqs = decoding(batch, args.context)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for i in range(args.repeats + 2):
            for name, r in (("eager", eager), ("compiled", compiled)):
                started = time.perf_counter()
                r.run(seqs, [1] * batch, [True] * batch)
                if i >= 2:  # the first two are warm-up
                    times[name].append((time.perf_counter() - started) * 1e3)
        pairs = [e / c for e, c in zip(times["eager"], times["compiled"], strict=True)]
        row = {
            "batch": batch,
            **{f"{k}_ms_min": round(min(v), 1) for k, v in times.items()},
            **{f"{k}_ms_median": round(statistics.median(v), 1) for k, v in times.items()},
            "speedup_min": round(min(times["eager"]) / min(times["compiled"]), 2),
            "speedup_median_pair": round(statistics.median(pairs), 2),
            "compiled_tok_s_bound": round(batch * 1e3 / min(times["compiled"]), 1),
        }
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    results["load_average_after"] = os.getloadavg()[0]
    if args.out:
        write(results, Path(args.out), args.tag)
    return results


def write(results: dict, folder: Path, tag: str) -> None:
    stem = folder / f"compile-{results['date'][:10]}{'-' + tag if tag else ''}-{results['dtype']}"
    lines = [
        f"# Compiled vs eager forward, one decode step, {results['date']}",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}; load average {results['load_average_before']:.1f} before, "
        f"{results['load_average_after']:.1f} after  ",
        f"{results['dtype']}, {results['context']} cached tokens per sequence; compile warm-up "
        f"{results['warmup_s']} s for buckets {results['buckets']}"
        + (" (dynamic: one symbolic-size graph for 2+ tokens, one for 1)" if results.get("dynamic") else ""),
        "",
        "| batch | eager ms (min / median) | compiled ms (min / median) | speedup (min) | speedup (median of pairs) "
        "| forward-only bound tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['batch']} | {r['eager_ms_min']} / {r['eager_ms_median']} | {r['compiled_ms_min']} / "
            f"{r['compiled_ms_median']} | {r['speedup_min']} | {r['speedup_median_pair']} "
            f"| {r['compiled_tok_s_bound']} |"
        )
    save(stem, results, lines, plot)


def plot(results: dict, path: Path) -> None:
    if (plt := pyplot()) is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(results["rows"]))
    ax.bar([x - 0.2 for x in xs], [r["eager_ms_min"] for r in results["rows"]], width=0.4, label="eager")
    ax.bar([x + 0.2 for x in xs], [r["compiled_ms_min"] for r in results["rows"]], width=0.4, label="compiled")
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in results["rows"]])
    ax.set_ylabel("ms per decode step (forward only, best)")
    ax.set_title(f"{results['dtype']}, same process, interleaved")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
