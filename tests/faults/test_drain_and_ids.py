"""A graceful drain hands its requests over like a takeover (from the replay log, never from
token 0), and a reused request id is refused without touching the request that owns it."""

from __future__ import annotations

import signal
import time
from collections import Counter
from itertools import pairwise

import pytest

from shared.errors import ConflictError
from shared.event_delivery import parse_log_entry
from shared.request_lifecycle import RequestStatus
from shared.schemas import TokenEvent
from tests.worker import paced_worker
from tests.worker.conftest import DEFAULT_RECOVERY, TUNED_RECOVERY, greedy
from tests.worker.test_worker import PROMPT, prompt, tokens_sent, wait_for

PACED_TOKENS = 30  # per request, before the drain
TRICKLE_S = 0.01  # one more token per request this often while the leaving worker drains
HAND_OVER_WITHIN_S = 5.0  # the longest pause between tokens a drain may cause


def logged_indices(client, request_id: str) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    """Token indices in the replay log, and the log entries' times (ms)."""
    indices, times = [], []
    for entry_id, fields in client.redis.xrange(client.keys.replay_log(request_id)):
        event = parse_log_entry(fields)
        if isinstance(event, TokenEvent):
            indices.append(event.index)
            times.append(int(entry_id.split("-")[0]))
    return indices, times


@pytest.mark.parametrize("recovery", ["defaults", "tuned"])
def test_a_drain_hands_over_from_the_replay_log_not_from_token_0(spawn_worker, client, reference, recovery) -> None:
    n = 1000
    model, prefix = client.settings.model, client.settings.key_prefix
    # The leaving worker is paced (tests/worker/paced_worker.py): it generates PACED_TOKENS per request
    # and waits while the heir starts, then one token per TRICKLE_S while it drains, so the drain finds
    # both requests running however fast the machine runs the model.
    recovery_env = DEFAULT_RECOVERY if recovery == "defaults" else TUNED_RECOVERY
    env = {"INFLIGHTQ_DRAIN_TIMEOUT_S": "0.3", **recovery_env}
    leaving = spawn_worker("leaving", env=env, script=paced_worker.SCRIPT)
    request_ids = [client.submit(model, prompt(i), greedy(n)) for i in range(2)]
    for rid in request_ids:
        paced_worker.allow_steps(client.redis, prefix, rid, PACED_TOKENS)
    wait_for(lambda: all(tokens_sent(client, rid) > 20 for rid in request_ids), timeout=60)
    spawn_worker("staying", env=recovery_env)
    assert all(tokens_sent(client, rid) <= PACED_TOKENS for rid in request_ids), "paced: it waits for permits"
    # One more token per request every TRICKLE_S while it drains.
    with paced_worker.trickle(client.redis, prefix, request_ids, TRICKLE_S):
        drain_ms = int(time.time() * 1000)  # the replay log's entry ids are the same host's clock, in ms
        leaving.signal(signal.SIGTERM)
        assert leaving.wait(timeout=30) == 0
    for i, request_id in enumerate(request_ids):
        result = client.result(request_id, timeout=300)
        assert result.token_ids == reference(prompt(i), n)
        info = client.status(request_id)
        assert info is not None and info.status is RequestStatus.DONE and info.attempt == 1
        indices, times = logged_indices(client, request_id)
        repeated = [index for index, count in Counter(indices).items() if count > 1]
        assert repeated == [], f"the heir generated {len(repeated)} tokens again"
        assert sorted(indices) == list(range(n))
        # From the drain on (before it, the paced worker waited for the heir's start on purpose).
        pause_s = max(b - a for a, b in pairwise([drain_ms, *(t for t in times if t >= drain_ms)])) / 1000
        print(
            f"FAULTS drain ({recovery}): request {i}: {n} tokens, 0 repeated, longest pause after the drain "
            f"{pause_s:.2f} s"
        )
        assert pause_s < HAND_OVER_WITHIN_S


def test_a_reused_request_id_is_refused_and_the_original_is_untouched(spawn_worker, client, reference) -> None:
    spawn_worker("keeper")
    model = client.settings.model
    original = client.submit(model, PROMPT, greedy(60), request_id="mine-1")
    wait_for(lambda: tokens_sent(client, original) > 2)
    with pytest.raises(ConflictError, match="already in use"):
        client.submit(model, PROMPT, greedy(5), request_id="mine-1")  # while it runs
    assert client.result(original, timeout=60).token_ids == reference(PROMPT, 60)
    log_before = client.redis.xlen(client.keys.replay_log(original))
    with pytest.raises(ConflictError):
        client.submit(model, PROMPT, greedy(5), request_id="mine-1")  # once it is done
    info = client.status(original)
    assert info is not None and info.status is RequestStatus.DONE and info.attempt == 0 and info.deliveries == 1
    assert client.redis.xlen(client.keys.replay_log(original)) == log_before
    assert client.result(original, timeout=5).token_ids == reference(PROMPT, 60)
