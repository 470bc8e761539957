"""``inflightq worker`` that writes one JSON line per engine step with work to the file named by
``INFLIGHTQ_TEST_STEP_LOG``: the request ids in the step's batch, the ids the engine holds (running
or waiting), and its free and total KV blocks once the step's blocks are allocated. A test then
counts in steps what the engine did (how long a cancelled request kept generating, when the next
one started). With ``INFLIGHTQ_TEST_STEP_S`` every forward takes at least that long (slow_worker's
pacing), so a long request is still running when the test acts on it. Everything else is the real
worker. Run as ``python tests/worker/step_log_worker.py worker --name ...``."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worker.engine.core import scheduler

SCRIPT = Path(__file__).resolve()
_schedule = scheduler.Scheduler.schedule  # importing this module (tests do, for SCRIPT) patches nothing


@dataclass(frozen=True)
class Step:
    batch: list[str]
    held: list[str]
    free_blocks: int
    total_blocks: int
    blocks: dict[str, int]  # KV blocks of each request in the batch


def read_steps(path: Path) -> list[Step]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [Step(**json.loads(line)) for line in lines if line.endswith("}")]  # a line being written waits


def _logged_schedule(self: scheduler.Scheduler) -> Any:
    batch = _schedule(self)
    if batch.seqs:
        step = Step(
            batch=[s.request_id for s in batch.seqs],
            held=[s.request_id for s in (*self.running, *self.waiting)],
            free_blocks=self.blocks.num_free_blocks,
            total_blocks=self.blocks.num_blocks,
            blocks={s.request_id: len(s.block_table) for s in batch.seqs},
        )
        with open(os.environ["INFLIGHTQ_TEST_STEP_LOG"], "a") as log:
            log.write(json.dumps(asdict(step)) + "\n")
    return batch


if __name__ == "__main__":
    scheduler.Scheduler.schedule = _logged_schedule  # type: ignore[method-assign]
    if os.environ.get("INFLIGHTQ_TEST_STEP_S"):
        from tests.worker import slow_worker

        slow_worker.model_runner.ModelRunner.run = slow_worker._slow_run  # type: ignore[method-assign]
    from inflightq_cli import app

    app()
