"""A model's priority streams as a work queue: what an entry holds, how workers are woken,
what counts as waiting, and how a live worker keeps the entries it took.

Per model: one stream per priority, read by one consumer group of workers (``CONSUMER_GROUP``
in ``shared.keys``); a notify list that wakes idle workers. A request waits while its entry
is in a stream and not yet delivered to a worker; a delivered entry stays pending until its
worker finishes it (XACK and XDEL, once ``FINISH`` ran). A dead worker's entries (its heartbeat
stopped) are taken over by another worker at once (``CLAIM_FROM_DEAD``); any entry pending past
``reclaim_after_s`` (a live but stuck worker's, or one handed back) by the next XAUTOCLAIM."""

from __future__ import annotations

from typing import Any

from shared.keys import CONSUMER_GROUP

# Field name of the one JSON document (a QueuedRequest) in a priority-stream entry.
STREAM_FIELD = "request"
# Wake-up tokens kept in a model's notify list; one per idle worker is all that matters.
NOTIFY_KEEP = 64

# KEYS: priority stream.  ARGV: group, worker name, entry ids...
# Keeps a live worker's pending entries idle-free (XCLAIM JUSTID), only for entries it still
# owns. Returns the ids this worker no longer owns (another worker took them over, or Redis
# lost them).
REFRESH = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# KEYS: priority stream.  ARGV: group, dead consumer, new owner, most entries to take.
# Takes over up to that many of a dead worker's pending entries at once (XCLAIM: their delivery
# counts go up as with XAUTOCLAIM) and removes the dead consumer once it holds none. Returns the
# claimed entries as XCLAIM does (an entry deleted meanwhile is not among them).
CLAIM_FROM_DEAD = """
local taken = {}
local count = tonumber(ARGV[4])
if count > 0 then
  local ids = {}
  for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', count, ARGV[2])) do
    table.insert(ids, p[1])
  end
  if #ids > 0 then
    taken = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, unpack(ids))
  end
end
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return taken
"""


def depth_of(length: object, pending: object) -> int:
    """Requests waiting in one stream, from its XLEN and XPENDING replies (either may be an
    error: no stream, or no group yet). ``ENQUEUE`` counts the same way."""
    if isinstance(length, Exception):
        return 0
    taken = 0 if isinstance(pending, Exception) or not pending else int(pending["pending"])  # type: ignore[index]
    return max(0, int(length) - taken)  # type: ignore[call-overload]


def first_undelivered(groups: list[dict[str, Any]]) -> str:
    """The XRANGE start of a stream's entries the group has not delivered yet, from XINFO GROUPS."""
    for group in groups:
        if group.get("name") == CONSUMER_GROUP:
            return "(" + str(group["last-delivered-id"])
    return "-"
