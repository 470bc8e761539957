"""Which other workers are dead, judged by their heartbeats.

Every worker beats every ``beat_interval`` (``heartbeat.py``): its score in ``keys.workers()``
moves. A consumer of the group whose score has not moved for ``dead_after_s`` of this worker's own
unbroken watch is dead (SIGKILL, an OOM kill, a lost host), and ``Recovery`` takes its entries over
at once instead of after ``reclaim_after_s`` of idleness. Only a score seen standing still counts,
never a score compared with this host's clock: hosts' clocks disagree, and after a Redis outage
every worker's score is old until it beats again. A worker that has not beaten yet (no score) is
dead only once it stays without one for as long. A gap in the watch (this worker's own recovery
thread starved, or a failed turn) starts every watch over."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared.settings import Settings
from worker.heartbeat import beat_interval

# Missed beats, at least, before a worker counts as dead (a loaded box delays a beat by a second).
MISSED_BEATS = 3


def dead_after_s(settings: Settings) -> float:
    return max(settings.heartbeat_stale_s, MISSED_BEATS * beat_interval(settings))


@dataclass(frozen=True)
class _Seen:
    score: float | None  # the worker's last heartbeat score as read (None: it has none)
    since: float  # this worker's time.monotonic() when that score was first read


class HeartbeatWatch:
    def __init__(self, dead_after: float, max_gap: float) -> None:
        self.dead_after = dead_after
        self.max_gap = max_gap
        self._seen: dict[str, _Seen] = {}
        self._last_look: float | None = None

    def look(self, now: float, names: Iterable[str], beats: Mapping[str, float]) -> list[str]:
        """The ``names`` whose score in ``beats`` (name -> score) stood still for ``dead_after``,
        watched without a gap longer than ``max_gap``; names not asked about are forgotten."""
        if self._last_look is None or now - self._last_look > self.max_gap:
            self._seen.clear()
        self._last_look = now
        seen: dict[str, _Seen] = {}
        for name in names:
            score = beats.get(name)
            before = self._seen.get(name)
            seen[name] = before if before is not None and before.score == score else _Seen(score, now)
        self._seen = seen
        return [name for name, watched in seen.items() if now - watched.since >= self.dead_after]

    def forget(self) -> None:
        """After a failed look: nothing seen before it counts."""
        self._last_look = None
