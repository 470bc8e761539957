"""Stopping a step in progress for an urgent arrival, at its next layer.

Urgent: a whole priority level more urgent than some of the step's work, or a tenant far enough under
its share that the next step prefills it first and may displace some of that work (``policy.fair_outranks``).

A step cannot take a request once its forward runs, so an urgent request that arrives while a
loaded worker computes a long step (a prefill chunk beside a full decode batch, or a whole-budget
prefill) would wait for all of it before its own prefill starts (see docs/benchmarks.md).
Instead, the engine stops that step between two layers and runs the arrival first. The layers it
computed are thrown away and computed again next time, unchanged, since nothing the step decided
was kept (no token counted, sampled or cached; the KV it wrote sits in slots only their own
sequence reads, after it recomputes them).

Only a step in its first half of layers stops: past it, finishing costs the arrival less than the
step's work thrown away would cost everyone else. Each cost is then at most half a step.

Whether an arrival is urgent enough is the policy's (``policy.runs_first`` or ``fair_outranks``,
through ``Scheduler.pauses_any``, judged only when a request arrives); when a step may stop is
``StepInterrupt``'s; the layers call ``stop_if_requested`` (through the step's
``AttentionMetadata``) where they start their attention.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# Stopped steps' thrown-away forward time may be at most this share of the engine's step time, so a
# steady stream of urgent arrivals beside background work cannot throw away much of the throughput.
MAX_THROWN_AWAY_SHARE = 0.05


class StepInterrupted(Exception):
    """The step in progress stopped between two layers; nothing it computed is kept."""


class StepInterrupt:
    """Set from another thread, read between layers by the step in progress.

    A step may be stopped only for an arrival that runs first of some of the sequences it computes
    (it pauses them for a step, or for fair share may displace one of them, anyway), never twice in a
    row, so every sequence makes progress whatever arrives (the step after a stopped one always runs to
    its end), and only while the stopped steps have thrown away at most ``MAX_THROWN_AWAY_SHARE`` of
    the step time."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        # While a stoppable step runs: whether an arrival (priority, tenant, weight) stops it.
        self._stops_for: Callable[[int, str, float], bool] | None = None
        self._stopped_last = False

    def arm(self, stops_for: Callable[[int, str, float], bool], thrown_away_s: float, step_time_s: float) -> None:
        """The engine, as a step starts: ``stops_for`` judges an arrival against the step's batch;
        ``thrown_away_s`` is the forward time of the steps stopped so far, ``step_time_s`` the time
        of all steps so far."""
        self._requested.clear()
        within_budget = thrown_away_s <= MAX_THROWN_AWAY_SHARE * step_time_s
        self._stops_for = stops_for if within_budget and not self._stopped_last else None
        self._stopped_last = False

    def disarm(self) -> None:
        self._stops_for = None

    def arrival(self, priority: int, tenant: str = "", weight: float = 1.0) -> bool:
        """A request of ``priority`` (of ``tenant``, with its ``weight``) is on its way to the engine (any
        thread): True if it stops the step."""
        stops_for = self._stops_for
        if stops_for is None or not stops_for(priority, tenant, weight):
            return False
        self._requested.set()
        return True

    def stop_if_requested(self, layer: int, num_layers: int) -> None:
        """Layer ``layer`` (0-based) of ``num_layers`` starts: stops the step if an arrival asked and
        fewer layers are done than are left."""
        if self._requested.is_set() and 2 * layer < num_layers:
            self._stopped_last = True
            raise StepInterrupted
