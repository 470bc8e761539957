"""Decode attention (``paged_decode``) over a model's layers, against a read of the same K/V bytes.

A decode step of B sequences with L tokens of context each reads, in every layer, the K and V of
all B x L tokens from the paged cache; past a few hundred tokens that read is the attention's
cost. This times one step's worth of ``torch.ops.inflightq.paged_decode`` calls (one per layer,
each layer its own cache) for each batch x context case, with block tables in order (blocks
allocated one after another, as a fresh cache hands them out) and scattered (a random
permutation, as a long-running cache's free list does), interleaved round by round with one
``torch.sum`` over as many bytes on the same threads (the floor). Before timing, each case's
first layer is checked against a float64 softmax(q.k) @ v over the same tokens, so a fast wrong
kernel cannot pass for a fast one. The shapes default to the default model's (SmolLM2-135M:
30 layers, 9 query and 3 key/value heads of 64).

    python -m bench.attention --cases 1x192,1x1024,1x4096,8x512,32x224,32x1024 --out bench/results --tag X
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.results_files import pyplot, run_header, save, stem, write_figure
from worker.engine.core.memory import anonymous_memory
from worker.engine.model.hardware import DTYPES

TABLES = ("in order", "scattered")
FLOOR = "K/V read"


def _case(
    batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype, generator: torch.Generator
) -> dict[str, Any]:
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    slots = num_blocks * args.block_size
    shape = (args.kv_heads, slots, args.head_dim)

    def cache() -> torch.Tensor:
        values = torch.randn(shape, generator=generator).to(dtype)
        if args.pages == "4k":  # as the engine's KV cache is (memory.lazy_zeros)
            return values
        return anonymous_memory(values.numel(), dtype, huge_pages=True).view(shape).copy_(values)

    caches = [(cache(), cache()) for _ in range(args.layers)]
    tables = {
        "in order": torch.arange(num_blocks).view(batch, blocks_per_seq),
        "scattered": torch.randperm(num_blocks, generator=generator).view(batch, blocks_per_seq),
    }
    return {
        "caches": caches,
        "tables": tables,
        "lens": torch.full((batch,), context, dtype=torch.long),
        "query": torch.randn(batch, args.heads, args.head_dim, generator=generator).to(dtype),
        "out": torch.empty(batch, args.heads, args.head_dim, dtype=dtype),
    }


def _step(case: dict[str, Any], table: str, block_size: int, scale: float) -> Callable[[], None]:
    blocks = case["tables"][table]

    def run() -> None:
        for k_cache, v_cache in case["caches"]:
            torch.ops.inflightq.paged_decode(
                case["query"], k_cache, v_cache, blocks, case["lens"], block_size, scale, case["out"]
            )

    return run


def _error(case: dict[str, Any], table: str, block_size: int, scale: float) -> float:
    """Largest difference between the kernel's first layer and float64 attention over the same tokens."""
    k_cache, v_cache = case["caches"][0]
    blocks, query, out = case["tables"][table], case["query"], case["out"]
    torch.ops.inflightq.paged_decode(query, k_cache, v_cache, blocks, case["lens"], block_size, scale, out)
    context = int(case["lens"][0])
    heads, kv_heads = query.shape[1], k_cache.shape[0]
    worst = 0.0
    for b in range(query.shape[0]):
        slots = (blocks[b].unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)[:context]
        k = k_cache[:, slots].double().repeat_interleave(heads // kv_heads, 0)  # [Hq, L, D]
        v = v_cache[:, slots].double().repeat_interleave(heads // kv_heads, 0)
        q = query[b].double().unsqueeze(1)  # [Hq, 1, D]
        expected = torch.softmax(q @ k.transpose(1, 2) * scale, -1) @ v
        worst = max(worst, (out[b].double() - expected.squeeze(1)).abs().max().item())
    return worst


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.attention", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1x192,1x1024,1x4096,8x512,32x224,32x1024", help="BATCHxCONTEXT,...")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    pages_help = "the caches in 4 KB pages (the engine's) or advised 2 MB ones"
    parser.add_argument("--pages", default="4k", choices=["4k", "2m"], help=pages_help)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    from worker.engine.model.kernels.cpu_kernel import paged_decode_available

    if not paged_decode_available():
        raise SystemExit("the CPU attention kernel did not build (no C++ compiler?)")
    dtype = DTYPES[args.dtype]
    scale = args.head_dim**-0.5
    generator = torch.Generator().manual_seed(0)
    element = torch.empty(0, dtype=dtype).element_size()
    results = []
    for spec in args.cases.split(","):
        batch, context = (int(part) for part in spec.split("x"))
        case = _case(batch, context, args, dtype, generator)
        kv_bytes = 2 * args.layers * batch * context * args.kv_heads * args.head_dim * element
        floor = torch.ones(max(kv_bytes // 4, 1))
        errors = {table: _error(case, table, args.block_size, scale) for table in TABLES}
        calls: dict[str, Callable[[], None]] = {t: _step(case, t, args.block_size, scale) for t in TABLES}
        calls[FLOOR] = floor.sum  # type: ignore[assignment]
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():
            call()  # warm: first touches, page faults
        for round_index in range(args.rounds):
            order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
            for name in order:
                started = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - started)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row = {
            "batch": batch,
            "context": context,
            "kv_mb": round(kv_bytes / 1e6, 1),
            "ms": {name: round(v, 3) for name, v in ms.items()},
            "gb_s": {name: round(kv_bytes / v / 1e6, 1) for name, v in ms.items()},
            "over_read": {t: round(ms[t] / ms[FLOOR], 2) for t in TABLES},
            "max_error": {t: float(f"{errors[t]:.3g}") for t in TABLES},
        }
        results.append(row)
        print(json.dumps(row), flush=True)
        del case, floor
    report = {
        **run_header("bench.attention", argv),
        "dtype": args.dtype,
        "pages": args.pages,
        "shape": {k: getattr(args, k) for k in ("layers", "heads", "kv_heads", "head_dim", "block_size")},
        "cases": results,
    }
    if args.out:
        save(stem(args.out, "attention", report["date"], args.tag), report, markdown(report), plot)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    shape = report["shape"]
    lines = [
        f"# Decode attention over a model's layers, {report['date']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; {report['dtype']}, caches in {report['pages']} pages, "
        f"{shape['layers']} layers, {shape['heads']} query / "
        f"{shape['kv_heads']} key-value heads of {shape['head_dim']}, blocks of {shape['block_size']} tokens",
        "",
        "Median ms per step (one `paged_decode` per layer; interleaved round by round), GB/s of K/V read, and over",
        f"`{FLOOR}` (one `torch.sum` over as many bytes). Largest error against float64 attention in brackets.",
        "",
        "| batch x context | K/V MB | in order | scattered | K/V read |",
        "|---|---|---|---|---|",
    ]
    for row in report["cases"]:
        cells = [
            f"{row['ms'][t]} ms, {row['gb_s'][t]} GB/s ({row['over_read'][t]}x) [{row['max_error'][t]}]" for t in TABLES
        ]
        lines.append(
            f"| {row['batch']} x {row['context']} | {row['kv_mb']} | "
            + " | ".join(cells)
            + f" | {row['ms'][FLOOR]} ms, {row['gb_s'][FLOOR]} GB/s |"
        )
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{row['batch']}x{row['context']}" for row in report["cases"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, name in enumerate((*TABLES, FLOOR)):
        ax.bar(
            [x + (i - 1) * width for x in range(len(labels))],
            [row["gb_s"][name] for row in report["cases"]],
            width,
            label=name,
        )
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("batch x context tokens")
    ax.set_ylabel("GB/s of K/V")
    ax.set_title(f"Decode attention ({report['dtype']}) against a read of the same bytes")
    ax.legend()
    write_figure(fig, path)


if __name__ == "__main__":
    main()
