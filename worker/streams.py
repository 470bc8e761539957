"""A model's streams (lanes and offer streams) and their consumer group, as this worker reads them."""

from __future__ import annotations

import redis

from shared.keys import CONSUMER_GROUP, Keys
from shared.settings import Settings
from shared.work_queue import model_lanes


def priority_streams(keys: Keys, model: str, levels: int) -> list[str]:
    """Most urgent first: index = priority."""
    return [keys.stream(model, priority) for priority in range(levels)]


def model_streams(connection: redis.Redis, keys: Keys, model: str, levels: int) -> list[str]:
    """Every lane and offer stream of the model, most urgent priority first (the lanes set)."""
    return model_lanes(connection.smembers(keys.lanes(model)), keys, model, levels)


def steal_after_ms(settings: Settings) -> int:
    """How long an entry offered to another live, busy worker is left to it (``affinity_steal_after_ms``)."""
    return settings.affinity_steal_after_ms


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
