"""``inflightq up``, the Quick start's service command: with no Redis at the configured URL it
starts a private one, the API, a worker and a batch worker; a first request is answered; SIGTERM
stops everything, the private Redis included."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from inflightq_cli.redis_server import free_port, redis_answers


def test_up_serves_a_first_request_and_stops_cleanly(tiny_model_dir: Path, run_prefix: str) -> None:
    redis_port, api_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    assert not redis_answers(redis_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHTQ_")}
    env |= {
        "INFLIGHTQ_REDIS_URL": redis_url,
        "INFLIGHTQ_KEY_PREFIX": f"{run_prefix}-up",
        "INFLIGHTQ_MODEL": str(tiny_model_dir),
        "INFLIGHTQ_DTYPE": "float32",
        "INFLIGHTQ_DRAIN_TIMEOUT_S": "5",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "inflightq_cli", "up", "--port", str(api_port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{api_port}"
    try:
        deadline = time.monotonic() + 120
        answer = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                response = httpx.post(
                    base + "/generate",
                    json={"inputs": "Hello", "parameters": {"max_new_tokens": 4, "ignore_eos": True, "details": True}},
                    timeout=30,
                )
                if response.status_code == 200:
                    answer = response.json()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert answer is not None, "no answer from the stack started by inflightq up"
        # A real generation: its four tokens, and the text is theirs (an empty string is not an answer).
        details = answer["details"]
        assert (details["generated_tokens"], details["finish_reason"]) == (4, "length")
        tokens = details["tokens"]
        assert len(tokens) == 4
        assert answer["generated_text"] == "".join(t["text"] for t in tokens if not t["special"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    assert proc.returncode == 0, output[-3000:]
    assert "inflightq: starting the API" in output, "up says what it starts"
    private = re.search(r"started a private one at (redis://\S+)", output)
    assert private, "with nothing at INFLIGHTQ_REDIS_URL, up starts a private Redis"
    assert not redis_answers(private.group(1)), "and stops it on exit"


def test_up_gives_each_worker_its_share_of_the_cores(monkeypatch) -> None:
    from inflightq_cli.supervisor import threads_per_worker, worker_env

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert [threads_per_worker(n) for n in (1, 2, 3, 8)] == [4, 2, 1, 1]
    assert worker_env({}, 1) == {}, "one worker keeps torch's default"
    assert worker_env({}, 2)["INFLIGHTQ_TORCH_THREADS"] == "2"
    assert worker_env({"INFLIGHTQ_TORCH_THREADS": "3"}, 2)["INFLIGHTQ_TORCH_THREADS"] == "3", "the operator's wins"


def test_up_gives_workers_metrics_ports_from_9100_and_skips_taken_ones() -> None:
    import socket

    from inflightq_cli.supervisor import DEFAULT_METRICS_PORT, metrics_ports

    assert DEFAULT_METRICS_PORT == 9100, "docker-compose.yml and deploy/prometheus/*.yml scrape workers on 9100"
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = metrics_ports(port, 2)
    assert ports[0] != port and len(set(ports)) == 2, "a taken port is replaced by a free one"
    assert all(p > 0 for p in metrics_ports(0, 3))


def test_local_prometheus_config_scrapes_what_up_starts() -> None:
    import yaml

    from inflightq_cli.supervisor import DEFAULT_METRICS_PORT

    repo = Path(__file__).resolve().parents[1]
    local = yaml.safe_load((repo / "deploy/prometheus/prometheus-local.yml").read_text())
    compose = yaml.safe_load((repo / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in local["scrape_configs"]}
    assert set(jobs) <= {job["job_name"] for job in compose["scrape_configs"]}, "same job names as compose's"
    targets = jobs["inflightq-worker"]["static_configs"][0]["targets"]
    assert targets[0] == f"127.0.0.1:{DEFAULT_METRICS_PORT}"
