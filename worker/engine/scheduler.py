"""Who runs this step, and how many tokens each: the step's admission logic in one place.

Order of business each step: expire requests past their deadline; give every running sequence
its next tokens (decodes first, then the rest of ongoing prefills), preempting the least urgent
sequence when blocks run short; then admit waiting requests in urgency order, chunking prefills
to the token budget. Urgency is (priority - steps since arrival / aging_steps, arrival): lower
runs sooner. Aging moves an old request ahead of newer, nominally more urgent ones, so nobody
starves; between two given requests the order never flips, so preemption cannot ping-pong.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.outputs import EngineStats
from worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens to compute this step, per sequence
    expired: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        stats: EngineStats,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        aging_steps: int | None = 256,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.blocks = block_manager
        self.stats = stats
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.aging_steps = aging_steps
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.step_count = 0

    def urgency(self, seq: Sequence) -> tuple[float, int]:
        age = (self.step_count - seq.arrival_step) / self.aging_steps if self.aging_steps else 0.0
        return (seq.priority - age, seq.arrival)

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.step_count
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out (abort/finish), freeing its blocks now."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
                self.blocks.free(seq)
                return True
        return False

    def schedule(self) -> ScheduledBatch:
        self.step_count += 1
        batch = ScheduledBatch(expired=self._expire())
        budget = self.max_num_batched_tokens
        self.running.sort(key=self.urgency)
        # Decodes first: they are latency-critical and cost one token each.
        order = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        order += [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in order:
            if seq.status is SequenceStatus.WAITING or budget == 0:
                continue  # preempted earlier in this loop, or no budget left: it sits this step out
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq, n):
                victim = max((s for s in self.running if s not in batch.seqs), key=self.urgency)
                self._preempt(victim, batch, "kv_blocks")
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n

        self.waiting.sort(key=self.urgency)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs and not self._preempt_less_urgent(seq, batch):
                break
            if not seq.block_table:  # fresh or preempted: reuse whatever prefix is cached
                hits = self.blocks.match_prefix(seq)
                self.stats.prefix_cache_queries += seq.num_tokens
                self.stats.prefix_cache_hits += hits
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq, n):
                if not self._preempt_less_urgent(seq, batch):
                    break
            else:
                self.waiting.pop(0)
                seq.status = SequenceStatus.PREFILLING
                self.running.append(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget = self.max_num_batched_tokens - batch.num_tokens
                continue
            self.blocks.free(seq)  # give back the prefix blocks it grabbed; strict priority: stop here
            break
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        return batch

    def _expire(self) -> list[Sequence]:
        now = self.clock()
        expired = [s for s in (*self.running, *self.waiting) if s.deadline is not None and now > s.deadline]
        for seq in expired:
            self.remove(seq)
        return expired

    def _preempt_less_urgent(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """An urgent waiting request displaces the least urgent running one, if that one is less urgent."""
        if not self.running:
            return False
        victim = max(self.running, key=self.urgency)
        if self.urgency(victim) <= self.urgency(seq):
            return False
        self._preempt(victim, batch, "urgency")
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch, reason: str) -> None:
        if seq in batch.seqs:
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i]
        self.running.remove(seq)
        self.stats.recomputed_tokens += seq.num_computed_tokens  # an upper bound: the prefix cache may keep some
        self.blocks.free(seq)  # tokens are kept; their KV is recomputed (or found in the prefix cache)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.stats.preemptions += 1
        self.stats.preemptions_by_reason[reason] += 1
        batch.preempted.append(seq)
