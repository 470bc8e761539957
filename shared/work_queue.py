"""A model's queue: its lanes and offer streams as a work queue, the fair pick between tenants, how
workers are woken, what counts as waiting, and how a live worker keeps the entries it took.

Per model and priority: one stream (lane) per tenant (``Keys.lane``; requests without a tenant use
the priority's own stream, ``Keys.stream``) and one offer stream per worker that holds cached
prefixes (``Keys.offers``), all read by one consumer group (``CONSUMER_GROUP``); the lanes set names
them all. Every queue script names keys of the model's slot only, so each is atomic on a Cluster.

- ``ENQUEUE`` (client): the model's depth limit and the tenant's queued limit, then the XADD (to
  the offer stream of the worker that holds the prefix, when it is live; else to the tenant's lane),
  the tenant's waiting count, and the lift of a tenant that becomes backlogged (it starts at the
  least-served backlogged tenant's virtual time: no credit is banked while idle), which also wakes a
  full worker (the light arrivals list) to look for it at once. The wake-up goes
  to the model's notify list, or, for an offer, to its worker's own list alone: no other worker may
  take it yet, and one woken in its place would leave the holder asleep (idle workers look again within
  the steal bound).
- ``PULL`` (worker): the fair pick, ``count`` times: among the heads of the backlogged tenants'
  lanes, and each tenant's first entry in its own offers and in the offers it may steal (at once when
  their worker is gone; when idle, once they waited as long as this worker would take to prefill what
  their worker holds of them, at most the steal bound; else once they waited the steal bound plus that
  prefill time longer than the oldest work of this worker's own that ranks with them: a backlog the
  whole pool shares steals nothing; an offer stream mixes tenants, and its head alone would hold a light
  tenant's offer behind a flood's), the
  entry whose tenant has the lowest virtual time (ties: the tenant with fewer waiting, then an entry
  past the steal bound, then its own offer, then the older entry); XREADGROUP it; charge the tenant
  ``cost / weight``; an entry taken from behind an offer stream's head moves to its tenant's lane first,
  since a group delivers a stream in order. ``PEEK`` is the same pick without taking (a full worker's
  displacement check). A full worker passes over the tenants whose entries would displace nothing it
  runs, so the pick stops at an entry that would, not at the head of a tenant that cannot use the worker.
- ``SETTLE`` (worker): at the request's end, refunds ``(cost - used) / weight`` so the tenant is
  charged what it used, and XACKs and XDELs the entry in the same script: it runs once per entry.
  A redelivery (a dead worker's entries, XAUTOCLAIM) never goes through ``PULL``, so a re-run is
  charged once.

``worker.engine.core.policy`` states the same rules in Python (``charge``, ``lift``, ``fair_pick``,
``offer_stealable``); a test checks the two agree.

A request waits while its entry is in a stream and not yet delivered to a worker; a delivered entry
stays pending until its worker finishes it (``SETTLE``, once ``FINISH`` ran). A dead worker's entries
(its heartbeat stopped) are taken over by another worker at once (``CLAIM_FROM_DEAD``); any entry
pending past ``reclaim_after_s`` (a live but stuck worker's, or one handed back) by the next
XAUTOCLAIM."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shared.keys import CONSUMER_GROUP, Keys, lane_priority, model_of_lane

# Field name of the one JSON document (a QueuedRequest) in a stream entry.
STREAM_FIELD = "request"
# The fair pick's fields beside it: who is charged, with what weight, how many tokens at the pull.
TENANT_FIELD = "tenant"
WEIGHT_FIELD = "weight"
COST_FIELD = "cost"
# An offer's prompt tokens that its worker holds cached: what another worker taking it would prefill again.
HELD_FIELD = "held"
ENTRY_FIELDS = frozenset({STREAM_FIELD, TENANT_FIELD, WEIGHT_FIELD, COST_FIELD, HELD_FIELD})
# Backlogged tenants a pick looks at beyond those it took (each pick raises one tenant's time).
PICK_SCAN = 32
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


def request_cost(prompt_tokens: int, max_new_tokens: int) -> int:
    """Tokens a request is charged when pulled: its prompt and all it may generate (``SETTLE``
    refunds what it did not use)."""
    return prompt_tokens + max_new_tokens


_FORMAT = "local function fmt(v) return string.format('%.17g', v) end\n"
_FIELD = """
local function field(flat, name)
  for i = 1, #flat, 2 do
    if flat[i] == name then return flat[i + 1] end
  end
  return nil
end
local function weight_of(flat)
  local w = tonumber(field(flat, 'weight') or '1') or 1
  if w <= 0 then w = 1 end
  return w
end
"""

# KEYS: 1 tenant's lane, 2 notify list, 3 lanes set, 4 share, 5 backlog, 6 waiting (of the
# request's priority), 7 clock, 8 offer stream of ``offer_to``, 9 its held set, 10 offered set,
# 11 its notify list, 12 the light arrivals list, then the waiting hash of every priority (the
# limits): all in the model's slot.
# ARGV: 1 entry JSON, 2 notify keep, 3 max depth (0 = unchecked), 4 group, 5 stream field,
# 6 tenant ('' none), 7 weight, 8 cost, 9 tenant's max queued (0 = unchecked), 10 offer_to ('' none),
# 11 tokens of the prompt offer_to holds cached, 12 '1' when fair share is on.
# Returns {'ok', entry id}, {'tenant_overloaded', the tenant's waiting} or {'overloaded', waiting}.
ENQUEUE = (
    _FORMAT
    + """
local tenant = ARGV[6]
local max_depth, max_tenant = tonumber(ARGV[3]), tonumber(ARGV[9])
if max_depth > 0 or max_tenant > 0 then
  local total, mine = 0, 0
  for i = 13, #KEYS do
    local counts = redis.call('HGETALL', KEYS[i])
    for j = 1, #counts, 2 do
      local n = tonumber(counts[j + 1])
      total = total + n
      if counts[j] == tenant then mine = mine + n end
    end
  end
  if max_tenant > 0 and mine >= max_tenant then return {'tenant_overloaded', mine} end
  if max_depth > 0 and total >= max_depth then return {'overloaded', total} end
end
local target = KEYS[1]
if ARGV[10] ~= '' and redis.call('EXISTS', KEYS[9]) == 1 then
  target = KEYS[8]
  redis.call('SADD', KEYS[10], ARGV[10])
end
if redis.call('EXISTS', target) == 0 then
  redis.call('XGROUP', 'CREATE', target, ARGV[4], '0', 'MKSTREAM')
end
redis.call('SADD', KEYS[3], target)
local id = redis.call('XADD', target, '*', ARGV[5], ARGV[1], 'tenant', tenant, 'weight', ARGV[7], 'cost', ARGV[8],
  'held', ARGV[11])
if redis.call('HINCRBY', KEYS[6], tenant, 1) == 1 then
  local own = tonumber(redis.call('HGET', KEYS[4], tenant) or '0')
  local low = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
  local floor = tonumber(low[2] or redis.call('GET', KEYS[7]) or '0')
  local v = math.max(own, floor)
  redis.call('HSET', KEYS[4], tenant, fmt(v))
  redis.call('ZADD', KEYS[5], fmt(v), tenant)
  if ARGV[12] == '1' and tenant ~= '' then
    -- a tenant that had nothing waiting: a full worker may take it to displace a flooding tenant's work
    redis.call('LPUSH', KEYS[12], '1')
    redis.call('LTRIM', KEYS[12], 0, tonumber(ARGV[2]) - 1)
  end
end
-- An offer wakes its worker alone: no other worker may take it yet (an idle one after the held prefix's
-- prefill time, a busy one after the steal bound), and a token taken by one would leave the holder asleep.
local wake = KEYS[2]
if target == KEYS[8] then wake = KEYS[11] end
redis.call('LPUSH', wake, '1')
redis.call('LTRIM', wake, 0, tonumber(ARGV[2]) - 1)
-- a worker's own list goes with the worker (names are per process)
if wake ~= KEYS[2] then redis.call('EXPIRE', wake, 60) end
return {'ok', id}
"""
)

# KEYS: 1 the priority's own stream, 2 share, 3 backlog, 4 waiting, 5 clock, 6 offered set,
# 7 this worker's offer stream, 8 lanes set (all of one priority, the model's slot).
# ARGV: 1 'pull' or 'peek', 2 group, 3 consumer, 4 count, 5 '1' when this worker is idle,
# 6 steal after (ms), 7 lane key prefix, 8 offer key prefix, 9 held key prefix, 10 scan,
# 11 this worker's prefill time per prompt token (ms; 0 = not measured yet), 12... a full worker's
# passed-over tenants ('x:' and the tenant: its entries would displace nothing there; 'e:': at the edge
# of its share there): when the pick's best entry is an 'x:' tenant's, it takes the best of the other
# tenants' instead (``policy.passed_over``).
# Returns up to count picks in order, each {stream, entry id, fields, the tenant's virtual time
# before the pick's charge, tenant}. 'peek' takes nothing and charges nothing: it returns what
# 'pull' would take. Mirrors ``policy.fair_pick``, ``policy.charge`` and ``policy.offer_stealable``.
PULL = (
    _FORMAT
    + _FIELD
    + """
local peek = ARGV[1] == 'peek'
local group, me = ARGV[2], ARGV[3]
local count, idle, steal_ms, scan = tonumber(ARGV[4]), ARGV[5] == '1', tonumber(ARGV[6]), tonumber(ARGV[10])
local prefill_ms = tonumber(ARGV[11]) or 0
local passed, edge = {}, {}
for i = 12, #ARGV do
  local kind, tenant = string.sub(ARGV[i], 1, 2), string.sub(ARGV[i], 3)
  if kind == 'x:' then passed[tenant] = true elseif kind == 'e:' then edge[tenant] = true end
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local vt, left, cursor, heads, tops, skip = {}, {}, {}, {}, {}, {}
local function vtime(tenant)
  if vt[tenant] == nil then vt[tenant] = tonumber(redis.call('HGET', KEYS[2], tenant) or '0') end
  return vt[tenant]
end
local function waiting(tenant)
  if left[tenant] == nil then left[tenant] = tonumber(redis.call('HGET', KEYS[4], tenant) or '0') end
  return left[tenant]
end
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function older(a, b)
  local am, as = id_parts(a)
  local bm, bs = id_parts(b)
  if am ~= bm then return am < bm end
  return as < bs
end
local function head(stream)
  if heads[stream] ~= nil then return heads[stream] end
  if cursor[stream] == nil then
    cursor[stream] = false
    local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
    if ok then
      for _, g in ipairs(groups) do
        if field(g, 'name') == group then cursor[stream] = '(' .. field(g, 'last-delivered-id') end
      end
      if not cursor[stream] then
        -- a stream without the group (a Redis restart without persistence): from its start
        redis.call('XGROUP', 'CREATE', stream, group, '0')
        cursor[stream] = '-'
      end
    end
  end
  local h = false
  if cursor[stream] then h = redis.call('XRANGE', stream, cursor[stream], '+', 'COUNT', 1)[1] or false end
  heads[stream] = h
  return h
end
-- An offer stream holds every tenant's offers to one worker in arrival order: its head alone would leave
-- a light tenant's offer behind a flooding tenant's. The first undelivered entry of each tenant among the
-- next `scan` (a peek's picks skipped), each marked deep when it is not the stream's head.
local function firsts(stream)
  if tops[stream] ~= nil then return tops[stream] end
  local found, seen = {}, {}
  if head(stream) then
    for i, e in ipairs(redis.call('XRANGE', stream, cursor[stream], '+', 'COUNT', scan)) do
      local tenant = field(e[2], 'tenant') or ''
      if not skip[e[1]] and not seen[tenant] then
        seen[tenant] = true
        found[#found + 1] = {e, i > 1}
      end
    end
  end
  tops[stream] = found
  return found
end
local out = {}
for n = 1, count do
  local best, other = nil, nil
  local function better(c, b)
    return b == nil or c.v < b.v or (c.v == b.v and (c.queued < b.queued or (c.queued == b.queued
        and (c.rank < b.rank or (c.rank == b.rank and older(c.e[1], b.e[1]))))))
  end
  -- what this worker may take without stealing: {its tenant's virtual time, waiting, its enqueue time}
  local own = {}
  local function consider(stream, e, rank, deep, stolen)
    if not e then return end
    local tenant = field(e[2], 'tenant') or ''
    local e_ms = id_parts(e[1])
    if not stolen and not passed[tenant] then own[#own + 1] = {vtime(tenant), waiting(tenant), e_ms} end
    -- waited past the steal bound: overdue, it goes before a worker's own younger offer
    if now_ms - e_ms >= steal_ms then rank = -1 end
    local c = {stream = stream, e = e, tenant = tenant, v = vtime(tenant), queued = waiting(tenant), rank = rank,
      deep = deep}
    if better(c, best) then best = c end
    if not passed[tenant] and not edge[tenant] and better(c, other) then other = c end
  end
  consider(KEYS[1], head(KEYS[1]), 1)
  for _, tenant in ipairs(redis.call('ZRANGE', KEYS[3], 0, scan + n - 2)) do
    if tenant ~= '' then
      if waiting(tenant) > 0 then
        local lane = ARGV[7] .. string.sub(redis.sha1hex(tenant), 1, 16)
        consider(lane, head(lane), 1)
      elseif not peek then
        redis.call('ZREM', KEYS[3], tenant)
      end
    end
  end
  for _, f in ipairs(firsts(KEYS[7])) do consider(KEYS[7], f[1], 0, f[2]) end
  for _, w in ipairs(redis.call('SMEMBERS', KEYS[6])) do
    if w ~= me then
      local stream = ARGV[8] .. w
      local h = head(stream)
      local live = redis.call('EXISTS', ARGV[9] .. w) == 1
      if h then
        for _, f in ipairs(firsts(stream)) do
          -- how much longer it waited than the oldest work of this worker's own that the pick ranks with it
          -- or before it (a tenant no further over its share, with no more waiting): a backlog the whole pool
          -- shares is no reason to take it from its holder, only a holder falling behind the others is
          local tenant = field(f[1][2], 'tenant') or ''
          local v, q, own_ms = vtime(tenant), waiting(tenant), now_ms
          for _, o in ipairs(own) do
            if (o[1] < v or (o[1] == v and o[2] <= q)) and o[3] < own_ms then own_ms = o[3] end
          end
          local e_ms = id_parts(f[1][1])
          local refill = (tonumber(field(f[1][2], 'held') or '0') or 0) * prefill_ms
          -- an idle worker waits for the holder as long as prefilling what it holds would take itself, at
          -- most the bound: a holder with a free slot starts it at its next step, and prefills less
          local idle_wait = math.min(steal_ms, refill)
          if (not live) or own_ms - e_ms >= steal_ms + refill or (idle and now_ms - e_ms >= idle_wait) then
            consider(stream, f[1], 1, f[2], true)
          end
        end
      elseif not peek and not live and redis.call('XLEN', stream) == 0 then
        redis.call('SREM', KEYS[6], w)
        redis.call('SREM', KEYS[8], stream)
        redis.call('DEL', stream)
      end
    end
  end
  if best ~= nil and passed[best.tenant] then best = other end
  if best == nil then break end
  local e = best.e
  tops[best.stream] = nil
  if best.deep and peek then
    skip[e[1]] = true
  elseif best.deep then
    -- A group delivers a stream in order: the entry moves to its tenant's lane, read from there (that
    -- lane's older entries first: the same tenant's, so the pick is the same).
    local lane = KEYS[1]
    if best.tenant ~= '' then lane = ARGV[7] .. string.sub(redis.sha1hex(best.tenant), 1, 16) end
    redis.call('XDEL', best.stream, e[1])
    heads[best.stream] = nil
    pcall(redis.call, 'XGROUP', 'CREATE', lane, group, '0', 'MKSTREAM')
    redis.call('XADD', lane, '*', unpack(e[2]))
    redis.call('SADD', KEYS[8], lane)
    best.stream = lane
    tops[lane], heads[lane] = nil, nil
  end
  if not peek then
    e = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', 1, 'STREAMS', best.stream, '>')[1][2][1]
  end
  local flat = e[2]
  local cost = tonumber(field(flat, 'cost') or '0') or 0
  local v = best.v + cost / weight_of(flat)
  local w = waiting(best.tenant)
  vt[best.tenant] = v
  if w > 0 then left[best.tenant] = w - 1 end
  if not peek then
    redis.call('HSET', KEYS[2], best.tenant, fmt(v))
    if tonumber(redis.call('GET', KEYS[5]) or '0') < best.v then redis.call('SET', KEYS[5], fmt(best.v)) end
    if w > 1 then
      redis.call('HINCRBY', KEYS[4], best.tenant, -1)
      redis.call('ZADD', KEYS[3], fmt(v), best.tenant)
    else
      redis.call('HDEL', KEYS[4], best.tenant)
      redis.call('ZREM', KEYS[3], best.tenant)
    end
  end
  if not (best.deep and peek) then
    cursor[best.stream] = '(' .. e[1]
    heads[best.stream] = nil
  end
  out[#out + 1] = {best.stream, e[1], flat, fmt(best.v), best.tenant}
end
return out
"""
)

# KEYS: 1 the entry's stream, 2 share, 3 backlog (of the stream's priority).
# ARGV: 1 group, 2 entry id, 3 tokens the request used (prompt + generated; '' = all it was charged).
# Refunds what the pull charged beyond what was used, then XACKs and XDELs the entry, at once: the
# refund runs once however often its request is finished (a re-run after a crash finds no entry).
# Returns 1 when it settled, 0 when the entry was gone (already settled).
SETTLE = (
    _FORMAT
    + _FIELD
    + """
local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])[1]
local settled = 0
if e then
  local flat = e[2]
  local cost = tonumber(field(flat, 'cost') or '')
  if cost and ARGV[3] ~= '' then
    local tenant = field(flat, 'tenant') or ''
    local refund = (cost - tonumber(ARGV[3])) / weight_of(flat)
    if refund ~= 0 then
      local v = tonumber(redis.call('HGET', KEYS[2], tenant) or '0') - refund
      redis.call('HSET', KEYS[2], tenant, fmt(v))
      if redis.call('ZSCORE', KEYS[3], tenant) then redis.call('ZADD', KEYS[3], fmt(v), tenant) end
    end
  end
  settled = 1
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return settled
"""
)


def pull_keys(keys: Keys, model: str, priority: int, worker: str) -> list[str]:
    """``PULL``'s KEYS for ``worker`` at ``priority``."""
    return [
        keys.stream(model, priority),
        keys.share(model, priority),
        keys.backlog(model, priority),
        keys.waiting(model, priority),
        keys.clock(model, priority),
        keys.offered(model, priority),
        keys.offers(model, priority, worker),
        keys.lanes(model),
    ]


def pull_args(
    keys: Keys,
    model: str,
    priority: int,
    worker: str,
    count: int,
    *,
    idle: bool,
    steal_after_ms: int,
    peek: bool,
    prefill_ms_per_token: float = 0.0,
    cannot_displace: Iterable[str] = (),
    at_the_edge: Iterable[str] = (),
) -> list[Any]:
    """``PULL``'s ARGV; ``cannot_displace`` and ``at_the_edge``: a full worker's passed-over tenants
    (``policy.passed_over``)."""
    return [
        "peek" if peek else "pull",
        CONSUMER_GROUP,
        worker,
        count,
        "1" if idle else "0",
        steal_after_ms,
        keys.lane_prefix(model, priority),
        keys.offers_prefix(model, priority),
        keys.held_prefix(model),
        PICK_SCAN,
        repr(float(prefill_ms_per_token)),
        *(f"x:{t}" for t in sorted(cannot_displace)),
        *(f"e:{t}" for t in sorted(at_the_edge)),
    ]


def settle_keys(keys: Keys, stream: str) -> list[str]:
    """``SETTLE``'s KEYS for an entry of ``stream``."""
    model, priority = model_of_lane(stream), lane_priority(stream)
    return [stream, keys.share(model, priority), keys.backlog(model, priority)]


def model_lanes(lanes: Any, keys: Keys, model: str, levels: int) -> list[str]:
    """Every lane and offer stream of a model, most urgent priority first: the priorities' own
    streams and the members of the lanes set (``lanes``: its SMEMBERS reply)."""
    found = {keys.stream(model, p) for p in range(levels)} | {str(lane) for lane in lanes or ()}
    return sorted(
        (lane for lane in found if lane_priority(lane) < levels), key=lambda lane: (lane_priority(lane), lane)
    )


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
