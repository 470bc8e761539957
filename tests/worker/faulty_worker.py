"""``inflightq worker`` with a faulty model forward, for the tests of what a worker does when its
engine fails: a prompt holding BREAK_TOKEN makes the step raise (as a kernel error would), one
holding HANG_TOKEN makes it never return (as a deadlocked kernel would). Everything else is the
real worker. Run as ``python tests/worker/faulty_worker.py worker --name ...``."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worker.engine.model import model_runner

SCRIPT = Path(__file__).resolve()
BREAK_TOKEN = 4241
HANG_TOKEN = 4242
_run = model_runner.ModelRunner.run  # importing this module (tests do, for the tokens) patches nothing


def _faulty_run(self: Any, seqs: list[Any], num_new_tokens: list[int], sample: list[bool], *args: Any) -> Any:
    prompts = [s.token_ids[: s.num_prompt_tokens] for s in seqs]
    if any(BREAK_TOKEN in p for p in prompts):
        raise RuntimeError("injected kernel failure")
    if any(HANG_TOKEN in p for p in prompts):
        threading.Event().wait()  # never set
    return _run(self, seqs, num_new_tokens, sample, *args)


if __name__ == "__main__":
    model_runner.ModelRunner.run = _faulty_run  # type: ignore[method-assign]
    from inflightq_cli import app

    app()
