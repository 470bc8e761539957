"""How the I/O threads talk to the engine loop, which owns the engine and never waits on Redis.

``Inbox``: starts, cancels and "lost" notices, drained by the loop between steps. A start
counts as in transit from hand-over until the loop has added it, so the intake never promises
the same free slot twice; its priority is kept for the capacity claim (``policy.Capacity``), where
an urgent start on its way claims a victim and a background one does not.

``OwnedEntries``: the stream entries this worker is running, by request, read by the refresher
that keeps them from being taken over."""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Literal

from worker.active import ActiveRequest


@dataclass
class InboxItem:
    kind: Literal["start", "cancel", "lost"]
    request_id: str
    active: ActiveRequest | None = None


class Inbox:
    def __init__(self) -> None:
        self._items: deque[InboxItem] = deque()
        self._cond = threading.Condition()
        self._in_transit: Counter[int] = Counter()  # starts handed over, not yet dealt with, by priority

    @property
    def in_transit(self) -> tuple[int, ...]:
        """The priorities of the starts on their way, most urgent first."""
        with self._cond:
            return tuple(sorted(self._in_transit.elements()))

    def put(self, item: InboxItem) -> None:
        with self._cond:
            if item.kind == "start":
                assert item.active is not None
                self._in_transit[item.active.request.priority] += 1
            self._items.append(item)
            self._cond.notify()

    def take(self, wait_s: float = 0.0) -> list[InboxItem]:
        """Everything waiting, after up to ``wait_s`` for something to arrive."""
        with self._cond:
            if wait_s > 0 and not self._items:
                self._cond.wait(wait_s)
            items = list(self._items)
            self._items.clear()
            return items

    def started(self, priority: int) -> None:
        """The loop has dealt with one start of ``priority`` (added, refused or handed back)."""
        with self._cond:
            self._in_transit[priority] -= 1
            if self._in_transit[priority] <= 0:
                del self._in_transit[priority]

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class OwnedEntries:
    def __init__(self) -> None:
        self._where: dict[str, tuple[str, str]] = {}  # request id -> (stream, entry id)
        self._settling: set[str] = set()  # finished: only their final write and ack are still on the way
        self._lock = threading.Lock()

    def add(self, active: ActiveRequest) -> None:
        with self._lock:
            self._where[active.id] = (active.stream, active.entry_id)
            self._settling.discard(active.id)  # delivered again: running here, not only being written

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._where.pop(request_id, None)
            self._settling.discard(request_id)

    def settling(self, request_id: str) -> None:
        """The request has finished; its entry stays ours until ``discard`` (its ack has landed)."""
        with self._lock:
            if request_id in self._where:
                self._settling.add(request_id)

    def is_settling(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._settling

    def by_stream(self) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = {}
        with self._lock:
            for stream, entry_id in self._where.values():
                grouped.setdefault(stream, []).append(entry_id)
        return grouped

    def owner(self, stream: str, entry_id: str) -> str | None:
        with self._lock:
            return self._owner(stream, entry_id)

    def running_owner(self, stream: str, entry_id: str) -> str | None:
        """The request still running here on this entry; None when none, or when it has finished and
        only its final write and ack are on the way (its ack may already have landed)."""
        with self._lock:
            owner = self._owner(stream, entry_id)
            return None if owner in self._settling else owner

    def _owner(self, stream: str, entry_id: str) -> str | None:  # under the lock
        return next((rid for rid, where in self._where.items() if where == (stream, entry_id)), None)
