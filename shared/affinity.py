"""Which live worker holds the longest cached prefix of a request: the API asks at dispatch, and offers
the request to that worker (``offer_to`` of the queue's enqueue).

Each worker mirrors its prefix cache into ``Keys.held(model, worker)``: a SET of the block hashes
(``shared.prefix_hash``, hex) it holds, plus the member ``LIVE`` while the worker is live (so the
key exists, as long as the worker does, even with an empty cache), with a TTL its heartbeat
refreshes. ``LONGEST_PREFIX`` looks in every candidate's set, in one script call in the model's
slot: a worker's cache keeps a prefix's head blocks longest (tail blocks are freed first), so
whether it holds the first k blocks is a binary search over the chain. A worker also holds the
member ``adapter_member(key)`` for each LoRA adapter it has loaded: a request with an adapter whose
prefix no worker holds is offered to the (least loaded) worker holding the adapter, unless all or
none do. Affinity only decides where a request is offered; the queue lets another worker take it at
once when the holder is gone, an idle one once the offer waited as long as prefilling what the
holder holds would take (the steal bound at most), and a busy one once it waited the steal bound
plus that time longer than the busy worker's own oldest work (``policy.offer_stealable``)."""

from __future__ import annotations

from collections.abc import Sequence

from shared.keys import Keys
from shared.prefix_hash import chain, to_hex

# Never a hex hash: present while the worker is live, whatever its cache holds.
LIVE = "live"
# Never a hex hash: the prefix of the member naming a LoRA adapter the worker holds loaded.
ADAPTER = "adapter:"

# KEYS: the candidates' held sets, most preferred first (ties go to the earlier one).
# ARGV: the request's adapter member ("" without an adapter), then its block hashes (hex), first block first.
# Returns {the index (1-based) of the key holding the longest prefix, its blocks, how many keys hold
# that many}; when none holds the first block, {the first key holding the adapter, 0, how many hold it},
# and {0, 0, 0} when none holds that either.
LONGEST_PREFIX = """
local n = #ARGV - 1
local best, best_blocks = 0, 0
for k = 1, #KEYS do
    local key = KEYS[k]
    -- Only a worker that holds one block more than the best so far can beat it.
    if best_blocks < n and redis.call('SISMEMBER', key, ARGV[best_blocks + 2]) == 1 then
        local lo, hi = best_blocks + 1, n
        while lo < hi do
            local mid = math.floor((lo + hi + 1) / 2)
            if redis.call('SISMEMBER', key, ARGV[mid + 1]) == 1 then lo = mid else hi = mid - 1 end
        end
        best, best_blocks = k, lo
    end
end
local holders = 0
if best > 0 then
    for k = 1, #KEYS do
        holders = holders + redis.call('SISMEMBER', KEYS[k], ARGV[best_blocks + 1])
    end
elseif ARGV[1] ~= '' then
    for k = #KEYS, 1, -1 do
        if redis.call('SISMEMBER', KEYS[k], ARGV[1]) == 1 then
            best, holders = k, holders + 1
        end
    end
end
return {best, best_blocks, holders}
"""


def adapter_member(key: str) -> str:
    """The held-set member of a LoRA adapter by its key (``LoRARequest.key``: the prefix cache's root names it too)."""
    return ADAPTER + key


def lookup(
    keys: Keys,
    model: str,
    workers: Sequence[str],
    prompt_token_ids: Sequence[int],
    block_size: int,
    tenant: str | None = None,
    adapter: str | None = None,
) -> tuple[list[str], list[str]]:
    """The keys and args of ``LONGEST_PREFIX`` for a request among ``workers`` (most preferred first);
    ``adapter``: the key of the LoRA adapter it runs with, which roots its chain as in the engine."""
    hashes = chain(prompt_token_ids, block_size, tenant=tenant, adapter=adapter)
    member = adapter_member(adapter) if adapter else ""
    return [keys.held(model, w) for w in workers], [member, *(to_hex(h) for h in hashes)]


def holder(reply: Sequence[int], workers: Sequence[str]) -> tuple[str | None, int]:
    """The worker to offer the request to, and the blocks of it that worker holds. None when no worker
    holds its first block (nor its adapter), or every worker holds as much as the best (a prefix all
    hold, such as a chat template's default system prompt, says nothing about where the request runs best)."""
    index, blocks, holders = (int(r) for r in reply)
    if not index or holders >= len(workers):
        return None, blocks
    return workers[index - 1], blocks
