"""Pulling work: a model's priority streams, read in strict priority order, only what fits.

For each priority from 0 (most urgent) down, the intake peeks at the entries no worker has
taken yet, keeps the prefix whose prompts the engine can start now (sequence slots and KV
blocks), and reads exactly that many with XREADGROUP. A less urgent stream is only read once
every more urgent one is drained; what does not fit stays in Redis for any other worker.
(A blocking read over several streams would not give strict priority, hence the peeks.)
With room but nothing to read, it blocks on the model's notify list, never busy-polling."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Literal

import redis

from shared.keys import CONSUMER_GROUP, Keys
from shared.settings import Settings
from worker.admission import Admission
from worker.reconnect import TRANSIENT, Backoff

if TYPE_CHECKING:
    from worker.service import WorkerService

log = logging.getLogger("inflightq.worker")

# How long an idle worker blocks on the notify list before looking at the streams again anyway
# (a wake-up can be lost to a Redis restart, or taken by a busier worker).
IDLE_BLOCK_S = 1.0

Outcome = Literal["took", "empty", "blocked"]


def ensure_groups(connection: redis.Redis, keys: Keys, model: str, levels: int) -> None:
    """Consumer group on every priority stream, from the start, so nothing queued is skipped
    (also after a Redis restart without persistence wiped the streams)."""
    for priority in range(levels):
        try:
            connection.xgroup_create(keys.stream(model, priority), CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise


class Intake(threading.Thread):
    def __init__(
        self, settings: Settings, connection: redis.Redis, admission: Admission, service: WorkerService
    ) -> None:
        super().__init__(name="intake", daemon=True)
        self.settings = settings
        self.keys = Keys.for_prefix(settings.key_prefix)
        self.redis = connection
        self.admission = admission
        self.service = service
        self.model = service.model
        self.streams = [self.keys.stream(self.model, p) for p in range(settings.priority_levels)]

    def run(self) -> None:
        backoff = Backoff(self.service.stopping)
        while not self.service.stopping.is_set() and not self.service.draining.is_set():
            try:
                self.service.capacity_changed.clear()
                room = self.service.room()
                if room <= 0:
                    self.service.capacity_changed.wait(IDLE_BLOCK_S)
                    continue
                outcome = self.read_once(room)
                backoff.succeeded()
                if outcome == "empty":
                    self.redis.blpop([self.keys.notify(self.model)], timeout=IDLE_BLOCK_S)
                elif outcome == "blocked":
                    self.service.capacity_changed.wait(IDLE_BLOCK_S)
            except TRANSIENT as error:
                backoff.failed("intake", error)
            except redis.ResponseError as error:
                if "NOGROUP" in str(error):
                    ensure_groups(self.redis, self.keys, self.model, self.settings.priority_levels)
                else:
                    backoff.crashed("intake")
            except Exception:
                backoff.crashed("intake")

    def read_once(self, room: int) -> Outcome:
        """One pass over the priorities; reads at most ``room`` entries."""
        took = False
        for stream, start in zip(self.streams, self._first_undelivered(), strict=True):
            waiting = self.redis.xrange(stream, min=start, max="+", count=room)
            if not waiting:
                continue
            fit = self._how_many_fit(waiting)
            if fit:
                replies = self.redis.xreadgroup(CONSUMER_GROUP, self.service.name, {stream: ">"}, count=fit)
                for _, entries in replies or []:
                    for entry_id, fields in entries:
                        took = self.admission.admit(stream, entry_id, fields) or took
                room -= fit
            if fit < len(waiting) or room <= 0:
                # Strict priority: less urgent streams wait while this one still has work.
                return "took" if fit else "blocked"
        return "took" if took else "empty"

    def _first_undelivered(self) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xinfo_groups(stream)
        starts = []
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                ensure_groups(self.redis, self.keys, self.model, self.settings.priority_levels)
                return ["-"] * len(self.streams)
            group = next((g for g in reply if g.get("name") == CONSUMER_GROUP), None)
            if group is None:
                ensure_groups(self.redis, self.keys, self.model, self.settings.priority_levels)
                return ["-"] * len(self.streams)
            starts.append("(" + str(group["last-delivered-id"]))
        return starts

    def _how_many_fit(self, waiting: list[tuple[str, dict[str, str]]]) -> int:
        fit = 0
        tokens = 0
        for _, fields in waiting:
            need = tokens + self.admission.prompt_length(fields)
            # An idle engine takes the first entry whatever its size: it either runs or is rejected
            # (and dead-lettered), so one huge request can never wedge the queue.
            if not self.service.can_admit(need) and not (fit == 0 and self.service.is_idle()):
                break
            # Each prompt may waste up to a block in its last one.
            tokens = need + self.settings.block_size
            fit += 1
        return fit
