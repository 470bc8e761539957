"""Which dtype ``auto`` should pick on this CPU: our engine in bf16 and in fp32, interleaved.

``worker.engine.model.hardware.resolve_dtype`` picks bf16 on a CPU where bf16 is faster than fp32.
That depends on more than the bf16 units: on a CPU with AVX-512 but no AVX512-BF16 the engine's
decode steps read bf16 weights through ``decode_linear`` (half the bytes of fp32), while larger
matmuls run in fp32 on an upcast copy. This runs both dtypes of the
default model in one process, round by round in alternating order, on three loads: one stream
(a 128-token prompt, 64 new tokens: the time per token a single user sees), eight streams at
once, and the engine benchmark's 32-request burst (``bench.engine``'s workload). Every figure is
a median over the rounds, every ratio bf16 / fp32 from the same rounds.

    python -m bench.dtype_ab --rounds 3 --out bench/results --tag X
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.engine import workload
from bench.results_files import machine, pyplot, save, stem, write_figure

DTYPES = ("bfloat16", "float32")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def loads(tokenizer: Any, args: argparse.Namespace) -> dict[str, tuple[list[list[int]], list[int]]]:
    """Name -> (prompts, new tokens per prompt). Synthetic prompts are distinct token runs, so no
    request finds another's blocks in the prefix cache."""
    vocab = tokenizer.vocab_size

    def synthetic(count: int, offset: int) -> list[list[int]]:
        return [[(offset + 7919 * i + j) % (vocab - 100) + 100 for j in range(args.input_len)] for i in range(count)]

    return {
        "1 stream": (synthetic(1, 0), [args.output_len]),
        "8 streams": (synthetic(8, 1), [args.output_len] * 8),
        f"{args.burst}-request burst": workload(tokenizer, args.burst, seed=0),
    }


def run(llm: Any, prompts: list[list[int]], lengths: list[int]) -> dict[str, float]:
    from worker.engine import SamplingParams

    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    # Per stream: the wall time over the longest request's new tokens (its prefill included).
    return {"tok_per_s": tokens / wall, "ms_per_token_per_stream": 1000 * wall / max(lengths)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.dtype_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--burst", type=int, default=32, help="requests of the burst load")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    from worker.engine import LLM, SamplingParams
    from worker.engine.model.hardware import resolve_dtype

    # No prefix caching: no round reuses another's KV blocks.
    llms = {
        name: LLM(args.model, dtype=name, device="cpu", max_num_seqs=max(args.burst, 8), enable_prefix_caching=False)
        for name in DTYPES
    }
    for llm in llms.values():  # first-call costs (kernel loads, allocator) outside the rounds
        llm.generate([[100, 200, 300]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for load, (prompts, lengths) in loads(llms[DTYPES[0]].engine.tokenizer, args).items():
        runs[load] = {name: [] for name in DTYPES}
        for round_ in range(args.rounds):
            for name in DTYPES if round_ % 2 == 0 else DTYPES[::-1]:
                runs[load][name].append(run(llms[name], prompts, lengths))
        print(load, {name: [round(r["tok_per_s"], 1) for r in rs] for name, rs in runs[load].items()}, flush=True)
    rows = []
    for load, by_dtype in runs.items():
        row: dict[str, Any] = {"load": load}
        for name, rs in by_dtype.items():
            row[name] = {key: round(statistics.median(r[key] for r in rs), 2) for key in rs[0]}
            row[name]["rounds_tok_per_s"] = [round(r["tok_per_s"], 1) for r in rs]
        row["bf16_vs_fp32"] = round(row["bfloat16"]["tok_per_s"] / row["float32"]["tok_per_s"], 3)
        rows.append(row)
    report = {
        "command": "python -m bench.dtype_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{machine()}, {cpu_model()}",
        "auto_picks": str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
        "rows": rows,
    }
    lines = [
        f"# bf16 vs fp32, our engine, interleaved ({report['date']})",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}  ",
        f"`auto` picks: {report['auto_picks']}",
        "",
        "| load | bf16 tok/s | fp32 tok/s | bf16 / fp32 | ms per token, a stream (bf16; fp32) | rounds (bf16; fp32) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        bf, fp = row["bfloat16"], row["float32"]
        lines.append(
            f"| {row['load']} | {bf['tok_per_s']} | {fp['tok_per_s']} | {row['bf16_vs_fp32']}x"
            f" | {bf['ms_per_token_per_stream']}; {fp['ms_per_token_per_stream']}"
            f" | {bf['rounds_tok_per_s']}; {fp['rounds_tok_per_s']} |"
        )
    save(stem(args.out, "dtype-ab", report["date"], args.tag), report, lines, plot)
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    if (plt := pyplot()) is None:
        return
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    for offset, name in ((-0.2, "bfloat16"), (0.2, "float32")):
        ax.bar([x + offset for x in xs], [r[name]["tok_per_s"] for r in rows], width=0.4, label=name)
    ax.set_xticks(list(xs), [r["load"] for r in rows])
    ax.set_ylabel("output tok/s (median of rounds)")
    ax.set_title(f"our engine by dtype (auto: {report['auto_picks']})")
    ax.legend()
    write_figure(fig, path)


if __name__ == "__main__":
    main()
