"""Where a worker's pulls came from, for its metrics: its own offers (the API offered them here, as
this worker held their prefix), another worker's offers (a steal), or a lane (nobody held the
prefix). A steal is counted by why ``PULL`` allowed it: this worker was idle, the offer had waited
past ``affinity_steal_after_ms`` (an offer that timed out), or else its worker was gone."""

from __future__ import annotations

import time

from shared.keys import Keys, lane_priority

STEAL_REASONS = ("idle", "timed_out", "worker_gone")


class OfferStats:
    def __init__(self, keys: Keys, model: str, name: str, steal_after_ms: int) -> None:
        self.keys = keys
        self.model = model
        self.name = name
        self.steal_after_ms = steal_after_ms
        self.offers_taken = 0  # own offers pulled
        self.steals = dict.fromkeys(STEAL_REASONS, 0)

    def pulled(self, stream: str, entry_id: str, *, idle: bool) -> None:
        """One entry ``PULL`` handed this worker (``idle``: as the pull was told)."""
        priority = lane_priority(stream)
        if not stream.startswith(self.keys.offers_prefix(self.model, priority)):
            return
        if stream == self.keys.offers(self.model, priority, self.name):
            self.offers_taken += 1
        elif idle:
            self.steals["idle"] += 1
        elif time.time() * 1000 - int(entry_id.split("-", 1)[0]) >= self.steal_after_ms:
            self.steals["timed_out"] += 1  # the entry id is its enqueue time (ms) on Redis's clock
        else:
            self.steals["worker_gone"] += 1
