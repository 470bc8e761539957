"""The fault suite: real worker processes (tests/worker's fixtures), real API servers
(tests/api's), and private Redis servers with an append-only file where a test restarts Redis.

Marked ``faults``; ``INFLIGHTQ_FAULTS_HEAVY=1`` runs the heavier variants (more requests, more
streams) that docs/reliability.md reports, and ``INFLIGHTQ_FAULTS_AT_DEFAULTS=1`` runs the workers at
the default recovery settings (its "defaults" column; ``tests/worker/conftest.py``)."""

from __future__ import annotations

import os

import pytest

from tests.api.conftest import start_api, tiny_tokenizer  # noqa: F401 - fixtures
from tests.worker.conftest import client, reference, spawn_worker, worker_env  # noqa: F401 - fixtures

HEAVY = os.environ.get("INFLIGHTQ_FAULTS_HEAVY") == "1"


def scale(light: int, heavy: int) -> int:
    return heavy if HEAVY else light


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)
    # A heavy-only test is left out, not skipped: under CI=true a skip fails the run
    # (tests/ci_skips.py), and a light run has nothing of it to run.
    if not HEAVY:
        heavy = [item for item in items if item.get_closest_marker("heavy_only") is not None]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if item.get_closest_marker("heavy_only") is None]
