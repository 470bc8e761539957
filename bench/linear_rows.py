"""A model's linears at each row count: oneDNN's packed matmul, ``decode_linear`` (and, on an AMX CPU,
``amx_linear``) and a read of the weights.

A decode step of B sequences multiplies every weight of the model by B rows. At a few rows that is a
read of the weights (the floor: ``weights read``, one ``torch.sum`` over as many bytes on the same
threads); past some row count the arithmetic or the kernel's own costs take over. This times the
default model's linears (its own weights, each layer's fused q/k/v and gate/up, the head) called one
after another at each row count, both kernels and the read interleaved round by round, and reports
each over the read. ``decode_linear`` takes 16 rows a call, so 32 rows are two calls. It is what the
engine's ``decode_rows`` threshold (the row count up to which ``decode_linear`` is used) rests on, and
how far the matmuls of a 8-32-sequence step are from the memory. Where ``amx_linear`` runs on tiles
(``tile_rows_for``), it is the third kernel (64 rows a call), and oneDNN's column has the tiles put
aside too: what ``TILE_ROWS`` rests on.

With ``--dtype float32`` it compares the packings an fp32 weight can get instead: oneDNN's, MKL's
(``cblas_sgemm_pack``) and the engine's choice between them on this CPU (``PackedLinear``'s own),
each a ``PackedLinear`` of the same fused weights (each layer's q/k/v and gate/up as one, o, down,
the head); what ``fast_linear.mkl_fp32_matmuls`` and ``MKL_MAX_OUT_FEATURES`` rest on.

    python -m bench.linear_rows --rows 1,4,8,16,32 --rounds 10 --out bench/results --tag X
    python -m bench.linear_rows --dtype float32 --rows 1,8,32,128,512 --out bench/results --tag X
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

KERNELS_BY_DTYPE = {
    "bfloat16": ("oneDNN packed", "decode_linear"),
    "float32": ("oneDNN packed", "MKL packed", "engine's choice"),
}
FLOOR = "weights read"
KERNEL_ROWS = 16  # decode_linear's most rows a call
AMX = "amx_linear"


def _calls(model: Any, rows: int) -> dict[str, Callable[[], None]]:
    """One pass over the model's linears at ``rows`` rows, per kernel, each through the engine's own
    ``PackedLinear``: with its layouts put aside it takes oneDNN (as ``bench.step_ab`` switches them),
    with its decode layout decode_linear (16 rows a call), with its tiles alone amx_linear (64)."""
    from worker.engine.model.fast_linear import TILE_ROWS, decode_layouts_in_order

    linears = decode_layouts_in_order(model)
    layouts = [(linear.laid_out, linear.tiles) for linear in linears]
    inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {linear.in_features for linear in linears}}

    def through(keep_tiles: bool, per_call: int) -> Callable[[], None]:
        def run() -> None:  # 121 attribute sets around 121 matmuls: well under 1% of a pass
            for linear in linears:
                linear.laid_out = None
                linear.tiles = linear.tiles if keep_tiles else None
            try:
                for linear in linears:
                    x = inputs[linear.in_features]
                    for first in range(0, rows, per_call):
                        linear(x[first : first + per_call])
            finally:
                for linear, (laid_out, tiles) in zip(linears, layouts, strict=True):
                    linear.laid_out, linear.tiles = laid_out, tiles

        return run

    def decode() -> None:
        for linear in linears:
            x = inputs[linear.in_features]
            for first in range(0, rows, KERNEL_ROWS):
                linear(x[first : first + KERNEL_ROWS])

    calls = {"oneDNN packed": through(False, rows), "decode_linear": decode}
    if all(linear.tiles is not None for linear in linears):
        calls[AMX] = through(True, TILE_ROWS)
    return calls


def _fp32_weights(model: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each matmul of an fp32 model's step, once, in the forward's order: sibling projections fused
    (``fuse_sibling_projections``, as the engine does), then every other linear."""
    from worker.engine.model.fused_projections import fuse_sibling_projections

    fuse_sibling_projections(model, pack=False)
    weights: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    seen: set[int] = set()
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        group = getattr(module.__dict__.get("forward"), "group", None)
        owner = group if group is not None else module
        if id(owner) not in seen:
            seen.add(id(owner))
            weights.append((owner.weight.detach(), owner.bias))
    return weights


def _fp32_packings(weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> dict[str, list[Any]]:
    """Each fp32 kernel's ``PackedLinear`` of every weight, made once for all row counts."""
    from worker.engine.model.fast_linear import PackedLinear

    choices = {"oneDNN packed": False, "MKL packed": True, "engine's choice": None}
    return {name: [PackedLinear(w, b, mkl=mkl) for w, b in weights] for name, mkl in choices.items()}


def _fp32_calls(packings: dict[str, list[Any]], rows: int) -> dict[str, Callable[[], None]]:
    first = next(iter(packings.values()))
    inputs = {k: torch.randn(rows, k) for k in {linear.in_features for linear in first}}
    calls = {}
    for name, linears in packings.items():

        def run(linears: list[Any] = linears) -> None:
            for linear in linears:
                linear(inputs[linear.in_features])

        calls[name] = run
    return calls


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.linear_rows", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--rounds", type=int, default=10, help="passes per kernel and row count")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(KERNELS_BY_DTYPE))
    args = parser.parse_args(argv)
    from worker.engine import EngineConfig, LLMEngine
    from worker.engine.model import model_runner as runner_module
    from worker.engine.model.fast_linear import decode_layouts_in_order
    from worker.engine.model.model_loader import load_model

    kernels = KERNELS_BY_DTYPE[args.dtype]
    if args.dtype == "float32":
        model, _ = load_model(args.model, torch.float32, "cpu")
        weights = _fp32_weights(model)
        packings = _fp32_packings(weights)
        count = len(weights)
        weight_bytes = sum(w.numel() * w.element_size() for w, _ in weights)
    else:
        model, tokenizer = load_model(args.model, torch.bfloat16, "cpu")
        # Every bf16 linear laid out for decode_linear, whatever this CPU's threshold, so both kernels run.
        threshold = runner_module.decode_rows_for
        runner_module.decode_rows_for = lambda dtype: KERNEL_ROWS  # type: ignore[assignment]
        try:
            LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=64))
        finally:
            runner_module.decode_rows_for = threshold  # type: ignore[assignment]
        linears = decode_layouts_in_order(model)
        if not linears:
            raise SystemExit("no linear was laid out for decode_linear: the CPU kernels did not build")
        if all(linear.tiles is not None for linear in linears):  # an AMX CPU: amx_linear's tiles too
            kernels = (*kernels, AMX)
        count = len(linears)
        weight_bytes = sum(linear.laid_out.numel() * linear.laid_out.element_size() for linear in linears)  # type: ignore[union-attr]
    buffer = torch.ones(max(weight_bytes // 4, 1))
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        calls = _fp32_calls(packings, rows) if args.dtype == "float32" else _calls(model, rows)
        times: dict[str, list[float]] = {name: [] for name in (*kernels, FLOOR)}
        for name in kernels:
            calls[name]()  # warm: oneDNN builds its kernel for this shape on the first call
        for round_index in range(args.rounds):
            order = list(kernels) if round_index % 2 == 0 else list(reversed(kernels))
            for name in (FLOOR, *order):
                started = time.perf_counter()
                buffer.sum() if name == FLOOR else calls[name]()
                times[name].append(time.perf_counter() - started)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row = {
            "rows": rows,
            "ms": {name: round(v, 2) for name, v in ms.items()},
            "over_weights_read": {name: round(ms[name] / ms[FLOOR], 2) for name in kernels},
            "weights_read_gb_s": round(weight_bytes / ms[FLOOR] / 1e6, 1),
        }
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    report = {
        **run_header("bench.linear_rows", argv),
        "model": args.model,
        "dtype": args.dtype,
        "kernels": list(kernels),
        "linears": count,
        "weight_bytes": weight_bytes,
        "rows": rows_out,
    }
    if args.out:
        save(stem(args.out, "linear-rows", report["date"], args.tag), report, markdown(report), plot)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    kernels = report["kernels"]
    lines = [
        f"# A model's linears by row count, {report['date']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; model `{report['model']}`, {report['dtype']}, {report['linears']} linears, "
        f"{report['weight_bytes'] / 1e6:.0f} MB",
        "",
        f"Median ms per pass over every linear (interleaved round by round), and over `{FLOOR}` (one read of",
        "as many bytes on the same threads):",
        "",
        "| rows | " + " | ".join(kernels) + f" | {FLOOR} (GB/s) |",
        "|---|" + "---|" * (len(kernels) + 1),
    ]
    for row in report["rows"]:
        cells = [f"{row['ms'][k]} ({row['over_weights_read'][k]}x)" for k in kernels]
        lines.append(
            f"| {row['rows']} | " + " | ".join(cells) + f" | {row['ms'][FLOOR]} ({row['weights_read_gb_s']}) |"
        )
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [row["rows"] for row in report["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in (*report["kernels"], FLOOR):
        ax.plot(rows, [row["ms"][name] for row in report["rows"]], marker="o", label=name)
    ax.set_xlabel("rows (sequences in a decode step)")
    ax.set_ylabel("ms per pass over the model's linears")
    ax.set_title(f"Linears by row count ({report['dtype']})")
    ax.set_ylim(bottom=0)
    ax.legend()
    write_figure(fig, path)


if __name__ == "__main__":
    main()
