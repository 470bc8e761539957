"""End to end, a worker takes queued work most urgent stream first, first come first within one.

The engine re-sorts whatever the worker holds by priority, so the order the intake reads the
streams in shows only where the engine holds one request at a time: a worker with a single slot
and no prefetch, started after requests of every priority were queued, starts each (its first
engine step, from the worker's step log: tests/worker/step_log_worker.py) once the one before
has finished."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.client import QueueClient
from tests.worker import step_log_worker
from tests.worker.conftest import SpawnWorker, greedy
from tests.worker.step_log_worker import read_steps

pytestmark = pytest.mark.timeout(180)

PROMPT = [1, 2, 3, 4, 5]


def test_a_one_slot_worker_starts_queued_work_most_urgent_first(
    spawn_worker: SpawnWorker, client: QueueClient, tmp_path: Path
) -> None:
    model = client.settings.model
    priorities = [3, 1, 2, 0, 1, 3, 0]  # submission order
    queued = [(p, client.submit(model, PROMPT, greedy(2), priority=p)) for p in priorities]
    step_log = tmp_path / "steps.jsonl"
    env = {"INFLIGHTQ_PREFETCH_SEQS": "0", "INFLIGHTQ_TEST_STEP_LOG": str(step_log)}
    spawn_worker("one-slot", "--max-num-seqs", "1", env=env, script=step_log_worker.SCRIPT)
    for _, request_id in queued:
        assert client.result(request_id, timeout=120).usage.completion_tokens == 2
    started: list[str] = []
    for step in read_steps(step_log):
        assert len(step.held) == 1, f"the worker held more than its one slot: {step.held}"
        started += [r for r in step.batch if r not in started]
    priority_of = {request_id: p for p, request_id in queued}
    assert [priority_of[r] for r in started] == sorted(priorities)
    by_priority = sorted(queued, key=lambda queued: queued[0])  # stable: submission order within a priority
    assert started == [request_id for _, request_id in by_priority]
