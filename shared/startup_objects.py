"""Takes what a process built at startup out of the garbage collector's walks (``gc.freeze``).

Loaded, the API and a worker each hold hundreds of thousands of tracked Python objects (FastAPI and
pydantic models, tokenizers, transformers, torch). CPython's full (generation 2) collection walks
every one of them, and it runs whenever enough new objects have survived: while it runs, the API's
event loop forwards no token to any stream, on a core the engine's threads want (docs/benchmarks.md
has what a collection costs). Frozen, those objects sit in a permanent generation that collections
skip; what the process allocates while serving is collected as usual. Call it once the process has
loaded everything it keeps."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collects what startup left as garbage, then freezes the rest; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
