"""The worker service end to end: real worker processes, real Redis, the tiny model in float64."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from inflightq_cli.redis_server import free_port
from shared.client import QueueClient
from shared.keys import CONSUMER_GROUP
from shared.request_lifecycle import RequestStatus
from shared.schemas import DeadLetter, DoneEvent, ErrorEvent, SamplingSpec, TokenEvent
from shared.work_queue import STREAM_FIELD
from tests.worker import faulty_worker, paced_worker
from tests.worker.conftest import greedy
from worker.watchdog import EXIT_ENGINE_STALLED

PROMPT = [1, 2, 3, 4, 5]


def prompt(i: int) -> list[int]:
    return [10 + i, 200 + 7 * i, 3000 + i, 42]


def wait_for(predicate, timeout: float = 30.0, every: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError("condition not met in time")


def tokens_sent(client: QueueClient, request_id: str) -> int:
    return client.redis.xlen(client.keys.replay_log(request_id))


def test_a_worker_serves_a_request_and_stores_its_result(spawn_worker, client, reference, worker_env) -> None:
    metrics_port = free_port()
    spawn_worker("solo", "--metrics-port", str(metrics_port))
    request_id = client.submit(client.settings.model, PROMPT, greedy(12))
    result = client.result(request_id, timeout=30)
    assert result.token_ids == reference(PROMPT, 12)
    assert result.finish_reason == "length" and result.worker == "solo"
    assert result.usage.completion_tokens == 12 and result.usage.prompt_tokens == len(PROMPT)
    assert result.timings.started_at is not None and result.timings.first_token_at is not None
    info = client.status(request_id)
    assert info is not None and info.status is RequestStatus.DONE and info.attempt == 0
    assert client.redis.ttl(client.keys.request(request_id)) > 0
    stream = client.keys.stream(client.settings.model, 1)
    assert client.redis.xpending(stream, CONSUMER_GROUP)["pending"] == 0, "finished entries are acknowledged"
    shown = subprocess.run(
        [sys.executable, "-m", "inflightq_cli", "status"], env=worker_env, capture_output=True, text=True, check=True
    ).stdout
    assert "1 live worker(s)" in shown and "solo" in shown and "p0=0 p1=0 p2=0 p3=0" in shown
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert 'inflightq_worker_generated_tokens_total{model="' in metrics
    assert "inflightq_worker_completed_total{model=" in metrics and "inflightq_worker_free_kv_blocks" in metrics


def test_strict_priority_order_when_the_batch_is_full(spawn_worker, client) -> None:
    spawn_worker("one-seat", "--max-num-seqs", "1")
    model = client.settings.model
    # At priority 0 nothing may preempt it (tests/worker/test_priority.py covers preemption).
    blocker = client.submit(model, PROMPT, greedy(60), priority=0)
    wait_for(lambda: tokens_sent(client, blocker) > 0)
    # Submitted least urgent first: a FIFO worker would run them in this order.
    ids = {p: client.submit(model, prompt(p), greedy(3), priority=p) for p in (3, 2, 1, 0)}
    assert sum(client.queue_depth(model).values()) == 4, "what the worker cannot start stays in Redis"
    for request_id in ids.values():
        client.result(request_id, timeout=60)
    started = {p: client.status(r).started_at for p, r in ids.items()}  # type: ignore[union-attr]
    assert sorted(started, key=lambda p: started[p]) == [0, 1, 2, 3]


LONG = 600  # tokens of the request that keeps a one-slot worker busy


@pytest.mark.slow
def test_a_worker_prefetches_what_it_is_told_beyond_its_running_slots(spawn_worker, client, reference) -> None:
    spawn_worker("prefetcher", "--max-num-seqs", "1", env={"INFLIGHTQ_PREFETCH_SEQS": "1"})
    model = client.settings.model
    # Long enough that it still runs while the next two arrive: the tiny model decodes 60 tokens in well
    # under a second on a quiet box, and a freed slot lets the worker take the second one too.
    running = client.submit(model, PROMPT, greedy(LONG))
    wait_for(lambda: tokens_sent(client, running) > 0)
    ahead, behind = (client.submit(model, prompt(i), greedy(4)) for i in (1, 2))
    # One waits inside the worker (taken, so no other worker will run it); the next stays in Redis.
    wait_for(lambda: client.status(ahead).worker == "prefetcher")  # type: ignore[union-attr]
    assert sum(client.queue_depth(model).values()) == 1 and client.status(behind).worker is None  # type: ignore[union-attr]
    assert tokens_sent(client, ahead) == 0
    for request_id, (p, n) in zip(
        (running, ahead, behind), ((PROMPT, LONG), (prompt(1), 4), (prompt(2), 4)), strict=True
    ):
        assert client.result(request_id, timeout=60).token_ids == reference(p, n)


@pytest.mark.slow
def test_two_workers_share_one_queue(spawn_worker, client, reference) -> None:
    workers = [spawn_worker(name, "--max-num-seqs", "2", ready=False) for name in ("share-a", "share-b")]
    for worker in workers:
        worker.wait_ready(client)
    ids = [client.submit(client.settings.model, prompt(i), greedy(24)) for i in range(8)]
    results = [client.result(r, timeout=60) for r in ids]
    assert {r.worker for r in results} == {"share-a", "share-b"}
    for i, result in enumerate(results):
        assert result.token_ids == reference(prompt(i), 24)


@pytest.mark.slow
def test_a_worker_runs_the_threads_it_is_given_and_reports_them(spawn_worker, client) -> None:
    spawn_worker("one-thread", env={"INFLIGHTQ_TORCH_THREADS": "1"})
    spawn_worker("two-threads", env={"INFLIGHTQ_TORCH_THREADS": "2"})
    assert {w.name: w.threads for w in client.live_workers()} == {"one-thread": 1, "two-threads": 2}


@pytest.mark.slow
def test_a_worker_runs_its_share_of_the_cpus_it_may_use_not_torchs_count(spawn_worker, client) -> None:
    from worker.engine.core.cpu_threads import affinity, cgroup_cpu_quota, usable_cpus

    # torch alone would run 64 threads here (OMP_NUM_THREADS), whatever the CPUs.
    many = {"OMP_NUM_THREADS": "64"}
    spawn_worker("alone", env=many)
    spawn_worker("one-of-two", env={**many, "INFLIGHTQ_WORKERS_PER_HOST": "2"})
    cpus, quota = len(affinity()), cgroup_cpu_quota()
    expected = {"alone": usable_cpus(cpus, quota), "one-of-two": usable_cpus(cpus, quota, 1 / 2)}
    assert {w.name: w.threads for w in client.live_workers()} == expected


@pytest.mark.slow
def test_a_hung_engine_loop_exits_the_worker_and_its_request_is_taken_over(spawn_worker, client, reference) -> None:
    hangs = spawn_worker("hangs", env={"INFLIGHTQ_ENGINE_STALL_S": "2"}, script=faulty_worker.SCRIPT)
    stuck_prompt = [5, faulty_worker.HANG_TOKEN, 6]
    stuck = client.submit(client.settings.model, stuck_prompt, greedy(8))
    # Its heartbeat thread is healthy; only the watchdog notices the engine loop is not.
    assert hangs.wait(timeout=30) == EXIT_ENGINE_STALLED
    assert "engine loop made no progress" in hangs.log()
    spawn_worker("rescuer")
    assert client.result(stuck, timeout=60).token_ids == reference(stuck_prompt, 8)


def test_cancel_mid_generation_frees_the_slot_and_acknowledges(spawn_worker, client) -> None:
    spawn_worker("canceller", "--max-num-seqs", "1")
    model = client.settings.model
    request_id = client.submit(model, PROMPT, greedy(1500))
    events = client.stream(request_id, timeout=60)
    seen = [next(events) for _ in range(3)]
    assert client.cancel(request_id) is True
    rest = list(events)
    assert isinstance(rest[-1], ErrorEvent) and rest[-1].error_type == "cancelled"
    assert [e.index for e in seen + rest[:-1]] == list(range(len(seen) + len(rest) - 1))
    wait_for(lambda: client.status(request_id).status is RequestStatus.CANCELLED)  # type: ignore[union-attr]
    # The ack follows the final write (on a Cluster in another node's round trip): wait for it too.
    wait_for(lambda: client.redis.xpending(client.keys.stream(model, 1), CONSUMER_GROUP)["pending"] == 0)
    # The single seat is free again: the next request runs.
    assert client.result(client.submit(model, PROMPT, greedy(2)), timeout=30).usage.completion_tokens == 2


def test_deadlines_expire_queued_and_running_requests(spawn_worker, client) -> None:
    spawn_worker("timekeeper", "--max-num-seqs", "1")
    model = client.settings.model
    running = client.submit(model, PROMPT, greedy(1000), deadline=time.time() + 1.5)
    wait_for(lambda: tokens_sent(client, running) > 0)
    queued = client.submit(model, PROMPT, greedy(2), deadline=time.time() + 0.5)
    for request_id in (running, queued):
        events = list(client.stream(request_id, timeout=30))
        assert isinstance(events[-1], ErrorEvent) and events[-1].error_type == "expired"
        info = client.status(request_id)
        assert info is not None and info.status is RequestStatus.EXPIRED
    assert client.status(running).error.index > 0  # type: ignore[union-attr]
    assert client.status(queued).started_at is None, "a request past its deadline is never started"  # type: ignore[union-attr]


def test_a_late_subscriber_gets_the_whole_stream(spawn_worker, client) -> None:
    spawn_worker("storyteller")
    request_id = client.submit(client.settings.model, PROMPT, greedy(40))
    wait_for(lambda: tokens_sent(client, request_id) >= 10)
    midway = list(client.stream(request_id, timeout=30))
    after = list(client.stream(request_id, timeout=30))
    assert midway == after
    result = after[-1]
    assert isinstance(result, DoneEvent)
    tokens = [e for e in after if isinstance(e, TokenEvent)]
    assert [e.index for e in tokens] == list(range(40))
    assert [e.token_id for e in tokens] == result.result.token_ids
    assert "".join(e.text for e in tokens) == result.result.text
    assert tokens[-1].finish_reason == "length"


VICTIM_TOKENS = 10


@pytest.mark.slow
def test_kill_9_mid_generation_is_taken_over_with_identical_output(spawn_worker, client, reference) -> None:
    model = client.settings.model
    # The victim is paced (tests/worker/paced_worker.py): it generates VICTIM_TOKENS per request and then
    # waits, so the kill lands mid-generation however fast the machine runs the model.
    victim = spawn_worker("victim", "--max-num-seqs", "2", ready=False, script=paced_worker.SCRIPT)
    survivor = spawn_worker("survivor", "--max-num-seqs", "2", ready=False)
    victim.wait_ready(client)
    survivor.wait_ready(client)
    n = 80
    ids = [client.submit(model, prompt(i), greedy(n)) for i in range(4)]
    for request_id in ids:
        paced_worker.allow_steps(client.redis, client.settings.key_prefix, request_id, VICTIM_TOKENS)
    streams: dict[str, list] = {r: [] for r in ids}

    def follow(request_id: str) -> None:
        streams[request_id] = list(client.stream(request_id, timeout=120))

    followers = [threading.Thread(target=follow, args=(r,)) for r in ids]
    for thread in followers:
        thread.start()

    def victim_is_mid_generation() -> bool:
        infos = [client.status(r) for r in ids]
        running = [i for i in infos if i and i.worker == "victim" and i.status is RequestStatus.RUNNING]
        return any(5 < tokens_sent(client, i.id) < n for i in running)

    wait_for(victim_is_mid_generation, timeout=60, every=0.01)
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)
    for thread in followers:
        thread.join(timeout=120)
    taken_over = 0
    for i, request_id in enumerate(ids):
        events = streams[request_id]
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert [e.index for e in tokens] == list(range(n)), "no gap, no duplicate"
        assert isinstance(events[-1], DoneEvent)
        assert events[-1].result.token_ids == [e.token_id for e in tokens] == reference(prompt(i), n)
        info = client.status(request_id)
        assert info is not None and info.status is RequestStatus.DONE
        taken_over += info.attempt > 0
        log = client.redis.xrange(client.keys.replay_log(request_id))
        assert sum('"type":"done"' in fields["e"] for _, fields in log) == 1, "completed exactly once"
    assert taken_over >= 1
    assert client.redis.xpending(client.keys.stream(model, 1), CONSUMER_GROUP)["pending"] == 0


@pytest.mark.slow
def test_poison_entries_go_to_the_dead_letters_and_the_worker_keeps_serving(spawn_worker, client) -> None:
    spawn_worker("sturdy")
    model = client.settings.model
    stream = client.keys.stream(model, 0)
    client.ensure_groups(model)
    client.redis.xadd(stream, {STREAM_FIELD: "{not json"})
    client.redis.xadd(stream, {STREAM_FIELD: '{"id": "half-a-request", "model": "m"}'})
    too_long = client.submit(model, [7] * 5000, greedy(2), priority=0)  # beyond the model's context
    fine = client.submit(model, PROMPT, greedy(3), priority=0)
    assert client.result(fine, timeout=30).usage.completion_tokens == 3
    for request_id in ("half-a-request", too_long):
        events = list(client.stream(request_id, timeout=30))
        assert isinstance(events[-1], ErrorEvent) and events[-1].error_type == "generation"
    assert client.status(too_long).status is RequestStatus.FAILED  # type: ignore[union-attr]
    letters = [DeadLetter.model_validate_json(f["letter"]) for f in client.dead_letters(model)]
    assert len(letters) == 3
    assert {letter.request_id for letter in letters} == {None, "half-a-request", too_long}
    assert all(letter.reason for letter in letters)
    assert client.redis.xlen(stream) == 0 and client.redis.xpending(stream, CONSUMER_GROUP)["pending"] == 0


@pytest.mark.slow
def test_sigterm_drains_running_requests_and_exits_0(spawn_worker, client, reference) -> None:
    worker = spawn_worker("drainer")
    model = client.settings.model
    request_id = client.submit(model, PROMPT, greedy(80))
    wait_for(lambda: tokens_sent(client, request_id) > 0)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert client.result(request_id, timeout=5).token_ids == reference(PROMPT, 80)
    assert client.live_workers() == [], "a stopped worker takes its heartbeat with it"


@pytest.mark.slow
def test_sigterm_past_the_drain_timeout_hands_the_rest_back(spawn_worker, client, reference) -> None:
    # Paced (tests/worker/paced_worker.py): one token per request per 10 ms, so the 0.3 s drain timeout
    # finds both running however fast the machine runs the model (300 tokens would take 3 s).
    env = {"INFLIGHTQ_DRAIN_TIMEOUT_S": "0.3"}
    hurried = spawn_worker("hurried", env=env, script=paced_worker.SCRIPT)
    model, prefix = client.settings.model, client.settings.key_prefix
    request_id = client.submit(model, PROMPT, greedy(300))
    seeded = SamplingSpec(max_new_tokens=300, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
    sampled_id = client.submit(model, prompt(1), seeded)
    # Both take their permits in one step, so they get them together (a step waits for each of its requests).
    with paced_worker.trickle(client.redis, prefix, [request_id, sampled_id]):
        wait_for(lambda: tokens_sent(client, request_id) >= 10 and tokens_sent(client, sampled_id) >= 10, timeout=60)
        hurried.signal(signal.SIGTERM)
        assert hurried.wait(timeout=30) == 0
    for rid in (request_id, sampled_id):
        info = client.status(rid)
        assert info is not None and info.status is RequestStatus.RUNNING and info.worker == "hurried"
        assert tokens_sent(client, rid) < 300
    spawn_worker("heir")
    result = client.result(request_id, timeout=120)
    assert result.worker == "heir" and result.token_ids == reference(PROMPT, 300)
    info = client.status(request_id)
    assert info is not None and info.attempt == 1
    assert info.deliveries == 1, "a graceful hand-back does not count against max_deliveries"
    # Seeded sampling resumes where it stopped too: same tokens as an uninterrupted run.
    resumed = client.result(sampled_id, timeout=120)
    uninterrupted = client.result(client.submit(model, prompt(1), seeded), timeout=120)
    assert resumed.token_ids == uninterrupted.token_ids


@pytest.mark.slow
def test_a_seeded_sampled_request_is_reproducible(spawn_worker, client) -> None:
    spawn_worker("sampler")
    spec = SamplingSpec(max_new_tokens=16, temperature=0.9, top_k=50, seed=1234, ignore_eos=True)
    first = client.result(client.submit(client.settings.model, PROMPT, spec), timeout=30)
    second = client.result(client.submit(client.settings.model, PROMPT, spec), timeout=30)
    assert first.token_ids == second.token_ids


@pytest.mark.slow
def test_a_request_that_breaks_the_engine_is_dead_lettered_after_max_deliveries(
    spawn_worker, client, reference
) -> None:
    spawn_worker("breakable", script=faulty_worker.SCRIPT)
    model = client.settings.model
    innocent = client.submit(model, PROMPT, greedy(300))
    wait_for(lambda: tokens_sent(client, innocent) > 3)
    breaker = client.submit(model, [7, faulty_worker.BREAK_TOKEN], greedy(2))  # its first step raises
    events = list(client.stream(breaker, timeout=60))
    assert isinstance(events[-1], ErrorEvent) and events[-1].error_type == "generation"
    info = client.status(breaker)
    assert info is not None and info.status is RequestStatus.FAILED
    # Raising inside a step, it is charged a delivery each time and retried, up to max_deliveries.
    assert 2 <= info.deliveries <= client.settings.max_deliveries + 1
    letters = [DeadLetter.model_validate_json(f["letter"]) for f in client.dead_letters(model)]
    assert [letter.request_id for letter in letters] == [breaker]
    # Its batch mate was handed back uncharged each time, resumed, and finished as if nothing happened.
    assert client.result(innocent, timeout=120).token_ids == reference(PROMPT, 300)
    assert client.status(innocent).deliveries == 1  # type: ignore[union-attr]
    assert client.result(client.submit(model, PROMPT, greedy(3)), timeout=30).usage.completion_tokens == 3
