"""``inflightq worker`` whose engine hangs for good on any prompt holding HANG_TOKEN, as a
deadlocked kernel would: the model runner's forward never returns. Everything else is the real
worker. Run as ``python tests/worker/hanging_worker.py worker --name ...``."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worker.engine import model_runner

HANG_TOKEN = 4242
_run = model_runner.ModelRunner.run


def _hanging_run(self: Any, seqs: list[Any], num_new_tokens: list[int], sample: list[bool]) -> Any:
    if any(HANG_TOKEN in s.token_ids[: s.num_prompt_tokens] for s in seqs):
        threading.Event().wait()  # never set
    return _run(self, seqs, num_new_tokens, sample)


model_runner.ModelRunner.run = _hanging_run  # type: ignore[method-assign]

if __name__ == "__main__":
    from inflightq_cli import app

    app()
