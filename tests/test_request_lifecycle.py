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


def test_start_refuses_an_entry_that_reuses_the_id_of_another_entrys_request(redis_client, keys) -> None:
    """The hash names its entry from the first START on; before that (CREATE cannot know the entry,
    which is XADDed after it, on another node of a Cluster) it belongs to the entry with its submitted_at."""
    hash_key = keys.request(REQUEST_ID)

    def start_entry(entry: str, submitted_at: str) -> Any:
        return redis_client.eval(START, 1, hash_key, "w", 2.0, 10, 60, REQUEST_ID, "m", 0, submitted_at, entry)

    redis_client.delete(hash_key)
    fields = {"id": REQUEST_ID, "status": "queued", "submitted_at": "1.5", "attempt": "0", "deliveries": "0"}
    redis_client.hset(hash_key, mapping=fields)
    assert start_entry("9-0", "1.25")[0] == "duplicate", "another submission's entry"
    assert redis_client.hgetall(hash_key) == fields, "a refused entry leaves the hash untouched"
    assert start_entry("1-0", "1.5")[0] == "run"
    assert redis_client.hget(hash_key, "entry_id") == "1-0", "the first START claims the hash for its entry"
    before = redis_client.hgetall(hash_key)
    assert start_entry("2-0", "1.5")[0] == "duplicate", "once claimed, only that entry owns the hash"
    assert redis_client.hgetall(hash_key) == before
    reply = start_entry("1-0", "1.5")  # the same entry again: a takeover
    assert reply[0] == "run" and reply[2] == 1
    redis_client.delete(hash_key)
    assert start_entry("3-0", "1.75")[0] == "run", "a hash Redis lost is recreated by the entry that finds it gone"
    assert redis_client.hget(hash_key, "entry_id") == "3-0"
    redis_client.delete(hash_key)
