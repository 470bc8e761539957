"""The worker process: Redis -> engine -> Redis."""

import os
import shutil


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


_put_ninja_on_path()
