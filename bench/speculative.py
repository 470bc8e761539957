"""Speculative decoding from the sequence's own n-grams: our engine with and without it, same run.

One engine on the default model serves both sides: each request says ``speculate`` (on or off),
so the two share the weights, the caches and the machine's state.
Two workloads, greedy, each at 1 stream (one request at a time) and at 8 streams (8 at once),
the two sides alternating chunk by chunk:

- grounded: extraction, quoting summaries, code edits and JSON conversion whose answers copy
  their input, the traffic n-gram speculation is for;
- chat: the engine benchmark's ordinary questions, whose answers rarely copy (the adaptive pause
  should leave them as fast as without speculation).

Reports tokens/s of each side and their ratio, the share of proposed tokens kept and the tokens
each sequence gained per step. Peers' own lookup decoding (llama.cpp) runs only where
``bench/peers/install.sh`` installed it; its absence is recorded.

    python -m bench.speculative            # or: inflightq bench speculative
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from bench.engine import QUESTIONS
from bench.results_files import pyplot, run_header, save, stem, write_figure

GROUNDED = [
    "Extract every email address from the text below and list them one per line.\n\nText: For billing questions "
    "write to billing@northwind-supplies.com; technical issues go to support.team@northwind-supplies.com, and "
    "press enquiries to media-relations@northwind-supplies.com. Our CEO, Dana Whitfield, can be reached at "
    "dana.whitfield@northwind-supplies.com, and the office manager at office.manager@northwind-supplies.com.",
    "Rewrite this Python function so the variable `tmp` is called `total`. Change nothing else.\n\n"
    "def sum_prices(items):\n    tmp = 0\n    for item in items:\n        if item.price > 0:\n"
    "            tmp += item.price * item.quantity\n    return tmp\n",
    "Convert this list into a JSON array of objects with the keys name, city and age.\n\n"
    "Alice Johnson, Seattle, 34\nBob Martinez, Denver, 41\nCarla Nguyen, Austin, 29\nDavid Okafor, Boston, 52",
    "Quote the sentence from the passage that says when the bridge was opened.\n\nPassage: The Golden Gate "
    "Bridge spans the strait between San Francisco Bay and the Pacific Ocean. Construction began in January "
    "1933. The bridge was opened to vehicles on May 28, 1937, after four years of work. At the time it was the "
    "longest suspension bridge in the world.",
    "Fix the spelling mistakes in this paragraph and return the corrected paragraph.\n\nThe comittee will "
    "meet on Tuesday to discus the new budjet. Every member should bring there notes from the last meeting, "
    "and the secretery will send the agenda by Monday evening.",
    "Summarise the following meeting notes as a bulleted list, keeping the original wording.\n\n"
    "- The launch date moves to March 14.\n- Marketing prepares the press release by March 1.\n"
    "- Engineering fixes the login bug before the launch.\n- Sales trains the support team in February.",
    "Add type hints to this function and return the whole function.\n\n"
    "def greet(name, times):\n    message = 'Hello, ' + name + '!'\n    return [message for _ in range(times)]\n",
    "List the product names mentioned in this review, exactly as written.\n\nReview: I replaced my old "
    "Acme PowerBlend 3000 with the Vitamix Explorian E310, and paired it with the Ninja Professional Plus "
    "food processor. The KitchenAid Artisan stand mixer stays, of course.",
]

STREAMS = (1, 8)


def chat_prompts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out


def run_chunk(llm: Any, prompts: list[list[int]], max_new: int, speculate: bool) -> dict:
    """``prompts`` at once (one stream each); tokens, wall time and the chunk's counters."""
    from worker.engine import SamplingParams

    stats = llm.engine.stats

    def counters() -> tuple[int, int, int, int]:
        return stats.generated_tokens, stats.token_steps, stats.draft_tokens, stats.draft_accepted_tokens

    before = counters()
    started = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=max_new, speculate=speculate))
    elapsed = time.perf_counter() - started
    generated, steps, proposed, kept = (a - b for a, b in zip(counters(), before, strict=True))
    return {
        "tokens": sum(len(o.token_ids) for o in outs),
        "seconds": elapsed,
        "generated": generated,
        "steps": steps,
        "proposed": proposed,
        "accepted": kept,
    }


def merge(runs: list[dict]) -> dict:
    total = {
        key: sum(r[key] for r in runs) for key in ("tokens", "seconds", "generated", "steps", "proposed", "accepted")
    }
    return {
        "tokens": total["tokens"],
        "seconds": round(total["seconds"], 3),
        "tok_s": round(total["tokens"] / total["seconds"], 2),
        "tokens_per_step": round(total["generated"] / total["steps"], 3) if total["steps"] else 0.0,
        "proposed": total["proposed"],
        "accepted": total["accepted"],
        "acceptance": round(total["accepted"] / total["proposed"], 3) if total["proposed"] else None,
    }


def peers_note() -> str:
    cache = os.environ.get("INFLIGHTQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inflightq"
    )
    peers = Path(os.environ.get("INFLIGHTQ_PEERS_DIR") or os.path.join(cache, "peers"))
    server = peers / "llamacpp" / "bin" / "llama-server"
    if server.is_file():
        return f"llama.cpp found at {server}; its lookup decoding is not driven by this benchmark yet"
    return f"no llama.cpp build at {server} (bench/peers/install.sh llamacpp): peers not measured"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="inflightq bench speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two sides per cell")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload (cycled)")
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--out", default="bench/results", help="folder for speculative-<date>.*; '' to skip")
    parser.add_argument("--tag", default="", help="suffix of the results files' names")
    args = parser.parse_args(argv)
    header = run_header("bench.speculative", argv)

    from worker.engine import LLM

    llm = LLM(args.model, dtype=args.dtype, speculative_tokens=args.speculative_tokens, max_num_seqs=max(STREAMS))
    tokenizer = llm.tokenizer
    workloads = {
        "grounded": chat_prompts(tokenizer, [GROUNDED[i % len(GROUNDED)] for i in range(args.prompts)]),
        "chat": chat_prompts(tokenizer, [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]),
    }
    # Warm-up: first-call costs out of the timings, steps with draft rows (of 1 and 2 sequences) included.
    run_chunk(llm, workloads["grounded"][-2:], 16, True)
    run_chunk(llm, workloads["grounded"][-1:], 16, True)
    cells = []
    for name, prompts in workloads.items():
        for streams in STREAMS:
            # The sides alternate chunk by chunk (and which goes first, too): a neighbour's load on a
            # shared machine falls on both alike.
            sides: dict[bool, list[dict]] = {False: [], True: []}
            chunks = [prompts[i : i + streams] for i in range(0, len(prompts), streams)] * args.rounds
            for c, chunk in enumerate(chunks):
                for speculate in (False, True) if c % 2 == 0 else (True, False):
                    sides[speculate].append(run_chunk(llm, chunk, args.max_new_tokens, speculate))
            off, on = merge(sides[False]), merge(sides[True])
            cell = {
                "workload": name,
                "streams": streams,
                "off": off,
                "on": on,
                "ratio": round(on["tok_s"] / off["tok_s"], 3),
            }
            cells.append(cell)
            print(
                f"{name:9s} {streams} stream(s): off {off['tok_s']:7.1f} tok/s, on {on['tok_s']:7.1f} tok/s "
                f"({cell['ratio']:.2f}x), kept {on['acceptance']}, tokens/step {on['tokens_per_step']:.2f}",
                flush=True,
            )
    results = {
        **header,
        "model": args.model,
        "dtype": str(next(llm.engine.model.parameters()).dtype).removeprefix("torch."),
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "speculative_tokens": args.speculative_tokens,
        "cells": cells,
        "peers": peers_note(),
    }
    if args.out:
        markdown = [
            "# Speculative decoding (n-gram), our engine with and without, same run",
            "",
            f"`{header['command']}` — {header['date']}, {header['machine']}",
            "",
            "| workload | streams | off tok/s | on tok/s | on / off | kept / proposed | tokens / step |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {c['workload']} | {c['streams']} | {c['off']['tok_s']} | {c['on']['tok_s']} | {c['ratio']}x | "
                f"{c['on']['acceptance']} | {c['on']['tokens_per_step']} |"
                for c in cells
            ),
            "",
            f"Peers: {results['peers']}.",
        ]
        save(stem(args.out, "speculative", header["date"], args.tag), results, markdown, plot)
    return results


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    cells = results["cells"]
    labels = [f"{c['workload']}\n{c['streams']} stream{'s' if c['streams'] > 1 else ''}" for c in cells]
    ax.bar(labels, [c["ratio"] for c in cells], color=["tab:green" if c["ratio"] >= 1 else "tab:red" for c in cells])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("tokens/s, speculation on / off")
    ax.set_title("n-gram speculative decoding, same run")
    write_figure(fig, path)


if __name__ == "__main__":
    main()
