"""Who runs next: the one place that orders, admits, displaces and pauses work.

Every decision about what enters the batch calls this module, so a new rule is a change here:

- the worker's intake: how many stream entries to accept now (``Capacity.how_many_to_take``),
  which streams a full worker still reads (``Capacity.displacing_levels``), and when it takes an
  entry that a better-placed worker could take (``how_many_to_steal``);
- the scheduler: its sort key (``Policy.urgency``), the order it admits waiting requests in
  (``runs_before``), preemption for a more urgent request (``displaces``), the urgent-first step
  (``runs_first``, ``joins_urgent_prefill``) and the victim of a preemption (``victim``);
- the engine: an arrival stops a step in progress when it ``runs_first`` of some of the step's work.

The words, one meaning each:

- *urgency*: the sort key, an ``Urgency`` compared part by part; lower runs sooner. Its
  *effective priority* is the priority less one level per ``aging_steps`` steps waited, so nobody
  starves; between two given requests the order never flips, so preemption cannot ping-pong.
- *runs before*: lower urgency. The scheduler admits waiting requests in this order; waiting and
  arriving requests that run before an entry claim the running work it could displace first.
- *displaces*: strictly more urgent: a request may preempt a running one to take its place.
- *runs first* (outranks): at least a whole level more urgent in effective priority: the running
  work it outranks sits out the step that prefills it, and its arrival stops a step computing it.
- *victim*: the one a preemption takes, whatever the reason (short of KV blocks, or displaced):
  the least urgent, the newest among equals.

Where the next rules go:

- Fair share between tenants inside a priority: a part of ``Urgency`` between
  ``effective_priority`` and ``arrival`` (the tenant's token-counted virtual time, so that within a
  level the tenant furthest under its share runs before), filled by ``Policy.urgency`` and
  ``arriving``; "a tenant under its share displaces one over it" is a clause of ``displaces``.
  ``runs_first`` compares levels only and stays as it is.
- Prefix and adapter affinity decide where, never what: among entries of equal standing a worker
  prefers those whose prefix or adapter it holds, and an entry is left for the worker that holds
  them until ``how_many_to_steal`` lets another take it, as an urgent entry is left for a worker
  with a free slot.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

if TYPE_CHECKING:
    from worker.engine.core.sequence import Sequence

T = TypeVar("T")


class Urgency(NamedTuple):
    """A request's place in the order, compared part by part: lower runs sooner."""

    effective_priority: float  # priority less aging credit: the request's level
    arrival: float  # among equals, earlier first; ``math.inf`` for a request not yet in the engine


@dataclass(frozen=True)
class Policy:
    """What the rules need configured; the rules themselves compare urgencies."""

    aging_steps: int | None  # steps after which a waiting request gains one level; None: no aging

    def urgency(self, seq: Sequence, step: int) -> Urgency:
        """``seq``'s urgency at scheduler step ``step``."""
        age = (step - seq.arrival_step) / self.aging_steps if self.aging_steps else 0.0
        return Urgency(seq.priority - age, seq.arrival)


def arriving(priority: int, order: float = math.inf) -> Urgency:
    """The urgency of a request not yet in the engine: no aging credit, behind everything already
    there, and ``order`` ranks those on their way among themselves."""
    return Urgency(priority, order)


def runs_before(first: Urgency, then: Urgency) -> bool:
    return first < then


def displaces(challenger: Urgency, holder: Urgency) -> bool:
    """Whether ``challenger`` may preempt ``holder`` to take its place: strictly more urgent."""
    return runs_before(challenger, holder)


def runs_first(urgent: Urgency, other: Urgency) -> bool:
    """The urgent-first rule: ``urgent`` is at least a whole priority level more urgent than ``other``."""
    return urgent.effective_priority <= other.effective_priority - 1


def joins_urgent_prefill(waiting: Urgency, head: Urgency) -> bool:
    """Whether a waiting request is admitted in the urgent-first step that ``head`` (the most urgent
    waiting request) opens: it is as urgent."""
    return waiting.effective_priority <= head.effective_priority


def victim(candidates: Iterable[T], urgency: Callable[[T], Urgency]) -> T:
    """The candidate a preemption takes: the least urgent, the newest among equals."""
    return max(candidates, key=urgency)


def preemption_order(candidates: Iterable[T], urgency: Callable[[T], Urgency]) -> list[T]:
    """``candidates`` in the order successive preemptions take them (each ``victim`` of the rest)."""
    return sorted(candidates, key=urgency, reverse=True)


@dataclass(frozen=True)
class RunningLoad:
    urgency: Urgency  # as the scheduler ranks it (``policy``)
    num_blocks: int  # KV blocks a preemption would free


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds, as of its last step, add or abort. Replaced whole (never mutated), so
    another thread reads it without the engine's lock, which a step holds for its whole forward."""

    max_num_seqs: int
    block_size: int
    num_seqs: int = 0  # unfinished sequences: running and waiting inside the engine
    spare_blocks: int = 0  # free KV blocks less what the waiting sequences will claim
    running: tuple[RunningLoad, ...] = ()
    waiting: tuple[Urgency, ...] = ()  # of the waiting sequences

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def how_many_to_steal(first_seen: Iterable[float], now: float, wait_s: float) -> int:
    """Of entries that another worker is better placed to run, how many, in order, this worker takes
    now: those it first saw at least ``wait_s`` ago. ``first_seen`` is read lazily, up to the first
    entry still left for the other worker."""
    return sum(1 for _ in itertools.takewhile(lambda seen: now - seen >= wait_s, first_seen))


@dataclass(frozen=True)
class Take:
    fit: int = 0  # entries that find a slot and blocks now
    displace: int = 0  # entries beyond those, each displacing a less urgent running sequence

    @property
    def total(self) -> int:
        return self.fit + self.displace


@dataclass(frozen=True)
class Capacity:
    """How many stream entries a worker accepts now, from the engine's last report (``EngineLoad``)
    and the starts still on their way to it: the counterpart of TGI's ``next_batch``. Budgets:

    1. Slots: ``max_num_seqs`` plus the prefetch (requests that wait inside the engine, so a slot
       that frees at the end of a step is refilled by the next step, not the one after).
    2. KV blocks: each prompt's blocks (one more token, and up to a block wasted in its last one)
       must be spare. An idle engine takes the first entry whatever its size: it either runs or is
       rejected and dead-lettered, so one huge request never wedges the queue.
    3. Displacement: past those, an entry is still taken when it ``displaces`` a running sequence
       (the engine preempts that one and runs the entry at once), so a full worker sees urgent
       work. Each victim serves one entry, and the requests that run before the entry, waiting in
       the engine or on their way to it, claim victims first; less urgent starts on their way claim
       none, since the scheduler admits the entry before them.
    """

    prefetch: int  # requests beyond max_num_seqs that may wait inside the engine

    @classmethod
    def for_engine(cls, max_num_seqs: int, prefetch: int | None = None) -> Capacity:
        """``prefetch`` defaults to a sixteenth of the engine's slots."""
        return cls(prefetch if prefetch is not None else max_num_seqs // 16)

    def room(self, load: EngineLoad, in_transit: Seq[int]) -> int:
        """Free slots, prefetch included, less the starts not yet in the engine."""
        return load.max_num_seqs + self.prefetch - load.num_seqs - len(in_transit)

    def displaceable(self, load: EngineLoad, priority: int, in_transit: Seq[int] = ()) -> list[int]:
        """Blocks of each running sequence an entry of ``priority`` would displace, in preemption
        order, less those claimed by the requests that run before it (``in_transit``: the priorities
        of the starts on their way, which arrive before it)."""
        entry = arriving(priority)
        victims = [r for r in preemption_order(load.running, _urgency) if displaces(entry, r.urgency)]
        on_their_way = (arriving(p, order) for order, p in enumerate(in_transit))
        claimed = sum(1 for u in itertools.chain(load.waiting, on_their_way) if runs_before(u, entry))
        return [r.num_blocks for r in victims[claimed:]]

    def displacing_levels(self, load: EngineLoad, levels: int) -> int:
        """How many priorities, most urgent first, of ``levels``, may hold entries that displace
        running work: the streams a full worker still reads."""
        if not load.running:
            return 0
        least_urgent = victim(load.running, _urgency).urgency
        return sum(1 for priority in range(levels) if displaces(arriving(priority), least_urgent))

    def how_many_to_take(
        self, load: EngineLoad, in_transit: Seq[int], priority: int, prompt_lengths: list[int], *, idle: bool
    ) -> Take:
        slots = self.room(load, in_transit)
        spare_blocks = load.spare_blocks
        tokens = 0  # what the entries taken so far will hold, each with up to a block wasted in its last one
        fit = 0
        for length in prompt_lengths:
            need = tokens + length
            if slots <= 0 or (load.blocks_for(need + 1) > spare_blocks and not (fit == 0 and idle)):
                break
            slots -= 1
            tokens = need + load.block_size
            fit += 1
        if fit == len(prompt_lengths):
            return Take(fit=fit)
        displace = 0
        for victim_blocks in self.displaceable(load, priority, in_transit):
            if fit + displace == len(prompt_lengths):
                break
            spare_blocks += victim_blocks
            need = tokens + prompt_lengths[fit + displace]
            if load.blocks_for(need + 1) > spare_blocks:
                break
            tokens = need + load.block_size
            displace += 1
        return Take(fit=fit, displace=displace)


def _urgency(running: RunningLoad) -> Urgency:
    return running.urgency
