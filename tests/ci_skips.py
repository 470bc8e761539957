"""Under ``CI=true`` a skipped test fails the run unless the skip is about hardware.

A skip whose reason starts with ``hardware:`` is about the machine (no GPU, no oneDNN bf16): allowed
anywhere, and listed at the end of the run (pytest -ra). Any other skip means something a test
needs is not installed; in CI that is a failure whose message names what to install, so CI never
goes green by skipping. Registered by tests/conftest.py; a plugin of its own (``-p tests.ci_skips``)
so tests/test_ci_skips.py can run it on a scratch suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

HARDWARE = "hardware:"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(what: str, install: str) -> str:
    """A skip reason for something not installed: what, and the command that installs it."""
    return f"{what} not installed: {install}"


def _refuse_skip_in_ci(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if reason.removeprefix("Skipped: ").startswith(HARDWARE):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true: {reason}\n"
        "Only hardware skips (reason starting with 'hardware:') are allowed in CI; install what the test "
        "needs (.ci/run installs the Debian packages, scripts/install.sh the Python ones)."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _refuse_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _refuse_skip_in_ci(outcome.get_result())
