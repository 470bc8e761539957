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
each sequence gained per step. ``--stack``: the same cells through the API and a worker
(``bench/speculative_stack.py``); ``--peers llamacpp``: llama.cpp's server without and with its own
lookup decoding (``bench/speculative_peers.py``), where ``bench/peers/install.sh`` installed it (its
absence is recorded).

    python -m bench.speculative [--stack] [--peers llamacpp]     # or: inflightq bench speculative
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from bench.engine import QUESTIONS
from bench.results_files import pyplot, run_header, save, stem, write_figure
from bench.speculative_cells import alternating_cells

# Each answer of the default model (greedy) copies most of its tokens from its prompt: tasks whose
# answers it paraphrases or invents (a rename it refuses, a JSON edit it echoes unchanged) are not
# this workload, whatever the prompt asks. `copy_ceiling` below reports what the answers allow.
GROUNDED = [
    "Extract every email address from the text below and list them one per line.\n\nText: For billing questions "
    "write to billing@northwind-supplies.com; technical issues go to support.team@northwind-supplies.com, and "
    "press enquiries to media-relations@northwind-supplies.com. Our CEO, Dana Whitfield, can be reached at "
    "dana.whitfield@northwind-supplies.com, and the office manager at office.manager@northwind-supplies.com.",
    "Summarise the following meeting notes as a bulleted list, keeping the original wording.\n\n"
    "- The launch date moves to March 14.\n- Marketing prepares the press release by March 1.\n"
    "- Engineering fixes the login bug before the launch.\n- Sales trains the support team in February.",
    "Summarise these release notes as a bulleted list, keeping the original wording.\n\n- Added dark mode to "
    "the settings page.\n- Fixed a crash when uploading files larger than 2 GB.\n- The search bar now remembers "
    "your last ten queries.\n- Removed the deprecated export to XLS.",
    "List the steps of this recipe as a numbered list, keeping the original wording.\n\nPreheat the oven to 200 "
    "degrees. Mix the flour, sugar and butter in a large bowl. Add two eggs and stir until smooth. Pour the "
    "batter into a greased tin. Bake for 25 minutes until golden brown.",
    "Extract the lines of this log that contain ERROR, exactly as written.\n\n2024-03-01 10:00:01 INFO Server "
    "started on port 8080\n2024-03-01 10:00:05 ERROR Database connection refused: host db-primary\n2024-03-01 "
    "10:00:09 INFO Retrying connection\n2024-03-01 10:00:12 ERROR Database connection refused: host "
    "db-replica\n2024-03-01 10:00:20 INFO Connected to db-primary",
    "Remove the comments from this Python code and return the code.\n\ndef area(width, height):\n    # compute "
    "the area of a rectangle\n    result = width * height  # multiply\n    return result\n\ndef "
    "perimeter(width, height):\n    # compute the perimeter\n    return 2 * (width + height)\n",
    "Convert these bullet points to a numbered list.\n\n- Open the app and sign in with your account.\n- Go to "
    "the billing page from the main menu.\n- Choose the plan you want and enter your card details.\n- Confirm "
    "the payment and wait for the receipt email.",
    "Copy the second paragraph of the text below.\n\nThe library opens at nine in the morning and closes at six "
    "in the evening on weekdays.\n\nOn Saturdays the library opens at ten and closes at four, and it is closed "
    "on Sundays and public holidays.\n\nMembership is free for residents of the city.",
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
        "answers": [(list(p), list(o.token_ids)) for p, o in zip(prompts, outs, strict=True)],
    }


def copy_ceiling(answers: list[tuple[list[int], list[int]]], num_tokens: int) -> float:
    """Tokens per sequence-step if every step proposed ``num_tokens`` tokens by the engine's n-gram
    lookup: what the answers themselves allow speculation to gain, whatever a step costs."""
    from worker.engine.core.speculation import SpeculationConfig, Speculator

    speculator = Speculator(SpeculationConfig(num_tokens=num_tokens))
    tokens_total = steps = 0
    for prompt, answer in answers:
        state, seen, done = speculator.new_state(), list(prompt), 0
        while done < len(answer):
            proposal = speculator.propose(state, seen, num_tokens)
            kept = 0
            while kept < len(proposal) and done + kept < len(answer) and proposal[kept] == answer[done + kept]:
                kept += 1
            gained = min(kept + 1, len(answer) - done)
            seen += answer[done : done + gained]
            done += gained
            steps += 1
        tokens_total += len(answer)
    return round(tokens_total / steps, 3) if steps else 0.0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="inflightq bench speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two sides per cell")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload (cycled)")
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--stack", action="store_true", help="each cell through the API and a worker too (the configured Redis)"
    )
    parser.add_argument(
        "--peers", default="", help="llamacpp: its server without and with its own lookup decoding, same cells"
    )
    parser.add_argument("--out", default="bench/results", help="folder for speculative-<date>.*; '' to skip")
    parser.add_argument("--tag", default="", help="suffix of the results files' names")
    args = parser.parse_args(argv)
    header = run_header("bench.speculative", argv)
    if args.stack or args.peers:
        from bench.serve import stop_on_sigterm

        stop_on_sigterm()  # a killed run still stops the stack and llama.cpp's servers it started

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

    async def chunk(prompts: list[list[int]], speculate: bool) -> dict:
        return run_chunk(llm, prompts, args.max_new_tokens, speculate)

    cells = []
    for cell, sides in asyncio.run(alternating_cells(workloads, STREAMS, args.rounds, chunk)):
        answers = [a for run in sides[False] for a in run["answers"]]
        cell["copy_ceiling"] = copy_ceiling(answers, args.speculative_tokens)
        print(f"  copy ceiling {cell['copy_ceiling']:.2f} tokens/step", flush=True)
        cells.append(cell)
    dtype = str(next(llm.engine.model.parameters()).dtype).removeprefix("torch.")
    stack_cells: list[dict] = []
    if args.stack:
        from bench.speculative_stack import run_stack

        del llm  # the worker loads its own copy
        texts = {
            "grounded": [GROUNDED[i % len(GROUNDED)] for i in range(args.prompts)],
            "chat": [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)],
        }
        stack_cells = run_stack(
            texts, STREAMS, args.rounds, args.max_new_tokens, args.speculative_tokens, args.model, dtype
        )
    peers: dict[str, Any] = {"llamacpp": {"skipped": "not asked for (--peers llamacpp)"}}
    if "llamacpp" in args.peers.split(","):
        from bench.speculative_peers import run_llamacpp

        texts = {
            "grounded": [GROUNDED[i % len(GROUNDED)] for i in range(args.prompts)],
            "chat": [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)],
        }
        peers["llamacpp"] = run_llamacpp(
            texts, STREAMS, args.rounds, args.max_new_tokens, args.speculative_tokens, args.model, dtype
        )
    results = {
        **header,
        "model": args.model,
        "dtype": dtype,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "speculative_tokens": args.speculative_tokens,
        "cells": cells,
        "stack_cells": stack_cells,
        "peers": peers,
    }
    if args.out:
        markdown = [
            "# Speculative decoding (n-gram), our engine with and without, same run",
            "",
            f"`{header['command']}` — {header['date']}, {header['machine']}",
            "",
            "| workload | streams | off tok/s | on tok/s | on / off | kept / proposed | tokens / step "
            "| copy ceiling, tokens / step |",
            "|---|---|---|---|---|---|---|---|",
            *(
                f"| {c['workload']} | {c['streams']} | {c['off']['tok_s']} | {c['on']['tok_s']} | {c['ratio']}x | "
                f"{c['on']['acceptance']} | {c['on']['tokens_per_step']} | {c['copy_ceiling']} |"
                for c in cells
            ),
            "",
            *(
                [
                    "",
                    "Through the whole stack (OpenAI chat route, one worker on Redis), the same cells:",
                    "",
                    "| workload | streams | off tok/s | on tok/s | on / off | kept / proposed | tokens / step |",
                    "|---|---|---|---|---|---|---|",
                    *(
                        f"| {c['workload']} | {c['streams']} | {c['off']['tok_s']} | {c['on']['tok_s']} | "
                        f"{c['ratio']}x | {c['on']['acceptance']} | {c['on']['tokens_per_step']} |"
                        for c in stack_cells
                    ),
                ]
                if stack_cells
                else []
            ),
            "",
            f"Copy ceiling: tokens per sequence-step were {args.speculative_tokens} tokens proposed at every "
            "step (the engine's n-gram lookup over the answers without speculation): what the answers allow.",
            "",
            *peer_lines(peers["llamacpp"]),
        ]
        save(stem(args.out, "speculative", header["date"], args.tag), results, markdown, plot)
    return results


def peer_lines(peer: dict) -> list[str]:
    if "cells" not in peer:
        return [f"llama.cpp's lookup decoding: {peer.get('skipped', 'not run')}."]
    return [
        f"{peer['label']}, without and with its lookup decoding (`{' '.join(peer['command'][-6:])}`), the same cells:",
        "",
        "| workload | streams | off tok/s | on tok/s | on / off | kept / proposed |",
        "|---|---|---|---|---|---|",
        *(
            f"| {c['workload']} | {c['streams']} | {c['off']['tok_s']} | {c['on']['tok_s']} | {c['ratio']}x | "
            f"{c['on']['acceptance']} |"
            for c in peer["cells"]
        ),
    ]


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
