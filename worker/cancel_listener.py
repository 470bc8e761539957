"""Listens on the cancel channel and tells the engine loop; the loop aborts at its next step."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import redis

from shared.keys import Keys
from shared.settings import Settings
from worker.reconnect import TRANSIENT, Backoff

if TYPE_CHECKING:
    from worker.service import WorkerService


class CancelListener(threading.Thread):
    def __init__(self, settings: Settings, connection: redis.Redis, service: WorkerService) -> None:
        super().__init__(name="cancel-listener", daemon=True)
        self.channel = Keys.for_prefix(settings.key_prefix).cancel_channel()
        self.redis = connection
        self.service = service

    def run(self) -> None:
        backoff = Backoff(self.service.stopping)
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            while not self.service.stopping.is_set():
                try:
                    if not pubsub.subscribed:
                        pubsub.subscribe(self.channel)
                    message = pubsub.get_message(timeout=0.5)
                    backoff.succeeded()
                except TRANSIENT as error:
                    pubsub.reset()
                    backoff.failed("cancel listener", error)
                    continue
                except Exception:
                    pubsub.reset()
                    backoff.crashed("cancel listener")
                    continue
                if message is not None and message.get("type") == "message":
                    self.service.cancel(str(message["data"]))
        finally:
            pubsub.close()
