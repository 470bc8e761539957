"""Prefix affinity with real workers (tiny model, float64) and a real Redis: the API's dispatcher offers a
conversation's next turn to the worker that holds its history (what the held sets advertise), another
worker steals it once the holder is busy past the steal bound, or at once when the holder is dead; and
priority still decides what runs first.

Both workers are kept busy with a long request each (neither is idle, so nobody steals for being idle),
which makes where each turn runs a property of affinity alone: without it, the turn would land on
either worker."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import pytest

from inflightq_cli.redis_server import free_port
from producer_api.dispatch import Dispatcher
from shared.affinity import LIVE
from shared.async_client import AsyncQueueClient
from shared.client import QueueClient
from shared.prefix_hash import chain, to_hex
from shared.request_builder import build_request
from shared.schemas import FinalResult, QueuedRequest
from shared.settings import Settings
from tests.worker.conftest import greedy

pytestmark = pytest.mark.slow

HISTORY = [(17 * i) % 900 + 5 for i in range(70)]  # 4 full blocks of 16 and a partial one
# A long generation that keeps its worker busy for the whole test: on a quiet box the tiny model decodes
# a few hundred tokens within a steal bound, and a holder freed that early takes its own offer.
BLOCKER_TOKENS = 2000


def dispatch(settings: Settings, request: QueuedRequest) -> str:
    """Submits as the API does (``Dispatcher.submit``: the affinity lookup, then ENQUEUE with its offer)."""

    async def submit() -> str:
        async with AsyncQueueClient(settings) as client:
            return await Dispatcher(settings, client).submit(request)

    return asyncio.run(submit())


def holds(client: QueueClient, worker: str, tokens: list[int], block_size: int = 16) -> bool:
    held = client.redis.smembers(client.keys.held(client.settings.model, worker))
    return LIVE in held and {to_hex(h) for h in chain(tokens, block_size)} <= held


def wait_for(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def both_busy(client: QueueClient, priority: int = 1) -> list[str]:
    """A long request on each of the two workers: the first goes to whichever takes it, the second is
    offered to the other, which takes it (the first is no longer idle and the bound is far)."""
    blockers, taken = [], []
    for _ in range(2):
        request = build_request(client.settings, client.settings.model, [901, 902, 903], greedy(BLOCKER_TOKENS))
        request.priority = priority
        other = next((w.name for w in client.live_workers() if w.name not in taken), None) if taken else None
        request_id = client.enqueue(request, offer_to=other)
        wait_for(lambda r=request_id: (info := client.status(r)) is not None and info.worker is not None)
        info = client.status(request_id)
        assert info is not None and info.worker is not None and info.worker not in taken
        taken.append(info.worker)
        blockers.append(request_id)
    return blockers


def offered_to(client: QueueClient, request: QueuedRequest, worker: str) -> bool:
    """Whether ``request``'s entry is in ``worker``'s offer stream (beside any blocker running there)."""
    entries = client.redis.xrange(client.keys.offers(client.settings.model, request.priority, worker))
    return any(QueuedRequest.model_validate_json(fields["request"]).id == request.id for _, fields in entries)


def first_turn(client: QueueClient, settings: Settings) -> tuple[str, list[int]]:
    """Runs the conversation's first turn wherever it lands: that worker and the next turn's prompt."""
    request = build_request(settings, settings.model, HISTORY, greedy(20))
    result = client.result(client.enqueue(request), timeout=60)
    assert result.worker is not None
    follow_up = [*HISTORY, *result.token_ids, 7, 8, 9]
    wait_for(lambda: holds(client, result.worker, follow_up[: len(HISTORY) + 19]))  # all it computed
    return result.worker, follow_up


def metrics(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def counter(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in the metrics")


@pytest.fixture
def affinity_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"affinity": True})


def test_a_follow_up_turn_runs_on_the_worker_holding_its_history(
    spawn_worker: Any, client: QueueClient, affinity_settings: Settings
) -> None:
    env = {"INFLIGHTQ_AFFINITY_STEAL_AFTER_MS": "60000"}
    port = free_port()
    a = spawn_worker("aff-a", "--max-num-seqs", "4", "--metrics-port", str(port), env=env)
    holder, follow_up = first_turn(client, affinity_settings)  # a alone: it runs the first turn
    spawn_worker("aff-b", "--max-num-seqs", "4", env=env)
    both_busy(client)
    for turn in range(3):  # each turn's history grows on a, so each goes to a
        request = build_request(affinity_settings, affinity_settings.model, follow_up, greedy(8))
        result = client.result(dispatch(affinity_settings, request), timeout=60)
        assert result.worker == holder == a.name, f"turn {turn + 2} ran on {result.worker}"
        follow_up = [*follow_up, *result.token_ids, 11 + turn]
        wait_for(lambda f=follow_up: holds(client, a.name, f[:-2]))
    text = metrics(port)
    assert counter(text, "inflightq_worker_affinity_offers_taken_total") >= 3
    # Each turn found at least the first turn's history cached.
    assert counter(text, "inflightq_worker_engine_prefix_cache_hits_total") >= 3 * (len(HISTORY) // 16) * 16


def test_with_every_worker_idle_the_follow_up_still_runs_on_its_holder(
    spawn_worker: Any, client: QueueClient, affinity_settings: Settings
) -> None:
    """An offer to an idle worker wakes it alone: the other idle worker, which would steal it, is not woken."""
    a = spawn_worker("idle-a", "--max-num-seqs", "4")
    holder, follow_up = first_turn(client, affinity_settings)
    spawn_worker("idle-b", "--max-num-seqs", "4")
    for turn in range(4):
        wait_for(lambda: all(w.running == 0 for w in client.live_workers()))
        request = build_request(affinity_settings, affinity_settings.model, follow_up, greedy(8))
        result = client.result(dispatch(affinity_settings, request), timeout=60)
        assert result.worker == holder == a.name, f"turn {turn + 2} ran on {result.worker}"
        follow_up = [*follow_up, *result.token_ids, 11 + turn]
        wait_for(lambda f=follow_up: holds(client, a.name, f[:-2]))


def test_an_offer_is_stolen_once_its_worker_is_busy_past_the_bound(
    spawn_worker: Any, client: QueueClient, affinity_settings: Settings
) -> None:
    bound_ms = 1500
    env = {"INFLIGHTQ_AFFINITY_STEAL_AFTER_MS": str(bound_ms)}
    port = free_port()
    a = spawn_worker("steal-a", "--max-num-seqs", "1", env={**env, "INFLIGHTQ_PREFETCH_SEQS": "0"})
    holder, follow_up = first_turn(client, affinity_settings)
    b = spawn_worker("steal-b", "--max-num-seqs", "4", "--metrics-port", str(port), env=env)
    both_busy(client)  # a is full (it cannot start the follow-up); b is not idle (only the bound lets it steal)
    request = build_request(affinity_settings, affinity_settings.model, follow_up, greedy(8))
    request_id = dispatch(affinity_settings, request)
    assert offered_to(client, request, a.name)
    result: FinalResult = client.result(request_id, timeout=60)
    assert holder == a.name and result.worker == b.name
    assert result.timings.queue_time_s >= bound_ms / 1000 - 0.1  # it waited for a first
    text = metrics(port)
    assert counter(text, "inflightq_worker_affinity_offers_timed_out_total") == 1
    assert counter(text, "inflightq_worker_affinity_steals_total", reason="timed_out") == 1


def test_an_offer_to_a_dead_worker_is_taken_at_once(
    spawn_worker: Any, client: QueueClient, affinity_settings: Settings
) -> None:
    # A held set outlives its worker by heartbeat_ttl_s at most; the takeover deletes it sooner.
    env = {"INFLIGHTQ_AFFINITY_STEAL_AFTER_MS": "60000", "INFLIGHTQ_HEARTBEAT_TTL_S": "10"}
    port = free_port()
    a = spawn_worker("dead-a", "--max-num-seqs", "4", env=env)
    holder, follow_up = first_turn(client, affinity_settings)
    b = spawn_worker("dead-b", "--max-num-seqs", "4", "--metrics-port", str(port), env=env)
    both_busy(client)  # b is not idle: only a's death lets it take a's offer before the bound
    a.signal(signal.SIGKILL)
    a.wait(timeout=10)
    request = build_request(affinity_settings, affinity_settings.model, follow_up, greedy(8))
    submitted = time.monotonic()
    request_id = dispatch(affinity_settings, request)  # a still looks live: its heartbeat is fresh
    offered = offered_to(client, request, a.name)
    result = client.result(request_id, timeout=60)
    assert holder == a.name and offered and result.worker == b.name
    assert time.monotonic() - submitted < 9  # b's takeover of a deleted a's held set (its TTL is 10 s)
    text = metrics(port)
    # b takes it as a dead worker's, or as an idle one's when its blocker (and a's, re-run) ended first.
    at_once = sum(counter(text, "inflightq_worker_affinity_steals_total", reason=r) for r in ("worker_gone", "idle"))
    assert at_once == 1 and counter(text, "inflightq_worker_affinity_steals_total", reason="timed_out") == 0


def test_priority_decides_before_affinity(spawn_worker: Any, client: QueueClient, affinity_settings: Settings) -> None:
    """The holder's own offer at a less urgent priority waits behind a more urgent request nobody holds."""
    env = {"INFLIGHTQ_AFFINITY_STEAL_AFTER_MS": "60000", "INFLIGHTQ_PREFETCH_SEQS": "0"}
    a = spawn_worker("prio-a", "--max-num-seqs", "1", env=env)
    holder, follow_up = first_turn(client, affinity_settings)
    spawn_worker("prio-b", "--max-num-seqs", "1", env=env)
    blockers = both_busy(client, priority=0)  # both full, at the most urgent level
    later = build_request(affinity_settings, affinity_settings.model, follow_up, greedy(4))
    later.priority = 3
    later_id = dispatch(affinity_settings, later)
    assert holder == a.name and client.redis.xlen(client.keys.offers(affinity_settings.model, 3, a.name)) == 1
    urgent = build_request(affinity_settings, affinity_settings.model, [950, 951, 952], greedy(4))
    urgent.priority = 0
    urgent_id = dispatch(affinity_settings, urgent)
    for blocker in blockers:
        client.result(blocker, timeout=120)
    first, second = client.result(urgent_id, timeout=60), client.result(later_id, timeout=60)
    assert first.timings.started_at is not None and second.timings.started_at is not None
    assert first.timings.started_at < second.timings.started_at
