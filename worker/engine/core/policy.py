"""Who runs next: the one place that orders, admits, displaces and pauses work.

Every decision about what enters the batch calls this module, so a new rule is a change here:

- the worker's intake: how many stream entries to accept now (``Capacity.how_many_to_take``),
  which streams a full worker still reads (``Capacity.displacing_levels``), and when it takes an
  entry that a better-placed worker could take (``how_many_to_steal``);
- the scheduler: its sort key (``Policy.urgency``), the order it admits waiting requests in
  (``runs_before``), preemption for a more urgent request (``displaces``), the urgent-first step
  (``runs_first``, ``joins_urgent_prefill``) and the victim of a preemption (``victim``);
- the engine: an arrival stops a step in progress when it ``runs_first`` or ``fair_outranks`` some of
  the step's work.

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

Fair share between tenants inside a level (VTC, a virtual token counter): each tenant's *share* is
its virtual time, the tokens it was served over its weight (``charge`` at the pull, ``settle`` at
the end to what it used, ``lift`` when it becomes backlogged, so an idle tenant banks no credit).
The pull point picks the entry whose tenant's share is lowest (``fair_pick``); the queue's Lua
(``shared.work_queue``) mirrors these functions, and a test checks the two agree. Inside the
engine the share is a part of ``Urgency`` between the level and the rest, so within a level the
tenant furthest under its share runs first. "A tenant under its share displaces one over it" is the
fair clause of ``displaces``, on the engine's slots: a tenant takes the place of another tenant's
request at its level when, after the swap, it still runs no more requests per weight than that one
(symmetric about the weighted share, so weights 3:1 settle at 3:1 of the slots; its
share of the queue puts it at par with the backlogged on arrival, so ordering alone would leave it
waiting for a slot; ``fair_challenger`` finds it behind the entries pulled earlier for the tenant
over its share, whose lower shares put them first). Once per request, at most once per
``FAIR_DISPLACE_EVERY_STEPS`` steps (any step for a tenant far under, ``fair_outranks``), and the
displaced tenant never has fewer running after it:
bounded, so it cannot thrash. Such a request's prompt is prefilled whole at the start of the next
step (``prefills_first``), not in chunks behind the over-share tenant's prompts, beside the running
decodes; the arrival of a tenant far under another's share (``fair_outranks``) stops a step computing
that one's work, as an urgent arrival does. ``runs_first`` compares levels only.

Prefix affinity decides where, never what: an entry offered to the worker that holds its prefix is
left to it until ``offer_stealable`` lets another take it (as an urgent entry is left for a worker
with a free slot until ``how_many_to_steal``); among entries of equal share a worker takes its own
offers first, after any entry that waited past the steal bound.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, TypeVar

if TYPE_CHECKING:
    from worker.engine.core.sequence import Sequence

T = TypeVar("T")


class Urgency(NamedTuple):
    """A request's place in the order: lower runs sooner. Compared by its level (the effective
    priority rounded up to a whole level), then its tenant's share, then the effective priority and
    arrival: without tenants (one share), exactly by effective priority and arrival."""

    effective_priority: float  # priority less aging credit: the request's level
    arrival: float  # among equals, earlier first; ``math.inf`` for a request not yet in the engine
    share: float = 0.0  # its tenant's virtual time when pulled: within a level, the lowest runs first
    tenant: str = ""  # the fair clause of ``displaces`` is between tenants
    shielded: bool = False  # displaced once for fair share: never again for it
    load: float = 0.0  # its tenant's requests running per weight, itself counted (the fair clause only)
    weight: float = 1.0  # its tenant's weight: what one of its requests adds to ``load``

    @property
    def key(self) -> tuple[int, float, float, float]:
        return (level(self), self.share, self.effective_priority, self.arrival)

    def __lt__(self, other: object) -> bool:
        return self.key < other.key if isinstance(other, Urgency) else NotImplemented

    def __le__(self, other: object) -> bool:
        return self.key <= other.key if isinstance(other, Urgency) else NotImplemented

    def __gt__(self, other: object) -> bool:
        return self.key > other.key if isinstance(other, Urgency) else NotImplemented

    def __ge__(self, other: object) -> bool:
        return self.key >= other.key if isinstance(other, Urgency) else NotImplemented


def level(urgency: Urgency) -> int:
    """The whole level an urgency is at: a request aged part of the way to the next level is still at its own."""
    return math.ceil(round(urgency.effective_priority, 9))


@dataclass(frozen=True)
class Policy:
    """What the rules need configured; the rules themselves compare urgencies."""

    aging_steps: int | None  # steps after which a waiting request gains one level; None: no aging
    fair_share: bool = True  # False: every request counts as one tenant's, so the fair clause never applies

    def urgency(self, seq: Sequence, step: int, load: float = 0.0) -> Urgency:
        """``seq``'s urgency at scheduler step ``step``; ``load``: its tenant's (``tenant_load``)."""
        age = (step - seq.arrival_step) / self.aging_steps if self.aging_steps else 0.0
        if not self.fair_share:
            return Urgency(seq.priority - age, seq.arrival, 0.0, "", seq.fair_displaced, load, seq.weight)
        return Urgency(
            seq.priority - age, seq.arrival, seq.share, seq.tenant or "", seq.fair_displaced, load, seq.weight
        )


def arriving(
    priority: int, order: float = math.inf, share: float = 0.0, tenant: str = "", load: float = 0.0
) -> Urgency:
    """The urgency of a request not yet in the engine: no aging credit, behind everything already
    there, and ``order`` ranks those on their way among themselves."""
    return Urgency(priority, order, share, tenant, False, load)


def tenant_load(running_tenants: Iterable[str], tenant: str, weight: float, *, counting_itself: bool) -> float:
    """A tenant's requests running per weight, from the tenants of the running requests; a waiting
    request counts itself (as it would run)."""
    return load_of(sum(1 for t in running_tenants if t == tenant), weight, counting_itself=counting_itself)


def load_of(running: int, weight: float, *, counting_itself: bool) -> float:
    """``tenant_load`` from the count of the tenant's running requests."""
    return (running + (1 if counting_itself else 0)) / (weight if weight > 0 else 1.0)


def runs_before(first: Urgency, then: Urgency) -> bool:
    return first < then


def rivals(a: Urgency, b: Urgency) -> bool:
    """Requests of two tenants at one level: between them the fair clause decides, not urgency."""
    return a.tenant != b.tenant and level(a) == level(b)


def displaces(challenger: Urgency, holder: Urgency) -> bool:
    """Whether ``challenger`` may preempt ``holder`` to take its place: between tenants at one level,
    the fair clause (``displaces_for_fairness``); otherwise strictly more urgent by effective priority
    and arrival (the share never decides it, so a request displaced for fairness never wins its place back
    by having come first)."""
    if rivals(challenger, holder):
        return displaces_for_fairness(challenger, holder)
    return (challenger.effective_priority, challenger.arrival) < (holder.effective_priority, holder.arrival)


# How far under the holder's tenant (requests running per weight) the challenger's must still be
# after the swap: 0, the least that never inverts the two (one slot apart is as fair as slots allow).
FAIR_MARGIN = 0.0
# The engine displaces for fair share at most once per this many steps: each costs a recompute.
FAIR_DISPLACE_EVERY_STEPS = 4


def displaces_for_fairness(challenger: Urgency, holder: Urgency) -> bool:
    """The fair clause: ``challenger``'s tenant, running it (``load`` counts it), runs no more requests per
    weight than ``holder``'s without ``holder`` (by ``FAIR_MARGIN``), and ``holder`` was not displaced for
    fair share before."""
    return not holder.shielded and under_after_swap(challenger.load, holder.load, holder.weight)


def under_after_swap(challenger_load: float, holder_load: float, holder_weight: float) -> bool:
    """The fair clause's arithmetic: the challenger's tenant, counting the request it would start, runs no
    more requests per weight (by ``FAIR_MARGIN``) than the holder's tenant without the one it would give up."""
    after = holder_load - 1.0 / _positive(holder_weight)
    return challenger_load + FAIR_MARGIN <= after + 1e-9  # loads are ratios: rounding


def _positive(weight: float) -> float:
    return weight if weight > 0 else 1.0


def fair_victim(challenger: Urgency, candidates: Iterable[T], urgency: Callable[[T], Urgency]) -> T | None:
    """The running request ``challenger`` displaces for fair share, if any: of another tenant at its
    level, that the fair clause lets it displace; the most loaded tenant's, least urgent among those."""
    found = [
        (u, c) for c in candidates if rivals(u := urgency(c), challenger) and displaces_for_fairness(challenger, u)
    ]
    return max(found, key=lambda pair: (pair[0].load, pair[0]))[1] if found else None


def fair_challenger(waiting: Seq[Urgency], running: Seq[Urgency]) -> int | None:
    """When the slots are full and the first waiting request (``waiting``, in admission order) displaces
    nobody: the first other waiting request at its level that the fair clause lets displace a running
    one (its index), if any. Ordering alone leaves a tenant under its share behind the entries pulled
    before it for a tenant over its share (their shares are lower: they were charged first) until a slot frees."""
    if not waiting:
        return None
    head = level(waiting[0])
    for i, challenger in enumerate(waiting[1:], start=1):
        if level(challenger) != head:
            return None  # strict priority: a less urgent level never goes past a more urgent one
        if fair_victim(challenger, running, lambda u: u) is not None:
            return i
    return None


def prefills_first(waiting: Urgency, running: Iterable[Urgency]) -> bool:
    """Whether ``waiting``'s tenant is far enough under its share (the fair clause's margin, against a
    running request of another tenant at its level) that its prompt is prefilled whole at the start of
    the next step, before the chunks of other prompts: chunked behind an over-share tenant's prefills it
    would wait several full-batch steps for its first token."""
    return any(rivals(r, waiting) and displaces_for_fairness(waiting, r._replace(shielded=False)) for r in running)


# A tenant is far under another's share while it runs at most this share of that one's requests per
# weight (a light tenant amid a flood), never at the edge where backlogged tenants' weights settle, so a
# tenant at its share is not slowed by each of the other's arrivals.
FAR_UNDER = 0.5


def fair_outranks(waiting: Urgency, running: Urgency) -> bool:
    """Whether ``waiting``'s tenant is far under ``running``'s share: another tenant at its level that runs at
    least 1 / ``FAR_UNDER`` times as many requests per weight (``load``, each counting its own). Its arrival
    stops a step computing ``running`` (its prompt then starts a step sooner), it may displace at the next
    step (``fair_displacement_due``), and a full worker's pull passes over to it (``passed_over``). Its
    prefill runs beside ``running``'s decode: pausing that for a step cost the flood about a step's tokens
    per light request and did not shorten the light tenant's time to first token (docs/benchmarks.md)."""
    return rivals(running, waiting) and waiting.load <= FAR_UNDER * running.load + 1e-9  # ratios: rounding


def fair_displacement_due(step: int, last_step: int | None, *, far_under: bool = False) -> bool:
    """Whether the engine may displace for fair share at ``step``, its last such displacement at ``last_step``.
    A challenger ``far_under`` its victim's share (``fair_outranks``) may at the next step: the pace bounds the
    churn at the edge of the shares, where weighted tenants settle; a light tenant's close-together requests
    amid a flood would otherwise each wait up to that many steps, and it holds at most half the other's slots."""
    if last_step is None:
        return True
    return step > last_step if far_under else step - last_step >= FAIR_DISPLACE_EVERY_STEPS


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


# The fair pick (VTC) ------------------------------------------------------------------------------
# Stated here; ``shared.work_queue``'s ENQUEUE, PULL and SETTLE do the same in Redis.


def charge(share: float, cost: float, weight: float) -> float:
    """A tenant's share once an entry of ``cost`` tokens is pulled for it (weights of 0 or less count as 1)."""
    return share + cost / (weight if weight > 0 else 1.0)


def settle(share: float, cost: float, used: float, weight: float) -> float:
    """A tenant's share once a request it was charged ``cost`` for ends having used ``used`` tokens."""
    return share - (cost - used) / (weight if weight > 0 else 1.0)


def lift(own: float, backlogged: Iterable[float], clock: float) -> float:
    """The share of a tenant that becomes backlogged: its own, raised to the least share among the
    backlogged tenants (or, with none, to the share of the last pick): time idle banks no credit."""
    floor = min(backlogged, default=clock)
    return max(own, floor)


class Candidate(NamedTuple):
    """An entry the fair pick may take: the head of a backlogged tenant's lane or of an offer stream."""

    share: float  # its tenant's
    waiting: int  # its tenant's entries not yet pulled
    own_offer: bool  # offered to the worker that picks
    entry_ms: int  # its stream id, the enqueue time
    entry_seq: int
    overdue: bool = False  # it waited the steal bound: affinity may delay work no longer than that


def fair_pick(candidates: Seq[Candidate]) -> int | None:
    """Which candidate the pull takes: the lowest share; among equals the tenant with fewer waiting (a
    tenant just lifted to a flooding one's share goes first), then an overdue entry, then the worker's
    own offer, then the older entry. Without the overdue rule a worker kept busy by its own offers would
    leave work nobody holds (a conversation's first turn) waiting without bound."""
    if not candidates:
        return None
    return min(range(len(candidates)), key=lambda i: _pick_key(candidates[i]))


def _pick_key(c: Candidate) -> tuple[float, int, int, int, int]:
    return (c.share, c.waiting, 0 if c.overdue else 1 if c.own_offer else 2, c.entry_ms, c.entry_seq)


def offer_stealable(
    age_ms: float,
    steal_after_ms: float,
    *,
    owner_live: bool,
    idle: bool,
    held_tokens: int = 0,
    prefill_ms_per_token: float = 0.0,
    own_wait_ms: float = 0.0,
) -> bool:
    """Whether a worker takes an entry offered to another: the worker it was offered to is gone (its held key
    expired); or the taker is idle and it waited as long as the taker would take to prefill what that worker
    holds of it, at most ``steal_after_ms`` (a holder with a free slot starts it at its next step, and prefills
    less; a worker left idle longer than the bound beside queued work would waste the pool); or it waited longer
    than the oldest entry the taker may take without stealing that the pick ranks with it or before it (a tenant
    no further over its share, with no more waiting: ``own_wait_ms``; 0 with none) by ``steal_after_ms`` plus
    the time the taker would spend prefilling again what that worker holds of it (``held_tokens`` at the taker's
    ``prefill_ms_per_token``). A busy worker that steals sooner spends more computing the prefix again than the
    holder's queue costs the request, and an offer for a short shared head (a chat template's) is not held back
    for long. The lead, not the age: when the whole pool is backlogged every entry waits, and taking the
    holder's offers would only trade them for the taker's own work and lose their cached prefixes; a holder
    falling behind the others by the bound is what a steal mends."""
    if not owner_live:
        return True
    if idle and age_ms >= min(steal_after_ms, held_tokens * prefill_ms_per_token):
        return True
    return age_ms - own_wait_ms >= steal_bound_ms(steal_after_ms, held_tokens, prefill_ms_per_token)


def steal_bound_ms(steal_after_ms: float, held_tokens: int, prefill_ms_per_token: float) -> float:
    """How long a busy worker leaves another's offer, of which that one holds ``held_tokens`` (``offer_stealable``)."""
    return steal_after_ms + held_tokens * prefill_ms_per_token


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

    def displaceable(
        self, load: EngineLoad, priority: int, in_transit: Seq[int] = (), entry: Urgency | None = None
    ) -> list[int]:
        """Blocks of each running sequence an entry of ``priority`` would displace, in preemption
        order, less those claimed by the requests that run before it (``in_transit``: the priorities
        of the starts on their way, which arrive before it). ``entry``: its urgency, with its tenant
        and share where the pull point told them (the fair clause)."""
        return [r.num_blocks for r in self._victims(load, entry or arriving(priority), in_transit)]

    def _victims(self, load: EngineLoad, entry: Urgency, in_transit: Seq[int]) -> list[RunningLoad]:
        victims = [r for r in preemption_order(load.running, _urgency) if displaces(entry, r.urgency)]
        on_their_way = (arriving(p, order) for order, p in enumerate(in_transit))
        claimed = sum(1 for u in itertools.chain(load.waiting, on_their_way) if runs_before(u, entry))
        return victims[claimed:]

    def displacing_levels(self, load: EngineLoad, levels: int) -> int:
        """How many priorities, most urgent first, of ``levels``, may hold entries that displace
        running work (more urgent, or of a tenant far enough under a running one's share): the
        priorities a full worker still reads."""
        if not load.running:
            return 0
        # A tenant with nothing running: the furthest under its share an entry can be.
        best = [arriving(priority, tenant=ANY_OTHER_TENANT) for priority in range(levels)]
        return sum(1 for entry in best if any(displaces(entry, r.urgency) for r in load.running))

    def how_many_to_take(
        self,
        load: EngineLoad,
        in_transit: Seq[int],
        priority: int,
        prompt_lengths: list[int],
        *,
        idle: bool,
        urgencies: Seq[Urgency] | None = None,
    ) -> Take:
        """``urgencies``: each entry's, as ``arriving`` with its tenant and share (default: no tenant)."""
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
        entries = list(urgencies) if urgencies is not None else [arriving(priority)] * len(prompt_lengths)
        displace = 0
        for taken in self._victims(load, entries[fit], in_transit):
            if fit + displace == len(prompt_lengths) or not displaces(entries[fit + displace], taken.urgency):
                break
            spare_blocks += taken.num_blocks
            need = tokens + prompt_lengths[fit + displace]
            if load.blocks_for(need + 1) > spare_blocks:
                break
            tokens = need + load.block_size
            displace += 1
        return Take(fit=fit, displace=displace)


# A tenant no running request has: what the best entry of a level could displace.
ANY_OTHER_TENANT = "\x00"


def after_waiting(load: EngineLoad) -> tuple[EngineLoad, Counter[str]]:
    """``load`` as the fair clause will find it once the engine's waiting requests have started: each, in
    admission order, takes a free slot, or the place of a request of the tenant furthest over its share at
    its level when the fair clause lets it (``displaces_for_fairness``), or else waits for a slot; the
    running requests' ``load`` and each tenant's running count (the second part) say so.

    The intake judges an entry against this, not against the running requests alone: the engine
    displaces for fair share at most once per ``FAIR_DISPLACE_EVERY_STEPS`` steps, so an entry it took to
    displace waits a few steps, and a full worker that polls meanwhile would otherwise take another entry
    of the same tenant at each poll (the tenant still looks under its share) until the engine has more of
    it than its share; the pull charges the tenant for all of them, and it then waits until the others
    catch up."""
    running = Counter(r.urgency.tenant for r in load.running)
    weights = {r.urgency.tenant: _positive(r.urgency.weight) for r in load.running}
    at_level = {(r.urgency.tenant, level(r.urgency)) for r in load.running}
    slots = len(load.running)
    for waiting in sorted(load.waiting):
        tenant = waiting.tenant
        weight = weights.setdefault(tenant, _positive(waiting.weight))
        if slots < load.max_num_seqs:
            slots += 1
            running[tenant] += 1
            continue
        mine = (running[tenant] + 1) / weight
        over = [
            t
            for t in running
            if t != tenant
            and running[t] > 0
            and (t, level(waiting)) in at_level
            and under_after_swap(mine, running[t] / weights[t], weights[t])
        ]
        if over:
            taken = max(over, key=lambda t: running[t] / weights[t])
            running[taken] -= 1
            running[tenant] += 1
            at_level.add((tenant, level(waiting)))
    if not load.waiting:
        return load, running
    settled = tuple(
        RunningLoad(r.urgency._replace(load=running[r.urgency.tenant] / weights[r.urgency.tenant]), r.num_blocks)
        for r in load.running
    )
    return replace(load, running=settled), running


class PassOver(NamedTuple):
    """Which tenants a full worker's pick passes over at a priority (``passed_over``)."""

    cannot_displace: frozenset[str] = frozenset()  # their next entry would displace nothing here
    at_the_edge: frozenset[str] = frozenset()  # it would displace, but no running request's tenant is far over it

    def __bool__(self) -> bool:
        return bool(self.cannot_displace or self.at_the_edge)


def passed_over(load: EngineLoad, running: Counter[str], priority: int) -> PassOver:
    """How a full worker's pick at ``priority`` treats each tenant that runs here (``running``: each tenant's
    requests, as ``after_waiting`` counts them), judged on its next entry (its load counting it) against
    ``load``'s running requests. When the fair pick's first entry is of a tenant that would displace nothing
    (``displaces``), the pick takes instead the first entry of a tenant far under another's share
    (``fair_outranks``; a tenant with nothing running here counts as one), passing over the others. The pull
    charges a tenant up front, so a light tenant's share runs ahead of a flooding tenant's until that one's
    next pull, while it runs far fewer requests: without this its entry would wait behind the flood's until a
    slot freed. A tenant at the edge of its share is taken only as the pick's first entry, as without this,
    so weighted tenants keep the pull's 3:1 rather than the slots' churn."""
    weights = {r.urgency.tenant: r.urgency.weight for r in load.running}
    cannot, edge = set(), set()
    for tenant, count in running.items():
        if count <= 0 or tenant not in weights:
            continue
        entry = arriving(priority, tenant=tenant, load=load_of(count, weights[tenant], counting_itself=True))
        if not any(displaces(entry, r.urgency) for r in load.running):
            cannot.add(tenant)
        elif not any(fair_outranks(entry, r.urgency) for r in load.running):
            edge.add(tenant)
    return PassOver(frozenset(cannot), frozenset(edge))


def _urgency(running: RunningLoad) -> Urgency:
    return running.urgency
