"""What this worker takes from Redis next: the counterpart of TGI's ``next_batch``.

The intake peeks at a priority stream's undelivered entries (most urgent stream first) and asks
``how_many_to_take`` how many of them, in order, this worker should read now. Three budgets,
from the engine's last report (``EngineLoad``) and the starts still on their way to it:

1. Slots: ``max_num_seqs`` plus the prefetch (a few requests that wait inside the engine, so a
   slot that frees at the end of a step is refilled by the next step, not the one after).
2. KV blocks: each prompt's blocks (one more token, and up to a block wasted in its last one)
   must be spare. An idle engine takes the first entry whatever its size: it either runs or is
   rejected and dead-lettered, so one huge request never wedges the queue.
3. Urgency: past the first two, an entry may still be taken when it would displace a running
   sequence the scheduler ranks less urgent (effective priority, i.e. with aging, strictly
   greater): the engine preempts that sequence (its tokens kept, recomputed later) and runs the
   urgent one at once. Without this a full worker never sees urgent work and it waits for a
   slot like everyone else (measured: 56 s instead of 55 ms). Each displaced sequence serves one
   entry, and sequences at least as urgent that wait in the engine, or are on their way to it,
   claim victims first. Less urgent starts on their way claim none: the scheduler admits the
   urgent entry before them. (Waiting for them to land, as a first version did, left urgent
   entries in Redis for most of every step at saturation, when background refills are always
   on their way: measured 3.1 s p99 instead of 0.5 s.)

What is not taken stays in Redis, where any other worker can take it; the intake stops at the
first entry not taken (strict priority). Whether another worker has a free slot for an urgent
entry is the intake's to ask (it needs Redis); this module only reads the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.core.outputs import EngineLoad


@dataclass(frozen=True)
class Take:
    fit: int = 0  # entries that find a slot and blocks now
    displace: int = 0  # entries beyond those, each preempting a less urgent running sequence

    @property
    def total(self) -> int:
        return self.fit + self.displace


@dataclass(frozen=True)
class Capacity:
    prefetch: int  # requests beyond max_num_seqs that may wait inside the engine

    def room(self, load: EngineLoad, in_transit: Sequence[int]) -> int:
        """Free slots, prefetch included, less the starts not yet in the engine."""
        return load.max_num_seqs + self.prefetch - load.num_seqs - len(in_transit)

    def displaceable(self, load: EngineLoad, priority: int, in_transit: Sequence[int] = ()) -> list[int]:
        """Blocks of each running sequence an entry of ``priority`` would preempt, least urgent
        first, less those claimed by sequences of equal or higher urgency that wait in the engine
        or are on their way to it (``in_transit``: their priorities)."""
        victims = sorted(
            (r for r in load.running if r.effective_priority > priority), key=lambda r: -r.effective_priority
        )
        claimed = sum(1 for w in load.waiting if w <= priority) + sum(1 for q in in_transit if q <= priority)
        return [r.num_blocks for r in victims[claimed:]]

    def least_urgent_running(self, load: EngineLoad) -> float:
        """Streams of a lower priority number than this may hold entries worth preempting for."""
        return max((r.effective_priority for r in load.running), default=float("-inf"))

    def how_many_to_take(
        self, load: EngineLoad, in_transit: Sequence[int], priority: int, prompt_lengths: list[int], *, idle: bool
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
