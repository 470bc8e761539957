"""Priorities while the pool is full: real worker processes, real Redis, the tiny model in float64.

Progress is counted in the background requests' tokens (one per engine step while they decode),
not in seconds: without urgency-aware intake an urgent request waits until a background one
finishes (BACKGROUND_TOKENS steps); with it, within a few steps."""

from __future__ import annotations

import httpx
import pytest

from inflightq_cli.redis_server import free_port
from shared.client import QueueClient
from shared.schemas import TokenEvent
from tests.worker import paced_worker, slow_worker
from tests.worker.conftest import greedy
from tests.worker.test_worker import prompt, tokens_sent, wait_for

pytestmark = pytest.mark.slow

BACKGROUND_TOKENS = 600
# The urgent request must start before the background requests have made this many steps more.
# Generous (the intake looks every urgent_poll_s, and a step of the tiny model takes a few ms),
# yet a small share of BACKGROUND_TOKENS.
STEPS_BOUND = 150


def fill(client: QueueClient, count: int, tokens: int = BACKGROUND_TOKENS) -> list[str]:
    """Priority-3 requests that keep every slot busy; returns once all of them are generating."""
    ids = [client.submit(client.settings.model, prompt(i), greedy(tokens), priority=3) for i in range(count)]
    wait_for(lambda: all(tokens_sent(client, r) > 0 for r in ids), timeout=60)
    return ids


def urgency_preemptions(client: QueueClient) -> dict[str, int]:
    return {w.name: w.preemptions for w in client.live_workers()}


def test_a_full_worker_takes_an_urgent_request_within_a_few_steps(spawn_worker, client, reference) -> None:
    spawn_worker("full", "--max-num-seqs", "2", env={"INFLIGHTQ_PREFETCH_SEQS": "0"})
    background = fill(client, 2)
    queued = client.submit(client.settings.model, prompt(9), greedy(BACKGROUND_TOKENS), priority=3)
    progress_at_submit = max(tokens_sent(client, r) for r in background)
    urgent = client.submit(client.settings.model, prompt(7), greedy(8), priority=0)
    wait_for(lambda: tokens_sent(client, urgent) > 0, timeout=60)
    progress = max(tokens_sent(client, r) for r in background) - progress_at_submit
    assert progress < STEPS_BOUND, f"the urgent request waited {progress} background steps"
    assert client.result(urgent, timeout=60).token_ids == reference(prompt(7), 8)
    # It displaced one running request; the queued background request was not taken to make room.
    assert client.status(queued).worker is None  # type: ignore[union-attr]
    wait_for(lambda: urgency_preemptions(client)["full"] == 1, timeout=10)


def test_the_preempted_request_streams_every_token_once_in_order(spawn_worker, client, reference) -> None:
    spawn_worker("full", "--max-num-seqs", "1", env={"INFLIGHTQ_PREFETCH_SEQS": "0"})
    (background,) = fill(client, 1)
    urgent = client.submit(client.settings.model, prompt(7), greedy(8), priority=0)
    events = list(client.stream(background, timeout=120))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [e.index for e in tokens] == list(range(BACKGROUND_TOKENS))
    assert [e.token_id for e in tokens] == reference(prompt(0), BACKGROUND_TOKENS)
    assert client.result(urgent).token_ids == reference(prompt(7), 8)
    started = {r: client.status(r).started_at for r in (background, urgent)}  # type: ignore[union-attr]
    finished = {r: client.result(r).timings.finished_at for r in (background, urgent)}
    assert started[background] < started[urgent] and finished[urgent] < finished[background]


def test_of_two_full_workers_exactly_one_takes_the_urgent_request(spawn_worker, client, reference) -> None:
    for name in ("full-a", "full-b"):
        spawn_worker(name, "--max-num-seqs", "1", env={"INFLIGHTQ_PREFETCH_SEQS": "0"})
    background = fill(client, 2)
    assert {client.status(r).worker for r in background} == {"full-a", "full-b"}  # type: ignore[union-attr]
    urgent = client.submit(client.settings.model, prompt(7), greedy(8), priority=0)
    result = client.result(urgent, timeout=60)
    assert result.token_ids == reference(prompt(7), 8)
    assert client.status(urgent).deliveries == 1  # type: ignore[union-attr]  # read once, never handed on
    wait_for(lambda: sum(urgency_preemptions(client).values()) == 1, timeout=10)
    assert urgency_preemptions(client)[result.worker] == 1  # type: ignore[index]
    for i, request_id in enumerate(background):
        assert client.result(request_id, timeout=120).token_ids == reference(prompt(i), BACKGROUND_TOKENS)


def test_a_worker_with_a_free_slot_wins_over_a_full_one(spawn_worker, client, reference) -> None:
    # "full" is paced (tests/worker/paced_worker.py): its background request generates 10 tokens and
    # waits while "free" loads, so it is still running however fast the box runs the model.
    spawn_worker("full", "--max-num-seqs", "1", env={"INFLIGHTQ_PREFETCH_SEQS": "0"}, script=paced_worker.SCRIPT)
    model, prefix = client.settings.model, client.settings.key_prefix
    background = client.submit(model, prompt(0), greedy(BACKGROUND_TOKENS), priority=3)
    paced_worker.allow_steps(client.redis, prefix, background, 10)
    wait_for(lambda: tokens_sent(client, background) > 0, timeout=60)
    spawn_worker("free", "--max-num-seqs", "1", env={"INFLIGHTQ_PREFETCH_SEQS": "0"})
    assert client.status(background).finished_at is None  # type: ignore[union-attr]
    urgent = client.submit(model, prompt(7), greedy(8), priority=0)
    result = client.result(urgent, timeout=60)
    assert result.worker == "free" and result.token_ids == reference(prompt(7), 8)
    assert urgency_preemptions(client) == {"full": 0, "free": 0}
    paced_worker.allow_steps(client.redis, prefix, background, BACKGROUND_TOKENS)  # now let it finish
    assert client.result(background, timeout=120).token_ids == reference(prompt(0), BACKGROUND_TOKENS)


def test_background_work_still_finishes_under_a_stream_of_urgent_requests(spawn_worker, client, reference) -> None:
    spawn_worker("full", "--max-num-seqs", "2", env={"INFLIGHTQ_PREFETCH_SEQS": "0"})
    background = fill(client, 2)
    urgent = [client.submit(client.settings.model, prompt(20 + i), greedy(4), priority=i % 3) for i in range(12)]
    for i, request_id in enumerate(urgent):
        assert client.result(request_id, timeout=120).token_ids == reference(prompt(20 + i), 4)
    for i, request_id in enumerate(background):
        assert client.result(request_id, timeout=120).token_ids == reference(prompt(i), BACKGROUND_TOKENS)


def interrupted_steps(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("inflightq_worker_engine_interrupted_steps_total{"))
    return float(line.rsplit(" ", 1)[1])


def test_an_urgent_arrival_stops_the_step_in_progress_and_every_output_stays_exact(
    spawn_worker, client, reference
) -> None:
    # Steps of ~0.2 s, nearly all of it before their first layer's check (slow_worker.py), so an urgent
    # request lands mid-step; the step it stops is computed again, and neither request may notice.
    metrics_port = free_port()
    env = {"INFLIGHTQ_PREFETCH_SEQS": "0", "INFLIGHTQ_TEST_STEP_S": "0", "INFLIGHTQ_TEST_LAYER_S": "0.2"}
    spawn_worker("slow", "--max-num-seqs", "1", "--metrics-port", str(metrics_port), env=env, script=slow_worker.SCRIPT)
    model = client.settings.model
    background = client.submit(model, prompt(0), greedy(40), priority=3)
    wait_for(lambda: tokens_sent(client, background) > 0, timeout=60)
    # Each arrival lands between two steps with a chance of a few in a hundred: three, one after another.
    urgent = []
    for i in range(3):
        urgent.append(client.submit(model, prompt(7 + i), greedy(2), priority=0))
        assert client.result(urgent[-1], timeout=60).token_ids == reference(prompt(7 + i), 2)
    assert client.status(background).finished_at is None  # type: ignore[union-attr]
    assert interrupted_steps(metrics_port) >= 1
    tokens = [e for e in client.stream(background, timeout=120) if isinstance(e, TokenEvent)]
    assert [e.index for e in tokens] == list(range(40))
    assert [e.token_id for e in tokens] == reference(prompt(0), 40)
