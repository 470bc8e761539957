"""Paged KV-cache bookkeeping: which physical blocks each sequence owns.

Blocks hold ``block_size`` tokens. A free list (LRU order) hands out blocks; ref counts let
sequences share full blocks of a common prefix. A full block is registered under a chained
hash (``shared.prefix_hash``: previous block's hash + its tokens, rooted in the tenant's salt), so a
later sequence with the same prefix reuses the computed KV. Freed blocks keep their contents and hash
until the free list hands them out again, which makes them an LRU cache at no extra memory.

What enters and leaves the cache is kept until ``drain_changes`` takes it: the worker mirrors it
into Redis, where the API looks for the worker that holds a request's prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.prefix_hash import chain
from worker.engine.core.sequence import Sequence


@dataclass
class CacheChanges:
    """Block hashes that entered and left the prefix cache since the last drain. ``full``: ``cached`` is
    everything the cache holds (asked for, or too many changes piled up undrained) and replaces any copy."""

    cached: list[int]
    evicted: list[int]
    full: bool = False


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks  # guards against hash collisions
        self._cached: dict[int, int] = {}  # chained hash -> block id
        # Front = reused first: blocks without a hash, then the least recently freed cached ones.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._registered: dict[str, int] = {}  # request id -> number of its blocks already hashed
        # Hashes that entered (True) or left (False) the cache since the last drain; the last change wins.
        self._changes: dict[int, bool] = {}
        self._changes_dropped = False

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def _block_hash(self, seq: Sequence, index: int) -> int:
        if len(seq.block_hashes) <= index:
            end = (index + 1) * self.block_size
            seq.block_hashes = chain(
                seq.token_ids[:end], self.block_size, tenant=seq.tenant, adapter=seq.adapter, start=seq.block_hashes
            )
        return seq.block_hashes[index]

    def drain_changes(self, full: bool = False) -> CacheChanges:
        """Hashes cached and evicted since the last call, each as it stands now; ``full``: everything cached."""
        changes, self._changes = self._changes, {}
        if full or self._changes_dropped:
            self._changes_dropped = False
            return CacheChanges(list(self._cached), [], full=True)
        return CacheChanges([h for h, c in changes.items() if c], [h for h, c in changes.items() if not c])

    def _changed(self, block_hash: int, cached: bool) -> None:
        # Nobody drains an offline engine: past a bound, the next drain is a full one instead.
        if len(self._changes) >= 2 * self.num_blocks + 1024:
            self._changes.clear()
            self._changes_dropped = True
        if not self._changes_dropped:
            self._changes[block_hash] = cached

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a fresh sequence; returns tokens reused."""
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        # Keep at least one token to compute: the step needs its logits.
        for i in range((seq.num_tokens - 1) // bs):
            block = self._cached.get(self._block_hash(seq, i))
            if block is None or self._tokens_of[block] != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_computed_tokens = len(seq.block_table) * bs
        self._registered[seq.request_id] = len(seq.block_table)
        return seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``; False (and no change) if blocks are short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of[block]
            if old is not None:  # evict: the block is about to be overwritten
                if self._cached.get(old) == block:
                    del self._cached[old]
                    self._changed(old, False)
                self._hash_of[block] = None
                self._tokens_of[block] = None
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        done = self._registered.get(seq.request_id, 0)
        full = seq.num_computed_tokens // bs
        for i in range(done, full):
            block = seq.block_table[i]
            h = self._block_hash(seq, i)
            if self._hash_of[block] is None:
                self._hash_of[block] = h
                self._tokens_of[block] = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                if self._cached.setdefault(h, block) == block:
                    self._changed(h, True)
        self._registered[seq.request_id] = max(done, full)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the blocks past those ``num_tokens`` tokens need (a rejected proposal's positions).
        They hold no cached hash: only blocks full of computed tokens are registered."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so a prefix's head blocks stay cached longest.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, "block freed twice"
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._registered.pop(seq.request_id, None)
