"""``inflightq up``, the Quick start's service command: with no Redis at the configured URL it
starts a private one, the API, a worker and a batch worker; a first request is answered; the CLI in
another shell finds the deployment; every key it writes is under its prefix; SIGTERM stops
everything, the private Redis included."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from inflightq_cli.redis_server import ensure_redis, free_port, redis_answers

pytestmark = pytest.mark.slow


def test_up_serves_a_first_request_and_stops_cleanly(tiny_model_dir: Path, run_prefix: str, tmp_path: Path) -> None:
    redis_port, api_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    assert not redis_answers(redis_url)
    # As a user's shell has it: RQ's keys go under the deployment's prefix, not this test run's (RQ_KEY_PREFIX).
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHTQ_") and k != "RQ_KEY_PREFIX"}
    env |= {
        "INFLIGHTQ_REDIS_URL": redis_url,
        "INFLIGHTQ_KEY_PREFIX": f"{run_prefix}-up",
        "INFLIGHTQ_MODEL": str(tiny_model_dir),
        "INFLIGHTQ_DTYPE": "float32",
        "INFLIGHTQ_DRAIN_TIMEOUT_S": "5",
        "INFLIGHTQ_CACHE_DIR": str(tmp_path),  # where up says where it runs
        "OMP_NUM_THREADS": "1",
    }
    installed_for_s = 100  # as the quick start passes the time it began, before its install
    began = str(time.time() - installed_for_s)
    proc = subprocess.Popen(
        [sys.executable, "-m", "inflightq_cli", "up", "--port", str(api_port), "--started-at", began],
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

        # `inflightq status` in another shell, which knows neither the private Redis nor the prefix.
        other_shell = {k: v for k, v in env.items() if k not in ("INFLIGHTQ_REDIS_URL", "INFLIGHTQ_KEY_PREFIX")}
        status = subprocess.run(
            [sys.executable, "-m", "inflightq_cli", "status"], env=other_shell, capture_output=True, text=True
        )
        assert status.returncode == 0 and "1 live worker(s)" in status.stdout, status
        deployment = json.loads((tmp_path / "deployment.json").read_text())
        assert deployment["key_prefix"] == env["INFLIGHTQ_KEY_PREFIX"] and deployment["pid"] == proc.pid
        stack_redis = redis.Redis.from_url(deployment["redis_url"], decode_responses=True)
        outside = [k for k in stack_redis.scan_iter() if not k.startswith("{" + env["INFLIGHTQ_KEY_PREFIX"])]
        stack_redis.close()
        assert outside == [], "up writes only under its deployment's key prefix"
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
    assert f"export INFLIGHTQ_REDIS_URL={private.group(1)} INFLIGHTQ_KEY_PREFIX={env['INFLIGHTQ_KEY_PREFIX']}" in output
    ready = re.search(r"ready in (\d+) s \((\d+) s to start the service, after (\d+) s of install\)", output)
    assert ready, output[-3000:]
    total, start, install = map(int, ready.groups())
    assert install >= installed_for_s and total >= install + start - 1, "the ready line counts the install"
    assert not (tmp_path / "deployment.json").exists(), "a stopped up leaves no file to follow"


def test_a_private_redis_when_asked_even_where_one_answers(redis_url: str) -> None:
    assert redis_answers(redis_url)
    url, server = ensure_redis(redis_url, private=True)
    try:
        assert server is not None and url != redis_url and redis_answers(url)
    finally:
        if server is not None:
            server.stop()
    assert not redis_answers(url)


def test_up_gives_each_worker_its_share_of_the_cores() -> None:
    from inflightq_cli.supervisor import worker_env

    # The share itself (4 CPUs: 4, 2, 1, 1 threads for 1, 2, 3, 8 workers) is the worker's to compute,
    # from the CPUs it may really use: tests/engine/test_cpu_threads.py, tests/worker/test_worker.py.
    assert worker_env({}, 1) == {}, "one worker: every CPU it may use"
    assert worker_env({}, 2)["INFLIGHTQ_WORKERS_PER_HOST"] == "2"
    assert "INFLIGHTQ_TORCH_THREADS" not in worker_env({}, 2), "a share that adapts, not a fixed count"
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


def test_up_says_what_the_api_waits_for(tmp_path: Path, monkeypatch) -> None:
    from inflightq_cli.supervisor import api_start

    monkeypatch.setenv("INFLIGHTQ_CACHE_DIR", str(tmp_path))  # no converted model yet: a first run
    first = api_start("smollm2-135m-instruct")
    assert "tokenizer" in first and "read from the GGUF file" in first
    converted = tmp_path / "models" / "smollm2-135m-instruct"
    converted.mkdir(parents=True)
    (converted / "tokenizer_config.json").write_text("{}")
    assert "GGUF" not in api_start("smollm2-135m-instruct"), "later runs read the converted tokenizer"


def test_the_quick_start_installs_what_running_needs_and_the_tests_the_rest() -> None:
    """The quick start's venv holds the runtime dependencies only; scripts/test.sh (CI's command) adds the
    dev extra the tests import."""
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    quickstart, tests = (scripts / "quickstart.sh").read_text(), (scripts / "test.sh").read_text()
    assert "bash scripts/install.sh\n" in quickstart and "--dev" not in quickstart
    assert "bash scripts/install.sh --dev\n" in tests
    usage = subprocess.run(["bash", str(scripts / "install.sh"), "--everything"], capture_output=True, text=True)
    assert usage.returncode == 2 and "--dev" in usage.stderr
