"""The request lifecycle: the Lua scripts make exactly the status changes the table allows."""

from __future__ import annotations

from typing import Any

import redis

from shared.keys import Keys
from shared.request_lifecycle import (
    ALLOWED_TRANSITIONS,
    CANCEL,
    FINAL_STATUSES,
    FINISH,
    START,
    RequestStatus,
    can_move,
)

REQUEST_ID = "r1"


def run_from(r: redis.Redis, keys: Keys, status: RequestStatus, script: str, *args: object) -> tuple[Any, str]:
    """Runs ``script`` on a request hash in ``status``: its reply, and the status it leaves."""
    hash_key = keys.request(REQUEST_ID)
    r.delete(hash_key)
    r.hset(hash_key, mapping={"id": REQUEST_ID, "status": status.value, "attempt": "0", "deliveries": "0"})
    channels = [keys.replay_log(REQUEST_ID), keys.tokens_channel(REQUEST_ID)]
    script_keys = {
        START: [hash_key],
        CANCEL: [hash_key, *channels],
        FINISH: [hash_key, *channels],
    }[script]
    reply = r.eval(script, len(script_keys), *script_keys, *args)
    return reply, r.hget(hash_key, "status")


def start(r: redis.Redis, keys: Keys, status: RequestStatus) -> tuple[Any, str]:
    return run_from(r, keys, status, START, "w", 1.0, 10, 60, REQUEST_ID, "m", 0, 1.0, "1-0")


def cancel(r: redis.Redis, keys: Keys, status: RequestStatus) -> tuple[Any, str]:
    return run_from(r, keys, status, CANCEL, REQUEST_ID, "{}", 1.0, 60, 100, keys.cancel_channel(), "PUBLISH")


def finish(r: redis.Redis, keys: Keys, status: RequestStatus, final: RequestStatus) -> tuple[Any, str]:
    return run_from(r, keys, status, FINISH, final.value, "{}", "error", "{}", 1.0, 60, 100, "PUBLISH")


def test_the_scripts_make_exactly_the_moves_the_table_allows(redis_client, keys) -> None:
    moves: set[tuple[RequestStatus, RequestStatus]] = set()
    for status in RequestStatus:
        reply, after = start(redis_client, keys, status)
        if reply[0] == "run":  # running -> running is a move too: a takeover
            moves.add((status, RequestStatus(after)))
        outcomes = [cancel(redis_client, keys, status)]
        outcomes += [finish(redis_client, keys, status, final) for final in FINAL_STATUSES]
        moves |= {(status, RequestStatus(after)) for _, after in outcomes if after != status}
    for current, new in moves:
        assert can_move(current, new), f"a script moved a request {current} -> {new}"
    allowed = {(current, new) for current, targets in ALLOWED_TRANSITIONS.items() for new in targets}
    assert moves == allowed, "every move the table allows is made by some script"


def test_a_worker_cannot_finish_as_done_a_request_it_never_started(redis_client, keys) -> None:
    applied, after = finish(redis_client, keys, RequestStatus.QUEUED, RequestStatus.DONE)
    assert applied == 0 and after == RequestStatus.QUEUED
    applied, after = finish(redis_client, keys, RequestStatus.RUNNING, RequestStatus.DONE)
    assert applied == 1 and after == RequestStatus.DONE
