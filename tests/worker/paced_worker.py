"""``inflightq worker`` whose engine steps are paced by the test: before every model forward, for each
request in the batch, it pops one permit from that request's gate list in Redis (``gate_key``),
waiting until the test pushes one. So a test decides when each token may be generated and can
check that token k reached its consumer while the worker still waits for step k+1: a live path
that only works through the replay-log safety net (a broken subscription, a publisher that
batches) cannot pass. Everything else is the real worker. Run as
``python tests/worker/paced_worker.py worker --name ...``; it turns the engine stall watchdog off
(``INFLIGHTQ_ENGINE_STALL_S=0``: a paced engine loop is meant to stand still)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis

from shared.keys import Keys
from shared.redis_connect import connect
from shared.settings import get_settings
from worker.engine.model import model_runner

SCRIPT = Path(__file__).resolve()
# A gate nobody opens releases the step after this long, so a broken test ends in its own
# assertion (the token that never came) instead of a wedged worker.
GATE_TIMEOUT_S = 120
_run = model_runner.ModelRunner.run  # importing this module (tests do, for gate_key) patches nothing


def gate_key(prefix: str, request_id: str) -> str:
    """The list a request's steps take their permits from (under the run's prefix: cleaned up with it)."""
    return Keys.for_prefix(prefix).prefix + ":testgate:" + request_id


def allow_steps(connection: redis.Redis | redis.RedisCluster, prefix: str, request_id: str, steps: int = 1) -> None:
    connection.rpush(gate_key(prefix, request_id), *(["1"] * steps))


@contextmanager
def trickle(
    connection: redis.Redis | redis.RedisCluster, prefix: str, request_ids: list[str], every_s: float = 0.01
) -> Iterator[None]:
    """While the block runs, one more step per request every ``every_s``: the worker keeps generating
    (say, through a drain) at a pace slow enough that it cannot finish what the test gave it."""
    done = threading.Event()

    def feed() -> None:
        while not done.wait(every_s):
            for request_id in request_ids:
                allow_steps(connection, prefix, request_id)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        yield
    finally:
        done.set()
        feeder.join()


_gates: redis.Redis | redis.RedisCluster | None = None


def _paced_run(self: Any, seqs: list[Any], *args: Any, **kwargs: Any) -> Any:
    global _gates
    if _gates is None:  # the worker's own Redis, standalone or Cluster (the gate lives in the prefix's slot)
        _gates = connect(get_settings(), decode_responses=False)
    prefix = get_settings().key_prefix
    for seq in seqs:
        # Short waits in a loop: the worker's Redis URL may set a socket timeout below GATE_TIMEOUT_S.
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while _gates.blpop([gate_key(prefix, seq.request_id)], timeout=1) is None and time.monotonic() < deadline:
            pass
    return _run(self, seqs, *args, **kwargs)


if __name__ == "__main__":
    # A paced engine loop stands still on purpose: the stall watchdog must not end it.
    os.environ["INFLIGHTQ_ENGINE_STALL_S"] = "0"
    model_runner.ModelRunner.run = _paced_run  # type: ignore[method-assign]
    from inflightq_cli import app

    app()
