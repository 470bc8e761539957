"""``inflightq worker`` whose every model forward takes at least ``INFLIGHTQ_TEST_STEP_S`` seconds,
for tests that need requests still generating across something slower than the tiny model (a
Redis failover takes seconds; the tiny model makes a token in about a millisecond), and with
``INFLIGHTQ_TEST_LAYER_S`` its first layer that long more, spent just before the step's first
check for an urgent arrival (a step in progress is then long enough for an arrival to stop it). Everything
else is the real worker. Run as ``python tests/worker/slow_worker.py worker --name ...``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worker.engine.model import model_runner
from worker.engine.model.attention.metadata import AttentionMetadata

SCRIPT = Path(__file__).resolve()
_run = model_runner.ModelRunner.run  # importing this module (tests do, for SCRIPT) patches nothing
_layer_starts = AttentionMetadata.stop_if_interrupted


def _slow_run(self: Any, *args: Any, **kwargs: Any) -> Any:
    # Pacing, not synchronisation: the test waits on the tokens it counts, never on this delay.
    time.sleep(float(os.environ.get("INFLIGHTQ_TEST_STEP_S", "0.01")))
    return _run(self, *args, **kwargs)


def _slow_layer(self: AttentionMetadata, layer: int) -> None:
    if layer == 0:
        time.sleep(float(os.environ["INFLIGHTQ_TEST_LAYER_S"]))
    _layer_starts(self, layer)


if __name__ == "__main__":
    model_runner.ModelRunner.run = _slow_run  # type: ignore[method-assign]
    if os.environ.get("INFLIGHTQ_TEST_LAYER_S"):
        AttentionMetadata.stop_if_interrupted = _slow_layer  # type: ignore[method-assign]
    from inflightq_cli import app

    app()
