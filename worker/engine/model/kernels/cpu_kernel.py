"""Builds and loads the CPU kernels on first use: the paged-decode attention and KV-cache write
(``paged_decode.cpp``), the fused RMSNorm (``rms_norm.cpp``), the small-row bf16 linear
(``decode_linear.cpp``), the same on AMX tiles for a few dozen rows
(``amx_linear.cpp``), the decoder layer's elementwise steps (``decoder_layer_ops.cpp``) and
a decode step's whole layer as one op (``decode_layer.cpp``), the greedy pick
(``greedy_argmax.cpp``), the sampled rows' filters and draw (``sample_rows.cpp``) and a step's
LoRA deltas (``lora_rows.cpp``), all in this folder, one shared library.

The kernel is compiled with ``torch.utils.cpp_extension`` for this machine's CPU
(``-march=native``) into ``~/.cache/inflightq/kernels/<key>``, where the key hashes the source,
torch's version, the flags and the CPU's model and feature flags: a cache carried to another
CPU (a container image, a shared home) is rebuilt, never run with instructions the CPU lacks.
A build runs once per machine and key; later processes load the shared library. Without a C++
compiler or ninja the build fails, and the engine keeps the plain-torch attention: slower, same
results (the worker package puts the ``ninja`` wheel on PATH). ``EngineConfig.cpu_kernels`` /
``kernel_cache_dir`` (the worker's INFLIGHTQ_CPU_KERNELS / INFLIGHTQ_KERNEL_CACHE) turn it off /
move the cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = tuple(
    HERE / name
    for name in (
        "paged_decode.cpp",
        "rms_norm.cpp",
        "decode_linear.cpp",
        "amx_linear.cpp",
        "decoder_layer_ops.cpp",
        "decode_layer.cpp",
        "greedy_argmax.cpp",
        "sample_rows.cpp",
        "lora_rows.cpp",
    )
)
# Part of the build key: a change rebuilds.
HEADERS = (HERE / "rounding.h", HERE / "simd_sums.h", HERE / "linear_call.h")
# No contraction of a * b + c into one fused multiply-add: the kernels keep torch's roundings.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
DEFAULT_CACHE = Path("~/.cache/inflightq/kernels")
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
    parts = [
        *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
        torch.__version__.encode(),
        " ".join(CFLAGS).encode(),
    ]
    for part in [*parts, _cpu_identity().encode()]:
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def paged_decode_available(cache_dir: str | None = None) -> bool:
    """Builds (once per machine, under ``cache_dir``) and loads the kernel; False, with one warning, if it can't."""
    if hasattr(torch.ops, "inflightq") and hasattr(torch.ops.inflightq, "paged_decode"):
        return True
    try:
        key = build_key()
        name = f"inflightq_paged_decode_{key}"
        root = Path(cache_dir or DEFAULT_CACHE).expanduser()
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

    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    # A build takes well under STALE_LOCK_S; an older lock is a dead builder's.
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    log.info("building the CPU kernels into %s (once per machine)", build_dir)
    cpp_extension.load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
