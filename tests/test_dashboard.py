"""Every panel of the Grafana dashboard shows data from a real stack.

A real Prometheus (Debian package ``prometheus``) scrapes a running API and worker (tiny
model) every second; after some traffic, each panel's query, with Grafana's variables
filled in, must return at least one number through Prometheus' HTTP API. A panel naming a
metric or label that does not exist returns nothing and fails here."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from inflightq_cli.redis_server import free_port
from tests.ci_skips import missing
from tests.engine.test_lora import ADAPTERS, make_adapter
from worker.engine.model.model_loader import load_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "dashboards" / "inflightq.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS = shutil.which("prometheus") or next(
    (p for p in ("/usr/bin/prometheus", "/usr/local/bin/prometheus") if Path(p).exists()), None
)

# What Grafana puts in place of its variables: a rate window of several 1 s scrapes, every model.
GRAFANA_VARIABLES = {"$__rate_interval": "5s", "$__interval": "1s", "$__range": "5m", "$model": ".*"}


def _dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in panels
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def _alert_queries() -> list[tuple[str, str]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def _substitute(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable this test does not fill in: {expr}"
    return expr


def test_every_panel_has_a_query_with_only_known_variables() -> None:
    queries = _dashboard_queries()
    assert len(queries) >= 20
    for _, expr in queries:
        _substitute(expr)


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason=missing("promtool", "apt-get install prometheus (.ci/run does)")
)
def test_every_panel_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool parses a rule file's expressions: each query becomes one recording rule.
    rules = [{"record": f"panel:{i}", "expr": _substitute(expr)} for i, (_, expr) in enumerate(_dashboard_queries())]
    path = tmp_path / "panels.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_covers_what_operators_watch() -> None:
    exprs = " ".join(expr for _, expr in _dashboard_queries())
    for metric in (
        "inflightq_api_time_to_first_token_seconds_bucket",
        "inflightq_api_inter_token_latency_seconds_bucket",
        "inflightq_api_request_duration_seconds_bucket",
        "inflightq_api_e2e_latency_seconds_bucket",
        "inflightq_worker_engine_batch_tokens",
        "inflightq_queue_depth",
        "inflightq_workers_live",
        "inflightq_api_requests_total",
    ):
        assert metric in exprs
    assert "histogram_quantile" in exprs


# -- the live stack ------------------------------------------------------------------------


@dataclass
class Stack:
    api: str
    prometheus: str
    started: float
    traffic_done: float


def _wait_until(check, what: str, timeout: float, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise AssertionError(f"{process.args[:4]} exited with {process.returncode} while waiting for {what}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _scrapes(prometheus: str) -> dict[str, int]:
    """Samples of ``up`` per job so far: how many times Prometheus has scraped each target."""
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": "count_over_time(up[1h])"}, timeout=10).json()
    return {r["metric"]["job"]: int(float(r["value"][1])) for r in reply["data"]["result"]}


def _wait_for_scrapes(prometheus: str, count: int, processes: list[subprocess.Popen]) -> None:
    """Until Prometheus has scraped every target ``count`` more times (instead of sleeping that long)."""
    before = _scrapes(prometheus)
    jobs = ("inflightq-api", "inflightq-worker")

    def scraped() -> bool:
        now = _scrapes(prometheus)
        return all(now.get(job, 0) >= before.get(job, 0) + count for job in jobs)

    _wait_until(scraped, f"{count} more scrapes of {jobs}", 120, processes)


def _ok(url: str) -> bool:
    return httpx.get(url, timeout=2).status_code == 200


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _prometheus_config(api_port: int, worker_port: int) -> dict:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "inflightq-api", "static_configs": [{"targets": [f"127.0.0.1:{api_port}"]}]},
            {"job_name": "inflightq-worker", "static_configs": [{"targets": [f"127.0.0.1:{worker_port}"]}]},
        ],
    }


PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox around the yard.",
    "Redis streams, consumer groups and a continuous batch: tell me a story about queues and workers.",
]


def _send_traffic(api: str) -> None:
    def generate(i: int) -> None:
        body = {"inputs": PROMPTS[i % 2], "parameters": {"max_new_tokens": 12, "seed": i, "do_sample": i % 3 == 0}}
        if i % 4 == 1:  # LoRA adapters in turn: with max_loras 1 each one evicts the other
            body["parameters"]["adapter_id"] = LORAS[i // 4 % 2]
        if i % 2:
            with httpx.stream("POST", f"{api}/generate_stream", json=body, timeout=120) as response:
                assert response.status_code == 200
                for _ in response.iter_lines():
                    pass
        else:
            assert httpx.post(f"{api}/generate", json=body, timeout=120).status_code == 200

    # Concurrent, so the worker batches them (and, with few KV blocks, preempts); repeated
    # prompts hit the prefix cache.
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(generate, range(16)))
    # A client error, so the error panels have a series.
    invalid = httpx.post(f"{api}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": -1}}, timeout=30)
    assert invalid.status_code == 422


# Two LoRA adapters of the tiny model, so the LoRA panels have requests, loads and evictions.
LORAS = ("attn", "mlp")


@pytest.fixture(scope="module")
def stack(
    redis_url: str, run_prefix: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    if PROMETHEUS is None:
        pytest.skip(missing("prometheus", "apt-get install prometheus (.ci/run does)"))
    tmp = tmp_path_factory.mktemp("dashboard")
    base, _ = load_model(str(tiny_model_dir), torch.float64, "cpu")
    dirs = [make_adapter(base, tmp / name, seed, *ADAPTERS[name]) for seed, name in enumerate(LORAS)]
    loras = ",".join(f"{name}={path}" for name, path in zip(LORAS, dirs, strict=True))
    api_port, worker_port, prometheus_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "INFLIGHTQ_REDIS_URL": redis_url,
        "INFLIGHTQ_KEY_PREFIX": f"{run_prefix}-dashboard",
        "INFLIGHTQ_MODEL": str(tiny_model_dir),
        # Few KV blocks, so concurrent requests preempt each other and that panel has data too.
        "INFLIGHTQ_NUM_KV_BLOCKS": "24",
        "INFLIGHTQ_BLOCK_SIZE": "4",
        "INFLIGHTQ_LORA_ADAPTERS": loras,
        "INFLIGHTQ_MAX_LORAS": "1",
    }
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(_prometheus_config(api_port, worker_port)))
    processes: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> None:
        log = (tmp / f"{name}.log").open("wb")
        processes.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))

    cli = [sys.executable, "-m", "inflightq_cli"]
    try:
        start("worker", [*cli, "worker", "--model", str(tiny_model_dir), "--dtype", "float64",
                         "--metrics-port", str(worker_port)])  # fmt: skip
        start("api", [*cli, "api", "--port", str(api_port)])
        start("prometheus", [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
        ])  # fmt: skip
        api, prometheus = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{prometheus_port}"
        _wait_until(lambda: _ok(f"http://127.0.0.1:{worker_port}/metrics"), "the worker's metrics", 180, processes)
        _wait_until(lambda: _ok(f"{api}/health"), "the API", 120, processes)
        _wait_until(lambda: _ok(f"{prometheus}/-/ready"), "Prometheus", 60, processes)
        started = time.time()
        # Two waves a few scrapes apart: a series born with its whole count in one scrape has a
        # rate of 0 (histogram_quantile then gives NaN); the second wave makes every rate move.
        _send_traffic(api)
        _wait_for_scrapes(prometheus, 2, processes)
        _send_traffic(api)
        # Prometheus has the final counts, and a sample past them for every rate.
        _wait_for_scrapes(prometheus, 2, processes)
        yield Stack(api=api, prometheus=prometheus, started=started, traffic_done=time.time())
    except AssertionError:
        for log in sorted(tmp.glob("*.log")):
            sys.stderr.write(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}\n")
        raise
    finally:
        _stop(processes)


def _has_a_number(result: list[dict]) -> bool:
    return any(not math.isnan(float(value)) for series in result for _, value in series["values"])


# A ratio over draft tokens: the tiny random model never repeats its input, so it proposes none and
# the ratio is 0/0. Its series are still checked as exported (below); the engine's tests cover drafts.
NO_DATA_FROM_THE_TINY_MODEL = {"Speculation: draft tokens kept [A]"}


def test_every_panel_query_returns_data_from_a_real_prometheus(stack: Stack) -> None:
    empty = []
    with httpx.Client(base_url=stack.prometheus, timeout=30) as client:
        for title, expr in _dashboard_queries():
            reply = client.get(
                "/api/v1/query_range",
                params={"query": _substitute(expr), "start": stack.started, "end": time.time(), "step": "1s"},
            ).json()
            assert reply["status"] == "success", f"{title}: {expr}: {reply.get('error')}"
            if not _has_a_number(reply["data"]["result"]) and title not in NO_DATA_FROM_THE_TINY_MODEL:
                empty.append(f"{title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_series_a_panel_or_an_alert_names_is_exported(stack: Stack) -> None:
    """Stronger than non-empty results: each metric name inside each query exists on its own."""
    queries = [*_dashboard_queries(), *_alert_queries()]
    names = {name for _, expr in queries for name in re.findall(r"\b(inflightq_[a-z0-9_]+)", expr)}
    reply = httpx.get(f"{stack.prometheus}/api/v1/label/__name__/values", timeout=30).json()
    exported = set(reply["data"])
    assert names <= exported, f"not exported by the API or the worker: {sorted(names - exported)}"


def test_every_alert_rule_evaluates_cleanly(stack: Stack) -> None:
    # Rules are evaluated every second here: wait until each was evaluated after the traffic.
    def rules_now() -> dict[str, dict]:
        groups = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=30).json()["data"]["groups"]
        return {rule["name"]: rule for group in groups for rule in group["rules"]}

    def evaluated_after_traffic(rule: dict) -> bool:
        stamp = rule.get("lastEvaluation", "")[:26].rstrip("Z")  # RFC 3339 with ns; keep microseconds
        return bool(stamp) and datetime.fromisoformat(stamp + "+00:00").timestamp() > stack.traffic_done

    _wait_until(lambda: all(map(evaluated_after_traffic, rules_now().values())), "a rule evaluation", 60, [])
    rules = rules_now()
    assert set(rules) == {name for name, _ in _alert_queries()}
    broken = {name: rule.get("lastError") for name, rule in rules.items() if rule["health"] != "ok"}
    assert not broken, broken
