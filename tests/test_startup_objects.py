"""freeze_startup_objects: startup's garbage is collected first, what is alive leaves the collector's walks."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from fastapi.testclient import TestClient

from producer_api.app import create_app
from shared.settings import Settings
from shared.startup_objects import freeze_startup_objects


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_garbage_is_collected_and_the_living_are_frozen() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    kept = Node()
    try:
        frozen = freeze_startup_objects()
        assert dead() is None  # collected before the freeze, not frozen forever
        assert frozen > 0 and gc.get_freeze_count() > 0  # (frozen objects can still die of refcount)
        assert not any(o is kept for o in gc.get_objects())  # out of every generation's walk
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


def test_the_api_freezes_its_startup_objects_when_asked(redis_url: str, key_prefix: str, tiny_model_dir: Path) -> None:
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, model=str(tiny_model_dir))
    gc.unfreeze()  # whatever an earlier test froze: only a freeze puts objects there
    try:
        with TestClient(create_app(settings)) as client:
            assert client.get("/health").status_code == 200
            assert gc.get_freeze_count() == 0  # an app inside another process leaves its objects alone
        with TestClient(create_app(settings, freeze_startup=True)) as client:
            assert client.get("/health").status_code == 200
            assert gc.get_freeze_count() > 0  # as `inflightq api` builds it
    finally:
        gc.unfreeze()
