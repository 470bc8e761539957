"""A SIGKILLed worker's requests are taken over within seconds at the default settings: its
heartbeat stops and another worker takes its entries at once, instead of after
``reclaim_after_s`` (30 s) of idleness. A live worker's entry is never taken, however long it
sits idle."""

from __future__ import annotations

import signal
import threading
import time

from shared.request_lifecycle import RequestStatus
from shared.schemas import DoneEvent, TokenEvent
from shared.settings import Settings
from tests.faults.test_drain_and_ids import logged_indices
from tests.worker import paced_worker
from tests.worker.conftest import DEFAULT_RECOVERY, greedy
from tests.worker.test_worker import PROMPT, tokens_sent, wait_for
from worker.heartbeat_watch import dead_after_s

TAKEOVER_WITHIN_S = 5.0
PACED_TOKENS = 20


def test_a_killed_workers_stream_continues_within_5_s_at_the_defaults(spawn_worker, client, reference) -> None:
    n = 200
    model, prefix = client.settings.model, client.settings.key_prefix
    # Paced (tests/worker/paced_worker.py): it sends PACED_TOKENS, then waits for permits that never
    # come, so it is killed mid-request however fast the machine runs the model.
    dying = spawn_worker("dying", env=DEFAULT_RECOVERY, script=paced_worker.SCRIPT)
    request_id = client.submit(model, PROMPT, greedy(n))
    paced_worker.allow_steps(client.redis, prefix, request_id, PACED_TOKENS)
    wait_for(lambda: tokens_sent(client, request_id) >= PACED_TOKENS, timeout=60)
    events: list = []
    follower = threading.Thread(target=lambda: events.extend(client.stream(request_id, timeout=300)))
    follower.start()
    spawn_worker("heir", env=DEFAULT_RECOVERY)
    # The paced worker is alive and beating while its entry sits idle: twice a dead worker's grace,
    # and nobody takes the request from it.
    time.sleep(2 * dead_after_s(Settings()))
    info = client.status(request_id)
    assert info is not None and info.attempt == 0 and info.worker == "dying"
    assert tokens_sent(client, request_id) == PACED_TOKENS

    killed_ms = int(time.time() * 1000)  # the replay log's entry ids are the same host's clock, in ms
    dying.signal(signal.SIGKILL)
    dying.wait(timeout=10)
    result = client.result(request_id, timeout=120)
    follower.join(timeout=60)

    assert result.token_ids == reference(PROMPT, n)
    info = client.status(request_id)
    assert info is not None and info.status is RequestStatus.DONE and info.attempt == 1 and info.worker == "heir"
    indices, times = logged_indices(client, request_id)
    assert indices == list(range(n))
    resumed_s = (times[PACED_TOKENS] - killed_ms) / 1000
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [e.index for e in tokens] == list(range(n)) and isinstance(events[-1], DoneEvent)
    print(f"FAULTS worker death at the defaults: next token {resumed_s:.2f} s after the SIGKILL")
    assert resumed_s < TAKEOVER_WITHIN_S, f"the stream went on {resumed_s:.2f} s after the kill"
