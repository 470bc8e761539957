"""One load point driven by guidellm, an independent load generator, instead of our own client.

``python -m bench.peers_interleaved --driver guidellm`` runs every system's load points through
guidellm (vLLM's project, installed by ``bash bench/peers/install.sh guidellm`` into a venv of its
own): its synthetic chat prompts of ``--input-len`` tokens (plus the chat template), ``--output-len``
tokens out with ``ignore_eos``, a closed loop of ``concurrency`` streams, ``--num-requests`` requests.
Our driver counts what the servers say they did; guidellm counts with its own tokenizer and clock, so
the two are a check on each other.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

GUIDELLM_TIMEOUT_S = 1800.0


def guidellm_exe() -> str | None:
    """``$INFLIGHTQ_GUIDELLM``, else guidellm in the peers' folder (install.sh), else on PATH; None if none."""
    from bench.serve_peers import peers_dir

    candidates = [os.environ.get("INFLIGHTQ_GUIDELLM"), str(peers_dir() / "guidellm" / "venv" / "bin" / "guidellm")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("guidellm")


def scenario(
    base_url: str,
    model: str,
    tokenizer_dir: str,
    concurrency: int,
    requests: int,
    lens: tuple[int, int],
    api_key: str | None = None,
) -> dict:
    """guidellm's scenario for one closed-loop load point on the chat route (``api_key``: sent as a
    bearer token, as our API asks of every client)."""
    prompt_tokens, output_tokens = lens
    backend = {"kind": "openai_http", "target": base_url, "model": model, "request_format": "/v1/chat/completions"}
    if api_key:
        backend["api_key"] = api_key
    return {
        "metadata": {"name": f"chat-{prompt_tokens}-{output_tokens}", "description": "inflightq bench"},
        "spec": {
            "backend": backend,
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer_dir},
            "profile": {"kind": "concurrent"},
            "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}],
            "constraints": [{"kind": "max_requests", "count": requests}],
        },
        "benchmarks": [{"profile.streams": concurrency}],
    }  # fmt: skip


def metrics(report: dict[str, Any]) -> dict[str, Any]:
    """The figures our own driver reports (``serve_metrics``' keys), from guidellm's json report of one
    load point: output tok/s over the run (guidellm's own), TTFT, TPOT, ITL and end-to-end latency."""
    benchmark = report["benchmarks"][0]
    m = benchmark["metrics"]
    totals = m["request_totals"]
    duration = benchmark["duration"]

    def stat(name: str, scale: float = 1.0) -> dict[str, float]:
        values = m[name]["successful"]
        cuts = values.get("percentiles") or {}
        return {
            "mean": round(values["mean"] * scale, 2),
            **{p: round(cuts.get(p, values["median"]) * scale, 2) for p in ("p50", "p90", "p99")},
        }

    return {
        "requests": totals["total"],
        "completed": totals["successful"],
        "failed": totals["errored"] + totals["incomplete"],
        "errors": _errors(benchmark),
        "duration_s": round(duration, 3),
        "total_input_tokens": int(m["prompt_token_count"]["successful"]["total_sum"]),
        "total_output_tokens": int(m["output_token_count"]["successful"]["total_sum"]),
        "request_throughput": round(totals["successful"] / duration, 3) if duration else 0.0,
        # guidellm's own figure: the completed requests' output tokens over the run's duration
        "output_throughput": round(m["output_tokens_per_second"]["successful"]["mean"], 2),
        "ttft_ms": stat("time_to_first_token_ms"),
        "tpot_ms": stat("time_per_output_token_ms"),
        "itl_ms": stat("inter_token_latency_ms"),
        "e2e_ms": stat("request_latency", 1000.0),
    }


def _errors(benchmark: dict[str, Any]) -> list[str]:
    """The distinct errors of the failed requests (the first five), as guidellm recorded them."""
    failed = (benchmark.get("requests") or {}).get("errored") or []
    seen: list[str] = []
    for request in failed:
        info = request.get("info") or {}
        error = str(info.get("error") or request.get("error") or "unknown error")[:300]
        if error not in seen:
            seen.append(error)
    return seen[:5]


def run(exe: str, load_point: dict[str, Any]) -> dict[str, Any]:
    """One load point (a ``scenario``) through guidellm; its metrics (``metrics``), or a failed run's error."""
    with tempfile.TemporaryDirectory(prefix="inflightq-guidellm-") as folder:
        spec, out = Path(folder) / "scenario.json", Path(folder) / "report.json"
        spec.write_text(json.dumps(load_point))
        command = [exe, "run", "--scenario", str(spec), "--output", f"kind=json,path={out}", "--disable-progress"]
        # Its own session: guidellm runs worker processes, and a timeout must stop them with it.
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder, start_new_session=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=GUIDELLM_TIMEOUT_S)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed (exit {proc.returncode}): {(stderr or stdout)[-2000:]}")
        return metrics(json.loads(out.read_text()))
