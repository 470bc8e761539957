"""The worker process: Redis -> engine -> Redis."""

import os
import shutil

from shared.model_source import resolve
from worker.engine.model import model_loader


def _locate(name: str) -> tuple[str, str | None]:
    source = resolve(name)
    return source.file, str(source.converted_dir) if source.gguf_file else None


def _put_ninja_on_path() -> None:
    # torch builds the engine's CPU kernel by running `ninja` from PATH; the `ninja` wheel puts it in the venv's
    # bin/, which is not on PATH when the venv's python is run without activating it.
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


# The engine reads no environment and may not import shared, where the one table of model names lives:
# this package, which both the worker and the offline LLM import first, sets those up for it.
model_loader.resolve_name = _locate
_put_ninja_on_path()
