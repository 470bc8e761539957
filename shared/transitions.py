"""Every change of a request's status, as one atomic Lua script each.

The request hash (``keys.request``) is the record; these scripts are the only writers of its
``status`` field, so the lifecycle in ``shared/lifecycle.py`` holds however clients and
workers race:

- ``ENQUEUE`` (client): checks the model's queue depth, writes the hash ``queued`` (with the
  stream entry's id), XADDs, wakes a worker, all at once, so concurrent submits cannot push a
  queue past its limit.
- ``CANCEL`` (client): queued -> cancelled at once; its entry stays in the stream until a worker
  reads and skips it. (Deleting an unread entry would leave a tombstone ahead of the group's
  read position, and Redis then reports the group's lag as unknown, which blinds autoscaling
  on lag exactly when the pool is saturated.) Running -> ``cancel_requested`` is set and the
  cancel channel tells the running worker, which moves it to cancelled at its next step. The
  flag also stops a takeover from resuming it.
- ``START`` (worker): queued -> running, or running -> running on takeover (attempt + 1).
  Counts deliveries so a request that keeps killing workers is dead-lettered.
- ``FINISH`` (worker): running/queued -> done | failed | cancelled | expired, stores the result
  or error, appends the terminal event to the replay log, publishes it, and XACKs + XDELs the
  stream entry, all at once: no reader ever sees a final status without its terminal event.
- ``PUBLISH_TOKENS`` (worker): not a status change, but the hot path: a step's token events,
  each appended to its replay log then published, in one call (see ``worker/publisher.py``).
- ``REFRESH`` (worker): keeps a live worker's pending entries idle-free (XCLAIM JUSTID), only
  for entries it still owns, and reports the ones another worker took over.

Scripts name every key they touch in KEYS, and all keys share the prefix's hash tag, so they
stay legal on Redis Cluster."""

from __future__ import annotations

# Hash fields written by these scripts and by enqueue.
STATUS = "status"
CANCEL_REQUESTED = "cancel_requested"
DELIVERIES = "deliveries"
ATTEMPT = "attempt"

# Field name of the one JSON document in a priority-stream entry and in a replay-log entry.
STREAM_FIELD = "request"
LOG_FIELD = "e"

# KEYS: request hash, target priority stream, notify list, models set, then every priority
# stream of the model (for the depth check).
# ARGV: ttl, entry JSON, notify keep, model, max depth (0 = unchecked), group, stream field,
# then the hash's field/value pairs.
# Returns {'ok', entry id} or {'overloaded', waiting}.
ENQUEUE = """
local max_depth = tonumber(ARGV[5])
if max_depth > 0 then
  local waiting = 0
  for i = 5, #KEYS do
    local length = redis.call('XLEN', KEYS[i])
    if length > 0 then
      local ok, pending = pcall(redis.call, 'XPENDING', KEYS[i], ARGV[6])
      local taken = 0
      if ok then taken = tonumber(pending[1]) end
      waiting = waiting + math.max(0, length - taken)
    end
  end
  if waiting >= max_depth then return {'overloaded', waiting} end
end
local fields = {}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
local id = redis.call('XADD', KEYS[2], '*', ARGV[7], ARGV[2])
redis.call('HSET', KEYS[1], 'entry_id', id)
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('LPUSH', KEYS[3], '1')
redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[3]) - 1)
redis.call('SADD', KEYS[4], ARGV[4])
return {'ok', id}
"""

# KEYS: request hash, replay log, token channel, cancel channel.
# ARGV: request id, terminal event JSON, now, ttl, log maxlen.
# Returns 1 cancelled while queued, 2 cancel sent to the running worker, 0 already final, -1 unknown.
CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[3], 'error', ARGV[2],
             'cancel_requested', '1')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'e', ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  redis.call('PUBLISH', KEYS[3], ARGV[2])
  return 1
end
if status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', KEYS[4], ARGV[1])
  return 2
end
return 0
"""

# KEYS: request hash.
# ARGV: worker name, now, max deliveries, ttl, then (for a hash that vanished, e.g. a Redis
# restart without persistence) id, model, priority, submitted_at.
# Returns {verdict, deliveries, attempt}; verdict is 'run', 'cancel', 'poison', or the final status.
START = """
local h = redis.call('HMGET', KEYS[1], 'status', 'cancel_requested')
local status = h[1]
if not status then
  redis.call('HSET', KEYS[1], 'id', ARGV[5], 'model', ARGV[6], 'priority', ARGV[7],
             'submitted_at', ARGV[8], 'status', 'queued', 'attempt', '0')
  status = 'queued'
end
if status ~= 'queued' and status ~= 'running' then return {status, 0, 0} end
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
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {'run', deliveries, attempt}
"""

# KEYS: request hash, replay log, token channel, priority stream.
# ARGV: status, terminal event JSON, 'result' or 'error', its JSON, now, ttl, group, entry id
# ('' when there is no entry), log maxlen.
# Returns 1 when this call moved the request to its final status, 0 when it already was final.
FINISH = """
local current = redis.call('HGET', KEYS[1], 'status')
local applied = 0
if (not current) or current == 'queued' or current == 'running' then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[5], ARGV[3], ARGV[4])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[9], '*', 'e', ARGV[2])
  redis.call('PUBLISH', KEYS[3], ARGV[2])
  applied = 1
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
if ARGV[8] ~= '' then
  redis.call('XACK', KEYS[4], ARGV[7], ARGV[8])
  redis.call('XDEL', KEYS[4], ARGV[8])
end
return applied
"""

# KEYS: priority stream.  ARGV: group, worker name, entry ids...
# Returns the ids this worker no longer owns (another worker took them over, or Redis lost them).
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

# KEYS: replay log and token channel of each event, in pairs.  ARGV: log maxlen, ttl, event JSONs.
# One call per round trip: redis-py packs one command with many arguments far faster than many
# commands, and the per-token work (log first, then publish) runs inside Redis.
PUBLISH_TOKENS = """
local maxlen, ttl = ARGV[1], ARGV[2]
for i = 3, #ARGV do
  local log = KEYS[2 * (i - 3) + 1]
  redis.call('XADD', log, 'MAXLEN', '~', maxlen, '*', 'e', ARGV[i])
  redis.call('EXPIRE', log, ttl)
  redis.call('PUBLISH', KEYS[2 * (i - 3) + 2], ARGV[i])
end
return #ARGV - 2
"""
