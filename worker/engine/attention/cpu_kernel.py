"""Builds and loads the CPU paged-decode kernel (``paged_decode.cpp``) on first use.

The kernel is compiled with ``torch.utils.cpp_extension`` for this machine's CPU
(``-march=native``) into ``~/.cache/inflightq/kernels/<key>``, where the key hashes the source,
torch's version, the flags and the CPU's model and feature flags: a cache carried to another
CPU (a container image, a shared home) is rebuilt, never run with instructions the CPU lacks.
A build takes about half a minute once; later processes load the shared library in
milliseconds. Without a C++ compiler or ninja the build fails, and the engine keeps the
plain-torch attention: slower, same results.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
CACHE_ENV = "INFLIGHTQ_KERNEL_CACHE"  # where built kernels go (default ~/.cache/inflightq/kernels)
DISABLE_ENV = "INFLIGHTQ_CPU_KERNELS"  # "0" keeps the plain-torch path without trying a build
STALE_LOCK_S = 600


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
    except OSError:
        return "unknown"
    return "".join(sorted(set(lines)))


def build_key() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(CFLAGS).encode(), _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _ensure_ninja_on_path() -> None:
    # torch's builder runs `ninja` from PATH; the `ninja` wheel puts it in the venv's bin/, which
    # is not on PATH when the venv's python is run without activating it.
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def paged_decode_available() -> bool:
    """Builds (once per machine) and loads the kernel; False, with one warning, if it can't."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    if hasattr(torch.ops, "inflightq") and hasattr(torch.ops.inflightq, "paged_decode"):
        return True
    try:
        key = build_key()
        name = f"inflightq_paged_decode_{key}"
        root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "inflightq" / "kernels")
        build_dir = root / key
        library = build_dir / f"{name}.so"
        if library.exists():
            # Built before: load it directly. Going through the builder again would take its lock
            # file, and a process killed while holding it leaves every later one waiting.
            torch.ops.load_library(str(library))
        else:
            _build(name, build_dir)
    except Exception as exc:  # no compiler, no ninja, read-only home...: fall back, don't fail the engine
        log.warning("CPU paged-decode kernel unavailable (%s); using plain-torch attention", exc)
        return False
    return True


def _build(name: str, build_dir: Path) -> None:
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    # A build takes well under STALE_LOCK_S; an older lock is a dead builder's.
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    log.info("building the CPU paged-decode kernel into %s (once per machine)", build_dir)
    cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
