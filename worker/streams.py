"""A model's priority streams and their consumer group, as this worker reads them."""

from __future__ import annotations

import redis

from shared.keys import CONSUMER_GROUP, Keys


def priority_streams(keys: Keys, model: str, levels: int) -> list[str]:
    """Most urgent first: index = priority."""
    return [keys.stream(model, priority) for priority in range(levels)]


def ensure_groups(connection: redis.Redis, streams: list[str]) -> None:
    """Consumer group on every priority stream, from the start, so nothing queued is skipped
    (also after a Redis restart without persistence wiped the streams)."""
    for stream in streams:
        try:
            connection.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise


def is_missing_group(error: redis.ResponseError) -> bool:
    return "NOGROUP" in str(error)
