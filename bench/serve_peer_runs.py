"""The peers' part of ``inflightq bench serve --peers``: each peer's server in turn is started, warmed up on
the same warm-up prompts as our stack, driven through its OpenAI chat route by the same load generator
at the same load points (request rate and concurrency) on the same prompts, and stopped. A row per peer
and point joins the report's runs; a peer that is missing or fails to start is recorded and skipped."""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

import httpx

from bench.serve_clients import openai_chat_sender, run_load
from bench.serve_dataset import ChatSample
from bench.serve_metrics import print_summary, summarize
from bench.serve_peer_weights import WeightsUnavailable
from bench.serve_peers import PeerConfig, PeerServer, PeerUnavailable, make_server
from bench.serve_report import checkpoint, rate_label
from bench.serve_stack import measure, quiet_policy
from shared.settings import Settings

Point = tuple[float, int | None]  # (request rate, concurrency cap)


def max_model_len(*sample_sets: list[ChatSample]) -> int:
    """Room for the run's longest prompt plus its longest output, rounded up to a 64-token multiple."""
    longest = max(s.prompt_len for samples in sample_sets for s in samples)
    longest += max(s.output_len for samples in sample_sets for s in samples)
    return 64 * math.ceil((longest + 16) / 64)


async def drive(
    server: PeerServer, samples: list[ChatSample], rate: float = math.inf, concurrency: int | None = None
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30)
    async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=timeout) as http:
        send = openai_chat_sender(http, server.served_model, server.request_extra)
        results, duration = await run_load(send, samples, request_rate=rate, max_concurrency=concurrency)
    return summarize(results, duration)


def run_peers(
    names: list[str],
    settings: Settings,
    points: list[Point],
    samples: list[ChatSample],
    warm: list[ChatSample],
    report: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    # The peers compute in our worker's dtype (bfloat16 or float32, as it resolved on this machine).
    dtype = report.get("dtype", "bfloat16")
    config = PeerConfig.for_run(settings, max_model_len(samples, warm), [c for _, c in points], dtype)
    peers: dict[str, Any] = report.setdefault("peers", {})
    for name in names:
        try:
            server = make_server(name, config)
        except (PeerUnavailable, WeightsUnavailable) as exc:
            print(f"peer {name} skipped: {exc}", flush=True)
            peers[name] = {"skipped": str(exc)}
            continue
        print(f"starting {server.label} on {server.base_url}: {' '.join(server.command)}", flush=True)
        try:
            server.start(timeout=args.peer_timeout)
        except (PeerUnavailable, TimeoutError) as exc:
            print(f"peer {name} failed to start: {exc}", flush=True)
            peers[name] = {"failed": str(exc), "log": str(server.log)}
            continue
        try:
            print(f"{server.label} ready in {server.ready_s} s (log {server.log})", flush=True)
            peers[name] = {
                "label": server.label,
                "weights": server.weights,
                "command": [*server.command, "--port", str(server.port)],
                "request_extra": server.request_extra,
                "ready_s": server.ready_s,
            }
            asyncio.run(drive(server, warm))  # first-call costs, on prompts no run sends (as for our stack)
            policy = quiet_policy(args)
            policy = policy.with_own(server.pids()) if policy else None
            for rate, concurrency in points:
                title = f"{server.label}, rate {rate_label(rate)}, concurrency {concurrency}"
                metrics, contended = measure(
                    lambda _, s=server, r=rate, c=concurrency: asyncio.run(drive(s, samples, r, c)), policy, title
                )
                row = {"phase": "sweep", "endpoint": "chat", "peer": name, "workers": "-"}
                row |= {"rate": rate_label(rate), "concurrency": concurrency, "system": server.label}
                row["metrics"] = metrics
                if contended:
                    row["contended_by"] = contended
                print_summary(title, metrics)
                report["runs"].append(row)
                checkpoint(report)
        finally:
            server.stop()
