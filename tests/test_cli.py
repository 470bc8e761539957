"""The ``inflightq`` command with a user's mistakes: one clear line on stderr and a non-zero exit code,
never a traceback; ``inflightq purge`` deletes one deployment's keys (RQ's included) and nothing else;
``inflightq bench`` runs the source checkout's bench/, which the product never imports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from inflightq_cli.redis_server import free_port
from shared.keys import Keys
from shared.settings import Settings
from tests.api.conftest import fake_heartbeat

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inflightq_cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def env(redis_url: str, key_prefix: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHTQ_") and k != "RQ_KEY_PREFIX"}
    return clean | {"INFLIGHTQ_REDIS_URL": redis_url, "INFLIGHTQ_KEY_PREFIX": key_prefix}


def one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("inflightq: "), done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_missing_file(env: dict[str, str], tmp_path: Path) -> None:
    one_line_error(cli("batch", "submit", str(tmp_path / "nope.jsonl"), env=env), "no such file", "nope.jsonl")


def test_unknown_batch_id(env: dict[str, str]) -> None:
    one_line_error(cli("batch", "status", "batch_nope", env=env), "batch_nope")
    one_line_error(cli("batch", "cancel", "batch_nope", env=env), "batch_nope")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [("status",), ("batch", "status", "batch_x"), ("batch", "submit", "README.md"), ("purge", "--yes")]
)
def test_unreachable_redis(env: dict[str, str], args: tuple[str, ...]) -> None:
    env = env | {"INFLIGHTQ_REDIS_URL": f"redis://:secret@127.0.0.1:{free_port()}/0"}
    line = one_line_error(cli(*args, env=env), "Redis", "does not answer")
    assert "secret" not in line, "the password stays out of the message"


def test_bad_setting(env: dict[str, str]) -> None:
    one_line_error(cli("status", env=env | {"INFLIGHTQ_MAX_NUM_SEQS": "many"}), "max_num_seqs")


def test_purge_deletes_one_deployments_keys_and_nothing_else(
    env: dict[str, str], redis_url: str, key_prefix: str, run_prefix: str
) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    mine, theirs = Keys.for_prefix(key_prefix), Keys.for_prefix(f"{key_prefix}x")  # a prefix that extends ours
    for keys in (mine, theirs):
        r.hset(keys.request("r1"), "status", "done")
        r.xadd(keys.stream("m", 0), {"f": "v"})
        r.set(keys.rq() + ":job:batch-1", "x")  # RQ's keys live under the prefix
    r.set("rq:job:someone-elses", "x")  # a bare RQ deployment beside us
    try:
        refused = cli("purge", env=env)  # no --yes and no terminal: it asks for --yes
        assert refused.returncode == 2 and "--yes" in refused.stderr
        fake_heartbeat(redis_url, Settings(redis_url=redis_url, key_prefix=key_prefix, model="m"), "w1")
        one_line_error(cli("purge", "--yes", env=env), "live", "w1")
        assert r.exists(mine.request("r1"))
        r.delete(mine.workers(), mine.worker("w1"))

        done = cli("purge", "--yes", env=env)
        assert done.returncode == 0 and "deleted 3 keys" in done.stdout, done
        assert list(r.scan_iter(match=mine.pattern())) == []
        assert r.exists(theirs.request("r1"), theirs.stream("m", 0), theirs.rq() + ":job:batch-1") == 3
        assert r.exists("rq:job:someone-elses")
        assert "no keys" in cli("purge", "--yes", env=env).stdout
    finally:
        r.delete("rq:job:someone-elses")
        r.close()


def test_purge_also_deletes_rqs_keys_on_rqs_own_redis(env: dict[str, str], redis_url: str, key_prefix: str) -> None:
    """On a Cluster, RQ runs on a standalone Redis of its own (INFLIGHTQ_RQ_REDIS_URL): purge clears RQ's
    keys there too, and only RQ's (here: another database of the same server stands for it)."""
    from urllib.parse import urlsplit, urlunsplit

    rq_url = urlunsplit(urlsplit(redis_url)._replace(path="/1"))
    main, rq = redis.Redis.from_url(redis_url), redis.Redis.from_url(rq_url)
    mine = Keys.for_prefix(key_prefix)
    try:
        main.hset(mine.request("r1"), "status", "done")
        rq.set(mine.rq() + ":job:batch-1", "x")
        rq.set(mine.request("not-rqs"), "x")  # not RQ's: RQ's Redis holds only RQ's keys of ours
        done = cli("purge", "--yes", env=env | {"INFLIGHTQ_RQ_REDIS_URL": rq_url})
        assert done.returncode == 0 and "deleted 2 keys" in done.stdout, done
        assert not main.exists(mine.request("r1")) and not rq.exists(mine.rq() + ":job:batch-1")
        assert rq.exists(mine.request("not-rqs"))
    finally:
        rq.delete(mine.request("not-rqs"), mine.rq() + ":job:batch-1")
        main.close()
        rq.close()


def test_bench_runs_the_checkouts_benchmark_with_the_arguments_given(env: dict[str, str], tmp_path: Path) -> None:
    """From any directory: the arguments reach ``python -m bench.transport`` (its own --help answers)."""
    done = cli("bench", "transport", "--help", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: inflightq bench transport") and "--cluster" in done.stdout, done.stdout


def test_bench_without_a_checkout_says_so(env: dict[str, str], tmp_path: Path) -> None:
    """The package alone, as a wheel installs it (no bench/ beside it), answers with one line and exit 2."""
    shutil.copytree(REPO / "inflightq_cli", tmp_path / "inflightq_cli", ignore=shutil.ignore_patterns("__pycache__"))
    done = cli("bench", "engine", env=env, cwd=tmp_path)
    assert done.returncode == 2
    one_line_error(done, "source checkout", str(tmp_path / "inflightq_cli"))


def test_the_product_never_imports_bench() -> None:
    imports_bench = re.compile(r"^\s*(from|import)\s+bench\b", re.MULTILINE)
    product = [p for part in ("inflightq_cli", "shared", "producer_api", "worker") for p in (REPO / part).rglob("*.py")]
    assert len(product) > 20
    assert [str(p) for p in product if imports_bench.search(p.read_text())] == []


# Finding the running `inflightq up` from another shell ----------------------------------------------


def running_up_file(redis_url: str, key_prefix: str, pid: int) -> None:
    """The file a running ``inflightq up`` leaves in its cache directory (INFLIGHTQ_CACHE_DIR)."""
    from inflightq_cli.deployment_file import Deployment, write_deployment

    write_deployment(Deployment(redis_url, False, key_prefix, "http://127.0.0.1:8000", pid))


@pytest.mark.slow
def test_status_in_another_shell_follows_the_running_up_unless_told_otherwise(
    env: dict[str, str], redis_url: str, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_heartbeat(redis_url, Settings(redis_url=redis_url, key_prefix=key_prefix, model="m"), "w1")
    monkeypatch.setenv("INFLIGHTQ_CACHE_DIR", str(tmp_path))
    running_up_file(redis_url, key_prefix, os.getpid())  # this process stands for the running `up`
    other_shell = {k: v for k, v in env.items() if k not in ("INFLIGHTQ_REDIS_URL", "INFLIGHTQ_KEY_PREFIX")}
    other_shell["INFLIGHTQ_CACHE_DIR"] = str(tmp_path)

    done = cli("status", env=other_shell)
    assert done.returncode == 0 and "1 live worker(s)" in done.stdout and "w1" in done.stdout, done
    assert f"following `inflightq up` (pid {os.getpid()}" in done.stderr and redis_url in done.stderr, done.stderr

    # A Redis or a prefix named in the environment names a deployment: nothing is followed.
    elsewhere = other_shell | {"INFLIGHTQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    one_line_error(cli("status", env=elsewhere), "does not answer")
    own_prefix = cli("status", env=other_shell | {"INFLIGHTQ_KEY_PREFIX": key_prefix})
    assert "following" not in own_prefix.stderr, own_prefix.stderr


def test_a_stopped_ups_file_is_ignored_and_only_its_own_up_removes_it(
    redis_url: str, key_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inflightq_cli.deployment_file import deployment_path, followed, read_deployment, remove_deployment

    gone = subprocess.Popen(["true"])  # a process that has exited: `up` stopped without removing its file
    gone.wait()
    monkeypatch.setenv("INFLIGHTQ_CACHE_DIR", str(tmp_path))
    running_up_file(redis_url, key_prefix, gone.pid)
    monkeypatch.delenv("INFLIGHTQ_REDIS_URL", raising=False)
    monkeypatch.delenv("INFLIGHTQ_KEY_PREFIX", raising=False)
    assert read_deployment() is None
    assert followed(Settings()) == (Settings(), None)

    running_up_file(redis_url, key_prefix, os.getpid())
    settings, deployment = followed(Settings())
    assert deployment is not None and (settings.redis_url, settings.key_prefix) == (redis_url, key_prefix)
    assert deployment_path().stat().st_mode & 0o077 == 0, "a Redis URL may carry a password: owner only"
    remove_deployment(gone.pid)  # another `up`, stopping after this one started: not its file
    assert deployment_path().exists()
    remove_deployment(os.getpid())
    assert not deployment_path().exists()
