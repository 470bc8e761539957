"""Our stack and the peers, interleaved: every server up at once, each load point run by each system in
turn, round after round, the order rotating each round.

``inflightq bench serve --peers`` runs the systems one after another, minutes apart. On the shared 2-core
boxes the machine's own speed drifts by a third within ten minutes (our stack measured 75 and then 49
tok/s at one stream, 15 minutes apart, with nothing else running), so a sequential comparison measures
the drift as much as the systems. Here the systems at one load point run back to back, seconds apart,
and each round gives its own ratio; the medians over rounds are the comparison.

    python -m bench.peers_interleaved --dtype bfloat16 --concurrency 1,8,32 --rounds 3 --peers vllm,llamacpp \\
        --out bench/results --tag avx512-bf16

The servers that are not measured at a moment sit idle beside the one that is (our worker blocks on its
inbox, vLLM's engine core on its input queue, llama-server on its slots).

``--driver guidellm`` drives every load point with guidellm, an independent load generator, instead of
our own client (``bench/peers_guidellm.py``; ``bash bench/peers/install.sh guidellm`` installs it):

    python -m bench.peers_interleaved --driver guidellm --concurrency 8,32 --num-requests 64 --rounds 2 \\
        --out bench/results --tag T
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid
from pathlib import Path
from typing import Any

from bench import peers_guidellm
from bench.results_files import pyplot, save, stem, write_figure
from bench.serve import Runner, bench_settings, report_head, stop_on_sigterm
from bench.serve_dataset import synthetic_chat
from bench.serve_metrics import print_summary
from bench.serve_peer_runs import drive, max_model_len
from bench.serve_peer_weights import hf_dir
from bench.serve_peers import PeerConfig, PeerServer, make_server
from bench.serve_stack import Stack

OURS = "inflightq"
DRIVERS = {
    "ours": "the project's own client (bench/serve_peer_runs.py)",
    "guidellm": "guidellm (its synthetic chat prompts and its own token counts)",
}


def rotation(systems: list[str], round_index: int) -> list[str]:
    """The order systems run at each load point in a round: shifted by one each round, so no system is
    always first (just after another's burst) or last."""
    shift = round_index % len(systems)
    return systems[shift:] + systems[:shift]


def ratios(throughput: dict[str, dict[int, list[float]]], peer: str) -> dict[int, dict[str, Any]]:
    """Per load point, ours / peer in each round (same round = seconds apart) and their median."""
    out: dict[int, dict[str, Any]] = {}
    for level, ours in throughput[OURS].items():
        theirs = throughput[peer].get(level, [])
        per_round = [round(a / b, 3) for a, b in zip(ours, theirs, strict=False) if b]
        out[level] = {"per_round": per_round, "median": statistics.median(per_round) if per_round else None}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.peers_interleaved", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: INFLIGHTQ_MODEL")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: INFLIGHTQ_DTYPE)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per system, load point and round")
    p.add_argument("--input-len", default="128,128")
    p.add_argument("--output-len", default="64,64")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", default="vllm,llamacpp")
    p.add_argument("--peer-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="folder for peers-interleaved-<date>.*; '' to skip writing")
    p.add_argument("--tag", default="")
    p.add_argument("--driver", default="ours", choices=["ours", "guidellm"], help="the load generator")
    args = p.parse_args(argv)
    args.base_url, args.num_kv_blocks = None, None  # bench_settings: a stack of our own, default KV size
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stop_on_sigterm()  # a killed run still stops our stack and the peers' servers (the finally below)
    from shared.model_source import load_tokenizer
    from worker.engine_config import settings_dtype

    settings = bench_settings(args)
    tokenizer = load_tokenizer(settings.model)
    lo_in, hi_in = map(int, args.input_len.split(","))
    lo_out, hi_out = map(int, args.output_len.split(","))
    guidellm = peers_guidellm.guidellm_exe() if args.driver == "guidellm" else None
    if args.driver == "guidellm" and (guidellm is None or lo_in != hi_in or lo_out != hi_out):
        raise SystemExit(
            "--driver guidellm needs guidellm (bash bench/peers/install.sh guidellm, or INFLIGHTQ_GUIDELLM) "
            "and fixed lengths (--input-len N,N --output-len M,M)"
        )
    samples = synthetic_chat(
        tokenizer, args.num_requests, input_len=(lo_in, hi_in), output_len=(lo_out, hi_out), seed=args.seed
    )
    warm = synthetic_chat(tokenizer, 8, input_len=(40, 60), output_len=(4, 4), seed=args.seed + 1)
    levels = [int(c) for c in args.concurrency.split(",")]
    dtype = str(settings_dtype(settings)).replace("torch.", "")
    report = report_head("python -m bench.peers_interleaved", argv, settings, samples, args)
    report |= {"dtype": dtype, "requests_per_run": args.num_requests, "driver": args.driver, "rounds": []}
    keys = [f"bench-{uuid.uuid4().hex[:12]}" for _ in range(256)]
    stack = Stack(settings, keys)
    servers: dict[str, PeerServer] = {}
    try:
        stack.start(workers=1)
        runner = Runner(settings, stack.base_url, keys)
        asyncio.run(runner.run("chat", warm))
        config = PeerConfig.for_run(settings, max_model_len(samples, warm), levels, dtype)
        for name in [p for p in args.peers.split(",") if p]:
            server = make_server(name, config)
            print(f"starting {server.label}: {' '.join(server.command)}", flush=True)
            server.start(timeout=args.peer_timeout)
            asyncio.run(drive(server, warm))
            servers[server.label] = server
        systems = [OURS, *servers]
        report["systems"] = {OURS: "inflightq (API /v1/chat/completions, 1 worker)"} | {
            label: " ".join(s.command) for label, s in servers.items()
        }
        throughput: dict[str, dict[int, list[float]]] = {s: {c: [] for c in levels} for s in systems}
        # A fresh API key, so a fresh prefix-cache tenant, for each of our guidellm runs, as our Runner
        # does: guidellm's seeded prompts repeat from round to round, and the peers cache no prefixes.
        fresh_keys = iter(keys[len(keys) // 2 :])
        for index in range(args.rounds):
            order = rotation(systems, index)
            rows = []
            for level in levels:
                for system in order:
                    if guidellm is not None:
                        url, served = (
                            (stack.base_url, settings.model)
                            if system == OURS
                            else (servers[system].base_url, servers[system].served_model)
                        )
                        load_point = peers_guidellm.scenario(
                            url, served, str(hf_dir(settings.model)), level, args.num_requests,
                            (lo_in, lo_out), api_key=next(fresh_keys) if system == OURS else None,
                        )  # fmt: skip
                        metrics = peers_guidellm.run(guidellm, load_point)
                    elif system == OURS:
                        metrics = asyncio.run(runner.run("chat", samples, concurrency=level))
                    else:
                        metrics = asyncio.run(drive(servers[system], samples, concurrency=level))
                    print_summary(f"round {index + 1}, {system}, concurrency {level}", metrics)
                    throughput[system][level].append(metrics["output_throughput"])
                    rows.append({"system": system, "concurrency": level, "metrics": metrics})
            report["rounds"].append({"order": order, "runs": rows})
        report["throughput"] = throughput
        report["ours_over_peer"] = {peer: ratios(throughput, peer) for peer in servers}
    finally:
        for server in servers.values():
            server.stop()
        stack.stop()
    if args.out:  # Path("") would be the working directory: '' means no files, as in the other benchmarks
        save(stem(args.out, "peers-interleaved", report["date"], args.tag), report, markdown(report), plot)
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    levels = list(report["throughput"][OURS])
    systems = list(report["throughput"])
    lines = [
        f"# Ours and the peers, interleaved, {report['date']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {report['machine']}; model `{report['model']}`, {report['dtype']}; "
        f"{report['requests_per_run']} requests per system, load point and round; closed loop at each concurrency; "
        f"load generator: {DRIVERS[report.get('driver', 'ours')]}.",
        "",
        "Output tok/s per round (systems back to back at each load point, order rotating by round):",
        "",
        "| concurrency | " + " | ".join(systems) + " |",
        "|---|" + "---|" * len(systems),
    ]
    for level in levels:
        cells = [" / ".join(f"{v:.1f}" for v in report["throughput"][s][level]) for s in systems]
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    lines += ["", "Ours / peer, per round and the median over rounds:", ""]
    lines += ["| concurrency | " + " | ".join(report["ours_over_peer"]) + " |"]
    lines += ["|---|" + "---|" * len(report["ours_over_peer"])]
    for level in levels:
        cells = []
        for peer in report["ours_over_peer"]:
            r = report["ours_over_peer"][peer][level]
            cells.append(f"**{r['median']:.2f}x** ({', '.join(f'{x:.2f}' for x in r['per_round'])})")
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    if not report.get("rounds"):
        return [*lines, "", "Systems:", ""] + [f"- {name}: `{cmd}`" for name, cmd in report["systems"].items()]
    lines += ["", "ITL p50 / TTFT p50 ms per round:", ""]
    lines += ["| concurrency | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for level in levels:
        cells = []
        for system in systems:
            runs = [
                r["metrics"]
                for rd in report["rounds"]
                for r in rd["runs"]
                if (r["system"], r["concurrency"]) == (system, level)
            ]
            cells.append(", ".join(f"{m['itl_ms']['p50']:.0f} / {m['ttft_ms']['p50']:.0f}" for m in runs))
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    lines += ["", "Systems:", ""] + [f"- {name}: `{cmd}`" for name, cmd in report["systems"].items()]
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    levels = list(report["throughput"][OURS])
    fig, ax = plt.subplots(figsize=(7, 4))
    for system, by_level in report["throughput"].items():
        medians = [statistics.median(by_level[c]) for c in levels]
        (line,) = ax.plot(levels, medians, marker="o", label=system.split(" (")[0])
        for c in levels:  # each round's figure, in its system's colour
            ax.scatter([c] * len(by_level[c]), by_level[c], s=10, alpha=0.5, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tok/s (median over rounds; dots: each round)")
    ax.set_title(f"Interleaved, {report['dtype']}, {report['machine'].split(',')[1].strip()}")
    ax.legend(loc="upper left", fontsize="small")
    write_figure(fig, path)


if __name__ == "__main__":
    main()
