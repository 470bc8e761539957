"""The speculative benchmark's cells, one per workload and stream count, the same for every system
it drives (our offline engine, our stack, llama.cpp's server): the prompts go in chunks of
``streams`` at once, and the two sides (speculation off and on) alternate chunk by chunk, which
goes first alternating too, so a neighbour's load on a shared machine falls on both alike."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

# (prompts of one chunk, speculate) -> that chunk's counts: tokens, seconds, generated, steps,
# proposed, accepted (and whatever else the system keeps, such as the answers)
Chunk = Callable[[list[Any], bool], Awaitable[dict]]
COUNTS = ("tokens", "seconds", "generated", "steps", "proposed", "accepted")


def merge(runs: list[dict]) -> dict:
    """One side's chunks as one figure: tokens/s over their wall time, tokens per sequence-step, and
    the share of proposed tokens kept."""
    total = {key: sum(r[key] for r in runs) for key in COUNTS}
    return {
        "tokens": total["tokens"],
        "generated": total["generated"],
        "seconds": round(total["seconds"], 3),
        "tok_s": round(total["tokens"] / total["seconds"], 2),
        "tokens_per_step": round(total["generated"] / total["steps"], 3) if total["steps"] else 0.0,
        "proposed": total["proposed"],
        "accepted": total["accepted"],
        "acceptance": round(total["accepted"] / total["proposed"], 3) if total["proposed"] else None,
    }


async def alternating_cells(
    workloads: dict[str, list[Any]], streams_list: tuple[int, ...], rounds: int, chunk: Chunk, label: str = ""
) -> list[tuple[dict, dict[bool, list[dict]]]]:
    """Each cell ({workload, streams, off, on, ratio}) with the chunks of its two sides."""
    cells = []
    for name, prompts in workloads.items():
        for streams in streams_list:
            sides: dict[bool, list[dict]] = {False: [], True: []}
            chunks = [prompts[i : i + streams] for i in range(0, len(prompts), streams)] * rounds
            for c, part in enumerate(chunks):
                for speculate in (False, True) if c % 2 == 0 else (True, False):
                    sides[speculate].append(await chunk(part, speculate))
            off, on = merge(sides[False]), merge(sides[True])
            cell = {"workload": name, "streams": streams, "off": off, "on": on}
            cell["ratio"] = round(on["tok_s"] / off["tok_s"], 3)
            print(
                f"{label}{name:9s} {streams} stream(s): off {off['tok_s']:7.1f} tok/s, on {on['tok_s']:7.1f} tok/s "
                f"({cell['ratio']:.2f}x), kept {on['acceptance']}, tokens/step {on['tokens_per_step']:.2f}",
                flush=True,
            )
            cells.append((cell, sides))
    return cells
