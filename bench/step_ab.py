"""What each CPU kernel of the decode step is worth: one engine, its decode steps interleaved.

The default model is loaded once into an engine with every CPU kernel on. At each batch size,
decode steps then alternate between variants that switch kernels off in place (the same
weights, KV cache and sequences):

- ``all``: the default;
- ``each layer from Python``: ``decode_forward`` calls each layer's one op instead of all layers in
  one ``decode_layers`` call;
- ``layouts apart``: the decode layouts in allocations of their own, as the engine held them before
  ``gather_decode_layouts``;
- ``4 KB pages``: the gathered buffer copied, offsets kept, into memory advised against huge pages;
- ``no decode forward``: transformers' model forward around the layers instead of
  ``decode_forward``'s loop;
- ``no one-op layer``: the fused layer's ops called one by one from Python instead of
  ``decode_layer``;
- ``no decode_linear``: small bf16 matmuls back on oneDNN;
- ``no amx_linear``: matmuls of a few dozen rows back on oneDNN (AMX CPUs; elsewhere the same as ``all``);
- ``no fused layers``: transformers' decoder layers over the fused projections and norms;
- ``neither``.

Interleaving step by step puts every variant under the same machine noise; each figure is a
median over ``--steps`` steps per variant, and every ratio is against ``neither`` in the same run.

Beside the variants, in the same rotation, ``weights read`` times one read of as many bytes as the
step's matmul weights hold (one contiguous buffer, summed by torch on the same threads): at a few
rows a decode step is a stream of its weights, so that is the floor any engine's step has on this
machine at that moment, and ``all / weights read`` is how far above it ours is.

    python -m bench.step_ab --dtype bfloat16 --batches 1,4,8,32 --steps 30 --out bench/results --tag X
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

VARIANTS = (
    "all",
    "each layer from Python",
    "layouts apart",
    "4 KB pages",
    "no decode forward",
    "no one-op layer",
    "no decode_linear",
    "no amx_linear",
    "no fused layers",
    "neither",
)
FLOOR = "weights read"


def _tile_switch(model: Any) -> Callable[[bool], None]:
    """Sets ``amx_linear`` on/off for every linear of a built engine's model that has its tiles."""
    from worker.engine.model.fast_linear import packed_linears_in_order

    tiled = [(linear, linear.tiles) for linear in packed_linears_in_order(model) if linear.tiles is not None]

    def set_tiles(on: bool) -> None:
        for linear, tiles in tiled:
            linear.tiles = tiles if on else None

    return set_tiles


def _switches(model: Any) -> tuple[Callable[..., None], Callable[..., None], int, int, int]:
    """(set decode_linear on/off, set fused layers on/off (and their one op), how many of each, and the
    bytes of the weights laid out for decode_linear) for a built engine's model."""
    from worker.engine.model.fast_linear import PackedLinear, decode_layouts_in_order
    from worker.engine.model.fused_decoder_layer import FusedDecoderLayer

    linears: list[tuple[PackedLinear, torch.Tensor]] = [
        (linear, linear.laid_out) for linear in decode_layouts_in_order(model) if linear.laid_out is not None
    ]
    layers: list[tuple[torch.nn.Module, FusedDecoderLayer]] = []
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, FusedDecoderLayer):
            layers.append((module, forward))

    # Each layout copied into an allocation of its own, with one of the same size between them (the
    # oneDNN copy that PackedLinear packs just before it), as the engine held them before gathering.
    apart: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.empty_like(t), t.clone()) for _, t in linears]
    # The gathered buffer again, each layout at the same offset, in memory that asks for 4 KB pages.
    small_pages = _small_page_copies([t for _, t in linears])

    def set_linears(on: bool, gathered: bool = True, huge_pages: bool = True) -> None:
        for (linear, laid_out), (_, copy), small in zip(linears, apart, small_pages, strict=True):
            linear.laid_out = ((laid_out if huge_pages else small) if gathered else copy) if on else None

    def set_layers(on: bool, one_op: bool = True) -> None:
        for module, forward in layers:
            forward.one_op = one_op
            if on:
                module.forward = forward
            else:
                module.__dict__.pop("forward", None)

    weight_bytes = sum(laid_out.numel() * laid_out.element_size() for _, laid_out in linears)
    return set_linears, set_layers, len(linears), len(layers), weight_bytes


def _small_page_copies(layouts: list[torch.Tensor]) -> list[torch.Tensor]:
    from worker.engine.core.memory import anonymous_memory

    if not layouts:
        return []
    base = min(t.data_ptr() for t in layouts)
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in layouts)
    buffer = anonymous_memory((end - base) // 2, torch.bfloat16, huge_pages=False)
    copies = []
    for t in layouts:
        start = (t.data_ptr() - base) // t.element_size()
        copies.append(buffer[start : start + t.numel()].view(t.shape).copy_(t))
    return copies


def _weights_read(num_bytes: int) -> Callable[[], None]:
    """One read of ``num_bytes`` from a buffer that no cache holds (it is the size of the weights)."""
    buffer = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32)

    def read() -> None:
        buffer.sum()

    return read


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.step_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,4,8,32")
    parser.add_argument("--steps", type=int, default=30, help="decode steps per variant and batch size")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    from worker.engine import EngineConfig, LLMEngine, SamplingParams
    from worker.engine.model.model_loader import load_model

    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), "cpu")
    engine = LLMEngine(model, tokenizer, EngineConfig(num_kv_blocks=4096))
    set_linears, set_layers, num_linears, num_layers, weight_bytes = _switches(model)
    set_tiles = _tile_switch(model)
    read_weights = _weights_read(weight_bytes)
    prompt = tokenizer.encode("Tell me a long story about a brave mouse who sails the sea.")

    def switch_to(variant: str) -> None:
        """Every switch as ``variant`` sets it, in place (``all``: everything back on)."""
        set_linears(
            variant not in ("no decode_linear", "neither"),
            gathered=variant != "layouts apart",
            huge_pages=variant != "4 KB pages",
        )
        set_tiles(variant not in ("no amx_linear", "neither"))
        set_layers(variant not in ("no fused layers", "neither"), one_op=variant != "no one-op layer")
        decode_forward = engine.runner.decode_forward
        if decode_forward is not None:
            decode_forward.enabled = variant != "no decode forward"
            if decode_forward.all_layers is not None:
                decode_forward.all_layers.enabled = variant != "each layer from Python"

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = [f"{batch}-{i}" for i in range(batch)]
        for request_id in ids:
            params = SamplingParams(max_new_tokens=len(VARIANTS) * args.steps + 8, ignore_eos=True)
            engine.add_request(request_id, prompt, params)
        engine.step()  # the prefill
        engine.step()
        times: dict[str, list[float]] = {v: [] for v in (*VARIANTS, FLOOR)}
        for step in range(len(VARIANTS) * args.steps):
            variant = VARIANTS[(step + step // len(VARIANTS)) % len(VARIANTS)]  # rotate the order each round
            if step % len(VARIANTS) == 0:  # once a round, under the same noise as the round's steps
                started = time.perf_counter()
                read_weights()
                times[FLOOR].append(time.perf_counter() - started)
            switch_to(variant)
            started = time.perf_counter()
            engine.step()
            times[variant].append(time.perf_counter() - started)
        switch_to("all")
        for request_id in ids:
            engine.abort(request_id)
        medians = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        row = {
            "batch": batch,
            "step_ms": {v: round(m, 2) for v, m in medians.items()},
            "speedup_vs_neither": {v: round(medians["neither"] / medians[v], 2) for v in VARIANTS},
            "all_vs_weights_read": round(medians["all"] / medians[FLOOR], 2),
            "weights_read_gb_s": round(weight_bytes / medians[FLOOR] / 1e6, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        **run_header("bench.step_ab", argv),
        "model": args.model,
        "dtype": args.dtype,
        "rerouted": {"decode_linear weights": num_linears, "fused decoder layers": num_layers},
        "weight_bytes": weight_bytes,
        "rows": rows,
    }
    if args.out:
        save(stem(args.out, "step-ab", report["date"], args.tag), report, markdown(report), plot)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"# Decode step with and without the CPU kernels, {report['date']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; model `{report['model']}`, {report['dtype']}; rerouted: {report['rerouted']}",
        "",
        "Median ms per decode step (variants interleaved step by step in one engine), and speed-up over `neither`;",
        f"`{FLOOR}`: one read of the step's {report['weight_bytes'] / 1e6:.0f} MB of matmul weights on the same",
        "threads, in the same rotation (the floor of a step at a few rows), and `all` over it:",
        "",
        "| batch | " + " | ".join(VARIANTS) + f" | {FLOOR} (GB/s) | all / {FLOOR} |",
        "|---|" + "---|" * (len(VARIANTS) + 2),
    ]
    for row in report["rows"]:
        cells = [f"{row['step_ms'][v]} ({row['speedup_vs_neither'][v]}x)" for v in VARIANTS]
        cells += [f"{row['step_ms'][FLOOR]} ({row['weights_read_gb_s']})", f"{row['all_vs_weights_read']}x"]
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    batches = [row["batch"] for row in report["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = (*VARIANTS, FLOOR)
    width = 0.8 / len(bars)
    for i, variant in enumerate(bars):
        xs = [b + (i - (len(bars) - 1) / 2) * width for b in range(len(batches))]
        ax.bar(xs, [row["step_ms"][variant] for row in report["rows"]], width, label=variant)
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("sequences in the decode step")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"Decode step, CPU kernels on and off ({report['dtype']})")
    ax.legend()
    write_figure(fig, path)


if __name__ == "__main__":
    main()
