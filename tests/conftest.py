"""Shared fixtures: a real Redis (the configured one, or a private server started here), or a
real Redis Cluster (3 masters + 3 replicas started here, for the modules that override
``redis_backend``), a key prefix unique to this test run, and models on disk."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from inflightq_cli.redis_cluster import PrivateRedisCluster
from inflightq_cli.redis_server import ensure_redis, redis_answers
from shared.keys import Keys
from shared.redis_connect import connect
from shared.settings import Settings
from tests.ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 - hooks

# What the fast tier (pytest -m "not slow") leaves out, new modules included: whole suites, the
# benchmarks' own tests and the modules that rerun tests on a Redis Cluster. Any other slow module
# carries its own mark.
SLOW_SUITES = ("faults", "conformance")
SLOW_MODULES = re.compile(r"test_bench_.*|.*_on_cluster.*")

# Every key a test run writes lives under this prefix; the run deletes only those.
RUN_PREFIX = f"iqtest-{uuid.uuid4().hex[:10]}"
# RQ reads its key prefix once per process, at import: in this process (and the batch workers it starts,
# which inherit the variable) RQ's keys live under the run's prefix too.
os.environ["RQ_KEY_PREFIX"] = Keys.for_prefix(RUN_PREFIX).rq()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Builds the CPU attention kernel before any test starts a worker process: a fresh machine's
    first build takes half a minute, which would otherwise land inside some worker's start-up
    timeout. Later runs only load the cached library."""
    from worker.engine.model.kernels.cpu_kernel import paged_decode_available

    settings = Settings()  # where the workers will look for it (INFLIGHTQ_CPU_KERNELS, INFLIGHTQ_KERNEL_CACHE)
    if settings.cpu_kernels:
        paged_decode_available(settings.kernel_cache)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(tests):
            continue
        if item.path.relative_to(tests).parts[0] in SLOW_SUITES or SLOW_MODULES.fullmatch(item.path.stem):
            item.add_marker(pytest.mark.slow)


# The Redis the tests use when it answers, whoever runs it (the run's header says so).
TESTS_REDIS_URL = os.environ.get("INFLIGHTQ_REDIS_URL", "redis://127.0.0.1:6379/0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--private-redis",
        action="store_true",
        help=f"Start a private Redis for the run even when one answers at INFLIGHTQ_REDIS_URL ({TESTS_REDIS_URL}).",
    )


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("private_redis") or not redis_answers(TESTS_REDIS_URL):
        return "redis: a private server this run starts and stops"
    return (
        f"redis: the server answering at {TESTS_REDIS_URL}, whoever runs it: this run writes only keys under "
        f"{Keys.for_prefix(RUN_PREFIX).described()} (its own prefix) and deletes them; --private-redis starts "
        "a private one instead"
    )


@pytest.fixture(scope="session")
def redis_url(pytestconfig: pytest.Config) -> Iterator[str]:
    url, server = ensure_redis(TESTS_REDIS_URL, private=pytestconfig.getoption("private_redis"))
    yield url
    if server is not None:
        server.stop()


@dataclass(frozen=True)
class RedisBackend:
    """Where a test's processes find Redis: a standalone server, or any node of a Cluster."""

    url: str
    cluster: bool = False

    @property
    def env(self) -> dict[str, str]:
        return {"INFLIGHTQ_REDIS_URL": self.url, "INFLIGHTQ_REDIS_CLUSTER": "true" if self.cluster else "false"}


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[PrivateRedisCluster]:
    """A private Redis Cluster, 3 masters + 3 replicas on loopback ports, AOF on; every node is
    stopped (and its files removed) at the end of the session."""
    cluster = PrivateRedisCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def redis_backend(redis_url: str, request: pytest.FixtureRequest) -> RedisBackend:
    """The standalone Redis; the session's private Cluster for a module that sets
    ``ON_CLUSTER = True`` (its imported tests then run again there)."""
    if getattr(request.module, "ON_CLUSTER", False):
        return cluster_backend(request.getfixturevalue("redis_cluster"))
    return RedisBackend(redis_url)


def cluster_backend(redis_cluster: PrivateRedisCluster) -> RedisBackend:
    return RedisBackend(redis_cluster.url, cluster=True)


@pytest.fixture(scope="session")
def run_prefix() -> str:
    """Every key a test run writes lives under this prefix; the run deletes only those."""
    return RUN_PREFIX


@pytest.fixture
def key_prefix(run_prefix: str, request: pytest.FixtureRequest) -> str:
    """A prefix per test, so tests never see each other's queues."""
    return f"{run_prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def keys(key_prefix: str) -> Keys:
    return Keys.for_prefix(key_prefix)


@pytest.fixture
def settings(redis_backend: RedisBackend, key_prefix: str, tiny_model_dir: Path) -> Settings:
    backend = {"redis_url": redis_backend.url, "redis_cluster": redis_backend.cluster}
    return Settings(**backend, key_prefix=key_prefix, model=str(tiny_model_dir))  # type: ignore[arg-type]


@pytest.fixture
def redis_client(redis_backend: RedisBackend, run_prefix: str) -> Iterator[redis.Redis]:
    """A plain client of the test's Redis (a RedisCluster on the Cluster)."""
    backend = Settings(redis_url=redis_backend.url, redis_cluster=redis_backend.cluster)
    client = connect(backend, decode_responses=True)
    yield client  # type: ignore[misc]
    client.close()


@pytest.fixture(scope="session", autouse=True)
def _delete_run_keys(redis_url: str, run_prefix: str) -> Iterator[None]:
    yield
    client = redis.Redis.from_url(redis_url)
    # Test prefixes are hash-tagged ({iqtest-...-xxxx}); match them all by the run's stem.
    for key in client.scan_iter(match="{" + run_prefix + "*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.engine.model.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_name() -> str:
    return "smollm2-135m-instruct"


@pytest.fixture
def bench_env(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """For a benchmark's ``main`` run in the test's process: the stacks it starts use the test Redis
    (``INFLIGHTQ_REDIS_URL``), and settings are read afresh before it and not left cached after it."""
    from shared.settings import get_settings

    monkeypatch.setenv("INFLIGHTQ_REDIS_URL", redis_url)
    get_settings.cache_clear()
    yield redis_url
    get_settings.cache_clear()
