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

``--neighbours`` instead runs each engine at its defaults in a fresh process (started as a worker
starts: its threads sized when it loads), on an idle box, beside one process that keeps a core busy
(``python3 -c "while True: pass"``), and inside a cgroup whose CPU quota is one core less than the
box has (``--quota-cpus``; needs root and a writable cgroup tree, else that row says why it is
missing): our engine as the worker runs it (threads adapting to the CPUs left), ours with torch's
thread count fixed (as before it adapted), and transformers' continuous batching, interleaved round
by round in the same run.

    python -m bench.contention --neighbours --dtype bfloat16 --rounds 2 --out bench/results --tag neighbours
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from contextlib import AbstractContextManager, nullcontext
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


# --neighbours ---------------------------------------------------------------------------------------
ENGINES = ("ours", "ours-fixed", "transformers")
CONDITIONS = ("idle", "busy core", "cpu quota")
RESULT = "RESULT "  # the line a child run prints its figures on
ROOT = Path(__file__).resolve().parents[1]


class BusyCore:
    """One process that keeps a core busy while it lives."""

    def __enter__(self) -> BusyCore:
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.3)
        return self

    def __exit__(self, *_: object) -> None:
        self.process.kill()
        self.process.wait()


class CpuQuota:
    """A cgroup that allows ``cpus`` CPUs' worth of time per period (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``); a child joins it by writing its pid to ``procs``. Raises OSError where
    it cannot be made (no root, no writable cgroup tree, no cpu controller)."""

    PERIOD_US = 100_000

    def __init__(self, cpus: float, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.cpus, self.root = cpus, root
        self.path: Path | None = None

    def __enter__(self) -> CpuQuota:
        name, quota = f"inflightq-bench-{os.getpid()}", int(self.cpus * self.PERIOD_US)
        try:
            if (self.root / "cgroup.controllers").exists():  # v2
                (self.root / "cgroup.subtree_control").write_text("+cpu")
                self.path = self.root / name
                self.path.mkdir()
                (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
                return self
            bases = [self.root / n for n in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
            base = next((b for b in bases if (b / "cpu.cfs_quota_us").exists()), None)
            if base is None:
                raise OSError(f"no cpu controller under {self.root}")
            self.path = base / name
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError:
            self.__exit__()
            raise
        return self

    @property
    def procs(self) -> Path:
        assert self.path is not None
        return self.path / "cgroup.procs"

    def __exit__(self, *_: object) -> None:
        if self.path is not None and self.path.exists():
            try:
                self.path.rmdir()  # the child that joined it has exited
            except OSError as error:
                print(f"could not remove {self.path}: {error}", file=sys.stderr)


def child_run(args: argparse.Namespace) -> dict[str, Any]:
    """One engine on one burst, in this fresh process, as a worker would run it."""
    if args.join_cgroup:  # before the engine sizes its threads from the quota
        Path(args.join_cgroup).write_text(str(os.getpid()))
    from bench.serve_anchors import load_offline, offline_generate, transformers_cb, warm_up
    from bench.serve_dataset import synthetic_chat
    from shared.model_source import load_tokenizer
    from shared.settings import Settings

    dtype = getattr(torch, args.dtype)
    # ours: the worker's default (threads sized and adapting); ours-fixed: torch's own count, as before.
    fixed = torch.get_num_threads() if args.child == "ours-fixed" else 0
    settings = Settings(model=args.model, dtype=args.dtype, max_num_seqs=max(args.requests, 1), torch_threads=fixed)
    tokenizer = load_tokenizer(settings.model)
    lengths = {"input_len": (args.input_len, args.input_len), "output_len": (args.output_len, args.output_len)}
    samples = synthetic_chat(tokenizer, args.requests, seed=args.seed, **lengths)
    if args.child == "transformers":
        run = transformers_cb(settings, dtype, samples)
        return {"output_throughput": run["output_throughput"], "threads": torch.get_num_threads(), "changes": 0}
    llm = load_offline(settings, dtype)
    warm_up(llm, len(tokenizer))
    run = offline_generate(llm, samples)
    governor = llm.engine.cpu_threads
    return {
        "output_throughput": run["output_throughput"],
        "mean_step_ms": run["mean_step_ms"],
        "threads": governor.threads if governor is not None else torch.get_num_threads(),
        "changes": governor.changes if governor is not None else 0,
    }


def run_child(engine: str, args: argparse.Namespace, seed: int, procs: Path | None) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "bench.contention", "--child", engine, "--seed", str(seed), "--model", args.model,
        "--dtype", args.dtype, "--requests", str(args.requests), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), *(["--join-cgroup", str(procs)] if procs else []),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT))
    return json.loads(line[len(RESULT) :])


def condition(name: str, quota_cpus: float) -> AbstractContextManager[Any]:
    if name == "busy core":
        return BusyCore()
    if name == "cpu quota":
        return CpuQuota(quota_cpus)
    return nullcontext()


def beside_neighbours(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    quota_cpus = args.quota_cpus or max(0.5, cores - 1.0)
    engines = [e for e in args.engines.split(",") if e]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {e: {c: [] for c in CONDITIONS} for e in engines}
    missing: dict[str, str] = {}
    seed = args.seed
    for _ in range(args.rounds):
        for name in CONDITIONS:
            if name in missing:
                continue
            for engine in engines:
                seed += 1  # fresh prompts for every run; every engine gets its own
                try:
                    with condition(name, quota_cpus) as around:
                        run = run_child(engine, args, seed, around.procs if isinstance(around, CpuQuota) else None)
                except OSError as error:
                    missing[name] = f"{type(error).__name__}: {error}"
                    print(f"{name}: not measured ({missing[name]})", flush=True)
                    break
                runs[engine][name].append(run)
                print(f"{name}, {engine}: {run['output_throughput']} tok/s, {run['threads']} threads", flush=True)
    rows = []
    for engine in engines:
        idle = [r["output_throughput"] for r in runs[engine]["idle"]]
        row: dict[str, Any] = {"engine": engine}
        for name in CONDITIONS:
            got = runs[engine][name]
            if not got:
                continue
            throughput = statistics.median(r["output_throughput"] for r in got)
            row[name] = {
                "output_throughput": round(throughput, 2),
                "vs_idle": round(throughput / statistics.median(idle), 3) if idle else None,
                "threads": [r["threads"] for r in got],
                "thread_changes": [r["changes"] for r in got],
                "runs": [r["output_throughput"] for r in got],
            }
        rows.append(row)
    report = {
        **run_header("bench.contention", argv),
        "cores": cores,
        "quota_cpus": quota_cpus,
        "model": args.model,
        "dtype": args.dtype,
        "workload": {"requests": args.requests, "input_len": args.input_len, "output_len": args.output_len},
        "rounds": args.rounds,
        "rows": rows,
        "not_measured": missing,
    }
    if args.out:
        save(stem(args.out, "contention", report["date"], args.tag), report, neighbours_markdown(report), plot_bars)
    return report


def neighbours_markdown(report: dict[str, Any]) -> list[str]:
    w = report["workload"]
    shown = [c for c in CONDITIONS if c not in report["not_measured"]]
    header = {"idle": "idle", "busy core": "one core busy", "cpu quota": f"quota {report['quota_cpus']:g} CPUs"}
    lines = [
        f"# The engine beside a busy core and under a CPU quota, {report['date']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; {report['cores']} CPUs this process may use; model `{report['model']}`, "
        f"{report['dtype']}; {w['requests']} requests at once, {w['input_len']}-token prompts, {w['output_len']} "
        f"new tokens; each run a fresh process (threads sized at load); {report['rounds']} rounds, interleaved, "
        "medians. ours: the worker's defaults (threads sized to the CPUs and adapting); ours-fixed: torch's thread "
        "count, fixed; transformers: its continuous batching at its defaults.",
        "",
        "| engine | " + " | ".join(f"{header[c]}: out tok/s (vs idle), threads at the end" for c in shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for row in report["rows"]:
        cells = []
        for name in shown:
            cell = row.get(name)
            if cell is None:
                cells.append("-")
                continue
            vs = "" if cell["vs_idle"] is None else f" ({cell['vs_idle']:.0%})"
            cells.append(f"{cell['output_throughput']}{vs}, {'/'.join(map(str, cell['threads']))}")
        lines.append(f"| {row['engine']} | " + " | ".join(cells) + " |")
    for name, why in report["not_measured"].items():
        lines += ["", f"{header[name]}: not measured ({why})."]
    return lines


def plot_bars(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    shown = [c for c in CONDITIONS if c not in report["not_measured"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(report["rows"]))
    for i, row in enumerate(report["rows"]):
        values = [row[c]["output_throughput"] if c in row else 0 for c in shown]
        ax.bar([x + i * width for x in range(len(shown))], values, width, label=row["engine"])
    ax.set_xticks([x + width * (len(report["rows"]) - 1) / 2 for x in range(len(shown))], shown)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{report['model']}, {report['dtype']}, {report['workload']['requests']} requests")
    ax.legend()
    write_figure(fig, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.contention", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shares", default="0.05,0.1", help="shares of the machine's cores another process takes")
    parser.add_argument("--requests", type=int, default=32, help="requests per burst, all submitted at once")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for the engine (0 = as the worker sizes and adapts them)"
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--neighbours", action="store_true", help="idle / one busy core / a CPU quota, each engine")
    parser.add_argument("--engines", default=",".join(ENGINES), help="with --neighbours: which engines")
    parser.add_argument(
        "--quota-cpus", type=float, default=0.0, help="with --neighbours: the cgroup's quota (0 = one core less)"
    )
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)  # one run, in a fresh process
    parser.add_argument("--seed", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--join-cgroup", default="", help=argparse.SUPPRESS)  # the cgroup.procs file to join first
    args = parser.parse_args(argv)
    if args.child:
        result = child_run(args)
        print(RESULT + json.dumps(result), flush=True)
        return result
    if args.neighbours:
        return beside_neighbours(args, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from bench.serve_anchors import load_offline, offline_generate, warm_up
    from bench.serve_dataset import synthetic_chat
    from shared.model_source import load_tokenizer
    from shared.settings import Settings

    settings = Settings(
        model=args.model, dtype=args.dtype, max_num_seqs=max(args.requests, 1), torch_threads=args.threads
    )
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
