"""Schemathesis against the API's own ``/openapi.json``: property-based requests to every
operation, generated from the schema (valid and invalid bodies, parameters and headers), must
never get a 5xx, and afterwards the stack still serves (no process crashed, nothing wedged).

Run with the real CLI (``st run``) as an operator would, against a real API server and worker.
``INFLIGHTQ_FAULTS_HEAVY=1`` gives every operation more examples."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.faults.conftest import scale
from tests.worker.test_worker import wait_for


def test_schemathesis_finds_no_server_error_and_the_stack_still_serves(
    spawn_worker, settings: Settings, start_api: Callable[[Settings], ApiServer], tmp_path: Path
) -> None:
    # Bounded generations: fuzzed bodies ask for up to the API's max_new_tokens each.
    api = start_api(settings.model_copy(update={"no_worker_wait_s": 60, "max_new_tokens": 32}))
    spawn_worker("fuzzed")
    with api.client() as http:
        wait_for(lambda: http.get("/health").json()["workers"].get(settings.model, 0) >= 1, timeout=120)
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    junit = tmp_path / "schemathesis.xml"
    command = [
        st,
        "run",
        f"{api.url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(scale(2, 50)),
        "--phases",
        "examples,fuzzing",
        "--seed",
        "17",
        "--workers",
        "1",
        "--request-timeout",
        "60",
        "--max-time",
        str(scale(300, 1200)),  # within the suite's per-test timeout (900 s; run heavy with --timeout 1800)
        "--report",
        "junit",
        "--report-junit-path",
        str(junit),
        "--no-color",
    ]
    # In the test's own directory: schemathesis keeps a cache (.schemathesis/) where it runs.
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, timeout=scale(600, 1500), cwd=tmp_path)
    # Said in the report: a run that took its whole --max-time may have left examples ungenerated.
    took = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    suite = ET.parse(junit).getroot()
    cases = list(suite.iter("testcase"))
    skipped = [case.get("name") for case in cases if case.find("skipped") is not None]
    operations = len(cases) - len(skipped)
    # Every route of the schema was exercised (28 today), none left out by the time budget.
    assert operations >= 25 and not skipped, (skipped, run.stdout[-4000:])

    # The stack still serves: the worker and the API survived the fuzzing, nothing is wedged.
    with api.client() as http:
        ok = http.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, timeout=120)
        assert ok.status_code == 200, ok.text
        assert http.get("/health").json()["workers"][settings.model] == 1
    lines = run.stdout.splitlines()
    generated = next((lines[i + 1].strip() for i, line in enumerate(lines[:-1]) if "Test cases:" in line), "")
    print(f"FAULTS schemathesis: {operations} operations, no 5xx; test cases: {generated}; st ran {took:.0f} s")
