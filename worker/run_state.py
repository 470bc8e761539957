"""The three signals a worker's threads share: stop, drain, and "the engine's load changed"."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class RunState:
    stopping: threading.Event = field(default_factory=threading.Event)  # every thread ends
    draining: threading.Event = field(default_factory=threading.Event)  # no new work
    capacity_changed: threading.Event = field(
        default_factory=threading.Event
    )  # a slot or blocks freed, or work arrived
