"""Ends a worker whose engine loop has stopped making progress.

A hung step (a deadlocked kernel, a stuck OpenMP barrier, a wedged driver) leaves the process
alive: its I/O threads keep the heartbeat fresh and its pending entries look owned, so nothing
would ever take its requests over. The engine loop stamps ``service.loop_progress_at`` on every
turn (at least every half second when idle); when that stamp is older than
``INFLIGHTQ_ENGINE_STALL_S`` this thread logs why and exits the process at once with
``EXIT_ENGINE_STALLED``. Its requests are then reclaimed by the rest of the pool like any dead
worker's, their streams continuing where they stopped, and the supervisor (k8s, compose,
``inflightq up``) sees the exit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("inflightq.worker")

EXIT_ENGINE_STALLED = 70  # EX_SOFTWARE


class LoopOwner(Protocol):
    loop_progress_at: float  # time.monotonic() of the engine loop's last turn
    stopping: threading.Event


class EngineWatchdog(threading.Thread):
    def __init__(
        self, service: LoopOwner, stall_after_s: float, on_stall: Callable[[float], None] | None = None
    ) -> None:
        super().__init__(name="engine-watchdog", daemon=True)
        self.service = service
        self.stall_after_s = stall_after_s
        self.on_stall = on_stall or _exit_now

    def run(self) -> None:
        every = min(1.0, self.stall_after_s / 4)
        while not self.service.stopping.wait(every):
            stalled_for = time.monotonic() - self.service.loop_progress_at
            if stalled_for > self.stall_after_s:
                log.critical(
                    "engine loop made no progress for %.1f s (INFLIGHTQ_ENGINE_STALL_S=%s): exiting so the pool "
                    "takes this worker's requests over",
                    stalled_for,
                    self.stall_after_s,
                )
                self.on_stall(stalled_for)
                return


def _exit_now(_stalled_for: float) -> None:
    # Not sys.exit: the main thread is the one that is stuck, and a clean shutdown would wait on it.
    logging.shutdown()
    os._exit(EXIT_ENGINE_STALLED)
