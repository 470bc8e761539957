"""A request's life as the queue sees it: its states, the moves allowed between them, and the
Lua scripts that make those moves in Redis. The one place the lifecycle lives.

    queued ──► running ──► done
      │          │  ▲
      │          │  └── (worker died: taken over by another worker, stays running)
      │          ├─────► failed     (engine error, or dead-lettered after too many deliveries)
      ├──────────┼─────► cancelled  (DELETE /v1/jobs/{id}, client disconnect, client.cancel)
      └──────────┴─────► expired    (deadline passed before or during generation)

Who moves it: the API/client writes ``queued`` (``CREATE`` then ``ENQUEUE``) and may ask for ``cancelled``
(``CANCEL``); a worker writes every other state (``START``, ``FINISH``).

Where it is stored: the request hash (``keys.request``), with a TTL:

    id, model, priority, submitted_at   written by CREATE (see ``hash_fields``)
    tenant                              CREATE, when set: with API keys, the key that owns it
    status                              the state above; written only by the scripts below
    entry_id                            the priority-stream entry it belongs to, written by the
                                        first START (until then: the entry with its submitted_at)
    attempt, deliveries, worker         START: takeovers, deliveries (poison limit), owner
    started_at, finished_at             START, FINISH
    result | error                      FINISH (JSON), or CANCEL's error for a queued request
    cancel_requested                    CANCEL: the running worker stops, a takeover does not resume

Each script is atomic, so the lifecycle holds however clients and workers race; START and
FINISH check their move against ``ALLOWED_TRANSITIONS`` itself, rendered into their Lua, so the
table the code and the tests read is the one Redis enforces.

- ``CREATE`` then ``ENQUEUE`` (client): CREATE refuses an id already in use (without touching the
  request that owns it) and writes the hash ``queued``; then, in the model's slot, ENQUEUE
  (``shared.work_queue``) checks the model's queue depth and the tenant's queued limit, XADDs and
  wakes a worker, all at once, so concurrent submits cannot push a queue past its limit (a refused
  request's hash is deleted again).
- ``CANCEL`` (client): queued -> cancelled at once; its entry stays in the stream until a worker
  reads and skips it. (Deleting an unread entry would leave a tombstone ahead of the group's
  read position, and Redis then reports the group's lag as unknown, which blinds autoscaling
  on lag exactly when the pool is saturated.) Running -> ``cancel_requested`` is set and the
  cancel channel tells the running worker, which moves it to cancelled at its next step. The
  flag also stops a takeover from resuming it.
- ``START`` (worker): queued -> running, or running -> running on takeover (attempt + 1).
  Counts deliveries so a request that keeps killing workers is dead-lettered. An entry that
  reuses the id of a request whose hash belongs to another entry is refused (``duplicate``).
- ``FINISH`` (worker): -> done | failed | cancelled | expired where the table allows it, stores
  the result or error, appends the terminal event to the replay log and publishes it, all at
  once: no reader ever sees a final status without its terminal event. Then ``SETTLE``
  (``shared.work_queue``) charges the tenant what the request used and XACKs and XDELs the entry.

Each script names every key it touches in KEYS, all of one hash tag (``shared.keys``): a
request's scripts touch its own slot, ``ENQUEUE`` its model's; so they stay legal on a Redis
Cluster, where the two live on different nodes. That is why a request's life takes two scripts
where one would do on a single Redis: the hash before the queue entry (``CREATE``, ``ENQUEUE``),
and the final status before the XACK (``FINISH``, then the worker's XACK)."""

from __future__ import annotations

from enum import StrEnum


class RequestStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATUSES


FINAL_STATUSES = frozenset({RequestStatus.DONE, RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.EXPIRED})

ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.QUEUED: frozenset(
        {RequestStatus.RUNNING, RequestStatus.CANCELLED, RequestStatus.EXPIRED, RequestStatus.FAILED}
    ),
    RequestStatus.RUNNING: frozenset(
        {
            RequestStatus.RUNNING,  # a takeover by another worker
            RequestStatus.DONE,
            RequestStatus.FAILED,
            RequestStatus.CANCELLED,
            RequestStatus.EXPIRED,
        }
    ),
    RequestStatus.DONE: frozenset(),
    RequestStatus.FAILED: frozenset(),
    RequestStatus.CANCELLED: frozenset(),
    RequestStatus.EXPIRED: frozenset(),
}


def can_move(current: RequestStatus, new: RequestStatus) -> bool:
    return new in ALLOWED_TRANSITIONS[current]


# Fields of the request hash that code outside the scripts names.
STATUS = "status"
CANCEL_REQUESTED = "cancel_requested"
DELIVERIES = "deliveries"
ATTEMPT = "attempt"


def hash_fields(
    request_id: str, model: str, priority: int, submitted_at: float, attempt: int, tenant: str | None = None
) -> dict[str, str]:
    """The request hash as CREATE first writes it (plain values: ``shared.schemas`` imports this module)."""
    fields = {
        "id": request_id,
        STATUS: RequestStatus.QUEUED.value,
        "model": model,
        "priority": str(priority),
        "submitted_at": repr(submitted_at),
        ATTEMPT: str(attempt),
        DELIVERIES: "0",
    }
    if tenant:
        fields["tenant"] = tenant
    return fields


def _lua_can_move() -> str:
    """``ALLOWED_TRANSITIONS`` as a Lua table and a ``can_move`` function, prepended to the
    scripts that check a move."""
    rows = []
    for current in RequestStatus:
        targets = ", ".join(f"{new.value} = true" for new in sorted(ALLOWED_TRANSITIONS[current]))
        rows.append(f"  {current.value} = {{{targets}}},")
    return "\n".join(
        [
            "local moves = {",
            *rows,
            "}",
            "local function can_move(current, new)",
            "  local allowed = moves[current]",
            "  return allowed ~= nil and allowed[new] == true",
            "end",
        ]
    )


_CAN_MOVE = _lua_can_move()

# KEYS: request hash.
# ARGV: ttl, then the hash's field/value pairs.
# Writes the hash of a new request. Returns {'ok', ''}, or {'duplicate', status} when a request
# with this id exists (a reused id must never touch the request that owns it). The queue entry
# comes after, from ``ENQUEUE`` (on a Cluster its XADD runs on another node), so a worker never
# reads an entry whose hash is still to come; ``START`` recreates a hash Redis lost.
# The same submission sent again (a connection lost after Redis ran the script, and the client
# retried, as happens in a Cluster failover) finds its own hash, still queued with its
# submitted_at, and is 'ok': an id the API minted itself is never a 409.
CREATE = """
local fields = {}
local submitted_at
for i = 2, #ARGV, 2 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  if ARGV[i] == 'submitted_at' then submitted_at = ARGV[i + 1] end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local status, at = unpack(redis.call('HMGET', KEYS[1], 'status', 'submitted_at'))
  if status == 'queued' and at == submitted_at then return {'ok', ''} end
  return {'duplicate', status or 'unknown'}
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {'ok', ''}
"""

# KEYS: request hash, replay log, token channel (one slot).
# ARGV: request id, terminal event JSON, now, ttl, log maxlen, cancel channel, publish command
# (PUBLISH, or SPUBLISH on a Cluster). The cancel channel is not a key: it is the deployment's
# one broadcast channel (a plain PUBLISH, which a Cluster sends to every node).
# Returns 1 cancelled while queued, 2 cancel sent to the running worker, 3 a cancel was already
# sent (of concurrent cancels exactly one gets 1 or 2), 0 already final, -1 unknown.
CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[3], 'error', ARGV[2],
             'cancel_requested', '1')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'e', ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  redis.call(ARGV[7], KEYS[3], ARGV[2])
  return 1
end
if status == 'running' then
  if redis.call('HGET', KEYS[1], 'cancel_requested') == '1' then return 3 end
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', ARGV[6], ARGV[1])
  return 2
end
return 0
"""

# KEYS: request hash.
# ARGV: worker name, now, max deliveries, ttl, then (for a hash that vanished, e.g. a Redis
# restart without persistence) id, model, priority, submitted_at; then the stream entry's id.
# Returns {verdict, deliveries, attempt}; verdict is 'run', 'cancel', 'poison', 'duplicate' (the
# hash belongs to another entry with the same request id: this one must not touch it), or the
# final status. The hash names its entry from the first START on (CREATE runs before the entry
# exists); until then the entry it belongs to is the one with the hash's submitted_at.
START = (
    _CAN_MOVE
    + """
local entry = ARGV[9] or ''
local h = redis.call('HMGET', KEYS[1], 'status', 'cancel_requested', 'entry_id', 'submitted_at')
local status = h[1]
if status and entry ~= '' then
  if h[3] and h[3] ~= '' then
    if h[3] ~= entry then return {'duplicate', 0, 0} end
  elseif h[4] and h[4] ~= ARGV[8] then
    return {'duplicate', 0, 0}
  end
end
if not status then
  redis.call('HSET', KEYS[1], 'id', ARGV[5], 'model', ARGV[6], 'priority', ARGV[7],
             'submitted_at', ARGV[8], 'status', 'queued', 'attempt', '0', 'entry_id', entry)
  status = 'queued'
end
if not can_move(status, 'running') then return {status, 0, 0} end
if h[2] == '1' then return {'cancel', 0, 0} end
local deliveries = redis.call('HINCRBY', KEYS[1], 'deliveries', 1)
if deliveries > tonumber(ARGV[3]) then return {'poison', deliveries, 0} end
local attempt
if status == 'running' then
  attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
else
  attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
  redis.call('HSET', KEYS[1], 'started_at', ARGV[2])
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1])
if entry ~= '' then redis.call('HSET', KEYS[1], 'entry_id', entry) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {'run', deliveries, attempt}
"""
)

# KEYS: request hash, replay log, token channel (one slot).
# ARGV: status, terminal event JSON, 'result' or 'error', its JSON, now, ttl, log maxlen, publish
# command (PUBLISH, or SPUBLISH on a Cluster), the replay log's ttl once final (shorter: the hash
# keeps the result, and a log with top-n logprobs costs over 1 KB a token).
# Returns 1 when this call moved the request to its final status, 0 when the move was not
# allowed (it already was final). A hash that vanished (Redis lost it) is written anyway.
# The queue entry is XACKed and XDELed after this ran: it lives in the
# model's slot, and acking first could lose a request whose final write then failed.
FINISH = (
    _CAN_MOVE
    + """
local current = redis.call('HGET', KEYS[1], 'status')
local applied = 0
if (not current) or can_move(current, ARGV[1]) then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[5], ARGV[3], ARGV[4])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'e', ARGV[2])
  redis.call(ARGV[8], KEYS[3], ARGV[2])
  applied = 1
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[9] or ARGV[6])
return applied
"""
)
