"""Stopping a step in progress for an urgent arrival, at its next layer.

A step cannot take a request once its forward runs, so an urgent request that arrives while a
loaded worker computes a long step (a prefill chunk beside a full decode batch, or a whole-budget
prefill) waits for all of it before its own prefill even starts: on the 2-core AMX box such a step
took 160-300 ms of an urgent request's time to first token, about its whole idle latency again
(traces in bench/results/priority-2026-12-04-interrupt.md). Instead, the engine stops that step
between two layers and runs the arrival first: the layers it computed are thrown away and computed
again next time, unchanged, since nothing the step decided was kept (no token counted, sampled or
cached; the KV it wrote sits in slots only their own sequence reads, after it recomputes them).

Only a step in its first half of layers stops: past it, finishing costs the arrival less than
the step's work thrown away would cost everyone else. Each cost is then at most half a step. (Stopping
at any layer threw away ~100-140 ms of forward per urgent arrival on the AMX box, 1.5-1.8% of the
saturated worker's time at a 5% urgent share.)

Who may stop which step is ``StepInterrupt``'s rule; the layers call ``stop_if_requested`` (through
the step's ``AttentionMetadata``) where they start their attention.
"""

from __future__ import annotations

import threading


class StepInterrupted(Exception):
    """The step in progress stopped between two layers; nothing it computed is kept."""


class StepInterrupt:
    """Set from another thread, read between layers by the step in progress.

    A step may be stopped only for an arrival at least a whole priority level more urgent than the
    least urgent sequence it computes (the arrival would then pause that sequence in the scheduler's
    urgent-first step anyway), and never twice in a row, so every sequence makes progress whatever
    arrives: the step after a stopped one always runs to its end."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._threshold: float | None = None  # an arrival at or below this stops the step in progress
        self.last_stopped = False

    def arm(self, least_urgent: float | None) -> None:
        """The engine, as a step starts: ``least_urgent`` is its least urgent sequence's effective
        priority (None: this step must run to its end)."""
        self._requested.clear()
        self._threshold = None if least_urgent is None or self.last_stopped else least_urgent - 1

    def disarm(self) -> None:
        self._threshold = None

    def arrival(self, priority: int) -> bool:
        """A request of ``priority`` is on its way to the engine (any thread): True if it stops the step."""
        threshold = self._threshold
        if threshold is None or priority > threshold:
            return False
        self._requested.set()
        return True

    def stop_if_requested(self, layer: int, num_layers: int) -> None:
        """Layer ``layer`` (0-based) of ``num_layers`` starts: stops the step if an arrival asked and
        fewer layers are done than are left."""
        if self._requested.is_set() and 2 * layer < num_layers:
            raise StepInterrupted
