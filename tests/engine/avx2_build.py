"""Runs a check script against a kernel built for Haswell (AVX2, no AVX-512) in a fresh process:
the code paths CPUs without AVX-512 take, tested on a box that builds for its own AVX-512."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


def run_avx2_check(check: str, source: Path, build_dir: Path) -> None:
    """``check`` (python -c source) gets the kernel's source and a build folder; it prints "ok" last."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2 " not in flags or " fma " not in flags:
        pytest.skip("hardware: the CPU cannot run a Haswell (AVX2) build")
    done = subprocess.run(
        [sys.executable, "-c", check, str(source), str(build_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
