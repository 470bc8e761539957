"""Paged KV-cache bookkeeping: which physical blocks each sequence owns.

Blocks hold ``block_size`` tokens. A free list (LRU order) hands out blocks; ref counts let
sequences share full blocks of a common prefix. A full block is registered under a chained
hash (previous block's hash + its tokens, rooted in the tenant's salt), so a later sequence
with the same prefix reuses the computed KV. Freed blocks keep their contents and hash until
the free list hands them out again, which makes them an LRU cache at no extra memory.
"""

from __future__ import annotations

from collections import OrderedDict

from worker.engine.core.sequence import Sequence


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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def _block_hash(self, seq: Sequence, index: int) -> int:
        hashes = seq.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            prev = hashes[-1] if hashes else hash(("inflightq-root", seq.tenant))
            hashes.append(hash((prev, *seq.token_ids[i * self.block_size : (i + 1) * self.block_size])))
        return hashes[index]

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
                self._cached.setdefault(h, block)
        self._registered[seq.request_id] = max(done, full)

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
