"""Listens on the cancel channel and tells the engine loop; the loop aborts at its next step.

The cancel channel is the deployment's one broadcast channel (plain SUBSCRIBE, also on a
Cluster, where a PUBLISH reaches every node's subscribers)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis

from shared.keys import Keys
from shared.settings import Settings
from worker.reconnect import ResilientLoop


class CancelListener(ResilientLoop):
    def __init__(
        self,
        settings: Settings,
        connection: redis.Redis,
        on_cancel: Callable[[str], None],
        stopping: threading.Event,
    ) -> None:
        super().__init__("cancel listener", stopping)
        self.channel = Keys.for_prefix(settings.key_prefix).cancel_channel()
        self.on_cancel = on_cancel
        self.connection = connection
        self.pubsub = connection.pubsub(ignore_subscribe_messages=True)

    def turn(self) -> None:
        if not self.pubsub.subscribed:
            self.pubsub.subscribe(self.channel)
        message = self.pubsub.get_message(timeout=0.5)
        if message is not None and message.get("type") == "message":
            self.on_cancel(str(message["data"]))

    def after_failure(self) -> None:
        # A fresh one: on a Cluster, the node it was bound to may be the one that died.
        self.pubsub.close()
        self.pubsub = self.connection.pubsub(ignore_subscribe_messages=True)

    def close(self) -> None:
        self.pubsub.close()
