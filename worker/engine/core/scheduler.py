"""Who runs this step, and how many tokens each. The rules it applies are ``policy``'s.

Order of business each step: expire requests past their deadline; give every running decode its
next token, preempting a victim when blocks run short; then prefill work in urgency order, chunked
to the token budget: an ongoing prefill runs only after the waiting requests that run before it
were admitted, so background prefills in progress cannot take every step's budget from an urgent
request.

Urgent prefill first: when the most urgent waiting request runs first of the least urgent running
one (a whole level more urgent), the step prefills the waiting requests as urgent as it, and only
the running sequences it does not outrank decode beside them; the rest sits that one step out (as
TGI's router pauses decoding for a prefill), which keeps an urgent request's first token close to
its idle latency while background work saturates the batch. The test is against the least urgent
running sequence, so a new urgent request does not wait a step behind urgent ones already decoding.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engine.core.block_manager import BlockManager
from worker.engine.core.outputs import EngineStats
from worker.engine.core.policy import (
    Policy,
    Urgency,
    arriving,
    displaces,
    fair_challenger,
    fair_displacement_due,
    fair_outranks,
    fair_victim,
    joins_urgent_prefill,
    level,
    load_of,
    prefills_first,
    rivals,
    runs_before,
    runs_first,
    victim,
)
from worker.engine.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens to compute this step, per sequence
    expired: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Tokens the step computes (drafts included), kept as they change: the budget is read per sequence.
    num_tokens: int = 0
    is_decode: list[bool] = field(default_factory=list)  # for its next output token (else a prompt chunk)
    num_decodes: int = 0
    num_draft_tokens: int = 0  # proposed tokens checked beside the decodes (each decode's ``seq.draft``)

    def add(self, seq: Sequence, n: int, *, decode: bool = False) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.is_decode.append(decode)
        self.num_tokens += n + len(seq.draft)
        self.num_decodes += decode
        self.num_draft_tokens += len(seq.draft)

    def drop(self, seq: Sequence) -> None:
        if seq in self.seqs:
            i = self.seqs.index(seq)
            self.num_tokens -= self.num_new_tokens[i] + len(seq.draft)
            self.num_decodes -= self.is_decode[i]
            self.num_draft_tokens -= len(seq.draft)
            del self.seqs[i], self.num_new_tokens[i], self.is_decode[i]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        stats: EngineStats,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: Policy,
        max_prefill_tokens_beside_decodes: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.blocks = block_manager
        self.stats = stats
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.max_prefill_tokens_beside_decodes = max_prefill_tokens_beside_decodes
        self.clock = clock
        # A decode's proposed next tokens, or none; set by the engine when it speculates. Called with the
        # most it may propose, the step's decodes (at most) and the tokens the step's decodes proposed so far.
        self.propose: Callable[[Sequence, int, int, int], list[int]] | None = None
        self._decodes = 0  # running sequences that decode this step, at most
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.step_count = 0
        self._admission_stopped = False  # this step: a waiting request could not start
        self._last_fair_step: int | None = None  # the step of the last displacement for fair share

    def urgency(self, seq: Sequence) -> Urgency:
        return self.policy.urgency(seq, self.step_count)

    def fair_urgencies(self, seqs: list[Sequence], counts: Counter[str] | None = None) -> list[Urgency]:
        """``seqs``' urgencies with their tenant's load (``policy.load_of``): what the fair clause reads.
        ``counts``: each tenant's running requests (default: the engine's)."""
        if counts is None:
            counts = Counter(s.tenant or "" for s in self.running)  # once, not a scan of the running per request
        return [
            self.policy.urgency(
                s,
                self.step_count,
                load_of(counts[s.tenant or ""], s.weight, counting_itself=s.status is SequenceStatus.WAITING),
            )
            for s in seqs
        ]

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
        self.running.sort(key=self.urgency)
        self.waiting.sort(key=self.urgency)
        self._admission_stopped = False
        if self.propose is not None:
            self._decodes = sum(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        if self._urgent_waiting():
            top = self.urgency(self.waiting[0])
            self._admit(batch, while_head=lambda head: joins_urgent_prefill(self.urgency(head), top))
            if batch.seqs:
                # Those it does not outrank keep decoding: urgent streams stay live; only background
                # work pauses. Running is sorted by urgency, so they are its head (a snapshot:
                # _continue may preempt); those just admitted are in the batch already.
                peers = itertools.takewhile(lambda s: not runs_first(top, self.urgency(s)), self.running)
                for seq in list(peers):
                    if seq.num_tokens - seq.num_computed_tokens == 1 and seq not in batch.seqs:
                        self._continue(seq, batch)
                return self._done(batch)
        if self._admit_fair_first(batch):
            return self._done(batch)
        remaining = {s: s.num_tokens - s.num_computed_tokens for s in self.running if s not in batch.seqs}
        # Decodes first: they are latency-critical and cost one token each.
        for seq in [s for s in remaining if remaining[s] == 1]:
            self._continue(seq, batch)
        for seq in [s for s in remaining if remaining[s] > 1]:
            self._admit(batch, while_head=lambda head, seq=seq: runs_before(self.urgency(head), self.urgency(seq)))
            self._continue(seq, batch)
        self._admit(batch)
        return self._done(batch)

    def _admit_fair_first(self, batch: ScheduledBatch) -> bool:
        """The first waiting request of the most urgent waiting level whose tenant is far under its share
        (``policy.prefills_first``) starts with its prompt whole, displacing for fair share when the slots
        are full; one per step. The running decodes decode beside it (its prompt less a token each). True when
        it started: the step is then whole, with no other prompt's chunk."""
        if not self.waiting or not self.running:
            return False
        if not self._tenants_apart():
            return False
        waiting, running = self.fair_urgencies(self.waiting), self.fair_urgencies(self.running)
        top = level(waiting[0])
        prefilling = (u for s, u in zip(self.running, running, strict=True) if s.num_tokens - s.num_computed_tokens > 1)
        if any(level(u) < top for u in prefilling):
            return False  # a more urgent prompt still prefills: it keeps the step's prefill budget
        seq = next(
            (s for s, u in zip(self.waiting, waiting, strict=True) if level(u) == top and prefills_first(u, running)),
            None,
        )
        if seq is None:
            return False
        if len(self.running) >= self.max_num_seqs and not self._displace_for_fairness(seq, batch):
            return False
        beside = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]  # its victim left them
        if not seq.block_table:
            hits = self.blocks.match_prefix(seq)
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += hits
        n = min(seq.num_tokens - seq.num_computed_tokens, self._budget(batch) - len(beside))
        if n <= 0 or not self.blocks.allocate(seq, n):
            self.blocks.free(seq)  # the prefix blocks it grabbed; the usual admission takes it from here
            return False
        self.waiting.remove(seq)
        seq.status = SequenceStatus.PREFILLING
        self.running.append(seq)
        batch.add(seq, n)
        for other in beside:
            self._continue(other, batch)
        return True

    def _tenants_apart(self) -> bool:
        """Whether the engine holds requests of two tenants or more. The fair clause is between tenants: with
        one (or none) it never applies, and its urgencies (each request's tenant load) are a per-step cost
        that grows with the queue."""
        return len({s.tenant or "" for s in self.waiting} | {s.tenant or "" for s in self.running}) > 1

    def _urgent_waiting(self) -> bool:
        if not self.waiting or not self.running:
            return False
        # Both queues are sorted by urgency (schedule() sorts them first): the waiting head is the
        # most urgent request waiting, the running tail the least urgent one running.
        return runs_first(self.urgency(self.waiting[0]), self.urgency(self.running[-1]))

    def pauses_any(self, priority: int, seqs: list[Sequence], tenant: str = "", weight: float = 1.0) -> bool:
        """Whether a new arrival of ``priority`` (of ``tenant``, with its ``weight``) runs first of some of
        ``seqs`` (asked from another thread, for a step's batch, when a request arrives): a whole level more
        urgent, or far enough under their tenant's share that it ``fair_outranks`` them (each tenant's load
        counted in ``seqs``), which also lets it displace one of them at the next step."""
        arrival = arriving(priority)
        if any(runs_first(arrival, self.urgency(s)) for s in seqs):
            return True
        if not self.policy.fair_share or not tenant:
            return False
        counts = Counter(s.tenant or "" for s in seqs)
        mine = arriving(priority, tenant=tenant, load=load_of(counts[tenant], weight, counting_itself=True))
        return any(fair_outranks(mine, u) for u in self.fair_urgencies(seqs, counts))

    def _budget(self, batch: ScheduledBatch) -> int:
        return self.max_num_batched_tokens - batch.num_tokens

    def _prefill_budget(self, batch: ScheduledBatch) -> int:
        """Prompt tokens this step may still take. Beside decodes, at most
        max_prefill_tokens_beside_decodes in all: a step's time is about a decode batch's plus its
        prefill tokens', and nothing can join a step in progress, so a long background chunk would
        hold every running stream's next token, and an urgent arrival, for the whole of it."""
        cap = self.max_prefill_tokens_beside_decodes
        if cap is None or batch.num_decodes == 0:
            return self._budget(batch)
        return min(self._budget(batch), cap - (batch.num_tokens - batch.num_decodes - batch.num_draft_tokens))

    def _continue(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """A running sequence's next tokens (one for a decode, a chunk of its prompt for a prefill)."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        budget = self._budget(batch) if remaining == 1 else self._prefill_budget(batch)
        if seq.status is SequenceStatus.WAITING or budget <= 0:
            return  # preempted earlier this step, or no budget left: it sits this step out
        n = min(remaining, budget)
        seq.draft = (
            self.propose(seq, budget - 1, self._decodes, batch.num_draft_tokens)
            if remaining == 1 and self.propose is not None
            else []
        )
        if seq.draft and not self.blocks.allocate(seq, n + len(seq.draft)):
            seq.draft = []  # a proposal never preempts anyone: the decode goes on without it
        while not self.blocks.allocate(seq, n):
            taken = victim((s for s in self.running if s not in batch.seqs), self.urgency)
            self._preempt(taken, batch, "kv_blocks")
            if taken is seq:
                return
        batch.add(seq, n, decode=remaining == 1)

    def _admit(self, batch: ScheduledBatch, while_head: Callable[[Sequence], bool] = lambda _: True) -> None:
        """Waiting requests in urgency order, while ``while_head`` holds for the next one. The first
        that cannot start stops admission for the rest of the step (strict priority)."""
        while self.waiting and not self._admission_stopped and self._prefill_budget(batch) > 0:
            if not while_head(self.waiting[0]):
                return
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs and not self._preempt_less_urgent(seq, batch):
                # The head displaces nobody: a request behind it of a tenant under its share still may.
                challenger = self._fair_challenger(batch, while_head)
                if challenger is None:
                    self._admission_stopped = True
                    return
                seq = challenger
            if not seq.block_table:  # fresh or preempted: reuse whatever prefix is cached
                hits = self.blocks.match_prefix(seq)
                self.stats.prefix_cache_queries += seq.num_tokens
                self.stats.prefix_cache_hits += hits
            n = min(seq.num_tokens - seq.num_computed_tokens, self._prefill_budget(batch))
            while not self.blocks.allocate(seq, n):
                if not self._preempt_less_urgent(seq, batch):
                    self.blocks.free(seq)  # give back the prefix blocks it grabbed; strict priority: stop here
                    self._admission_stopped = True
                    return
            self.waiting.remove(seq)
            seq.status = SequenceStatus.PREFILLING
            self.running.append(seq)
            batch.add(seq, n)

    def _done(self, batch: ScheduledBatch) -> ScheduledBatch:
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
        """A waiting request takes the victim's place among the running, if it displaces it."""
        if not self.running:
            return False
        taken = victim(self.running, self.urgency)
        mine, theirs = self.urgency(seq), self.urgency(taken)
        if displaces(mine, theirs) and not rivals(mine, theirs):
            self._preempt(taken, batch, "urgency")
            return True
        return self._displace_for_fairness(seq, batch)

    def _displace_for_fairness(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        (mine,) = self.fair_urgencies([seq])
        loads = dict(zip(self.running, self.fair_urgencies(self.running), strict=True))
        fair = fair_victim(mine, self.running, loads.__getitem__)
        far_under = fair is not None and fair_outranks(mine, loads[fair])
        if fair is None or not fair_displacement_due(self.step_count, self._last_fair_step, far_under=far_under):
            return False
        self._last_fair_step = self.step_count
        fair.fair_displaced = True
        self._preempt(fair, batch, "fair_share")
        return True

    def _fair_challenger(self, batch: ScheduledBatch, while_head: Callable[[Sequence], bool]) -> Sequence | None:
        """A waiting request behind the head that displaces a running one for fair share (``policy.fair_challenger``),
        its victim preempted; None when there is none or a displacement is not due."""
        if not self._tenants_apart():
            return None
        found = fair_challenger(self.fair_urgencies(self.waiting), self.fair_urgencies(self.running))
        if found is None:
            return None
        seq = self.waiting[found]
        return seq if while_head(seq) and self._displace_for_fairness(seq, batch) else None

    def _preempt(self, seq: Sequence, batch: ScheduledBatch, reason: str) -> None:
        batch.drop(seq)
        seq.draft = []
        self.running.remove(seq)
        self.stats.recomputed_tokens += seq.num_computed_tokens  # an upper bound: the prefix cache may keep some
        self.blocks.free(seq)  # tokens are kept; their KV is recomputed (or found in the prefix cache)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.stats.preemptions += 1
        self.stats.preemptions_by_reason[reason] += 1
        batch.preempted.append(seq)
