"""The README's commands, run: its curl examples against a real API and worker (tiny model), and its
settings table against what ``inflightq settings`` prints. A README that drifts from the code fails
here instead of on a reader's first try."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.conftest import ApiServer

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def curl_examples() -> list[tuple[str, str, dict]]:
    """(method, path, JSON body) of every ``curl ... localhost:8000/...`` in the README."""
    found = []
    for command in re.findall(r"^curl (?:[^\n]*\\\n)*[^\n]*", README, flags=re.M):  # with its continued lines
        args = shlex.split(command.replace("\\\n", " "))
        (url,) = [a for a in args if "localhost:8000" in a]
        body = json.loads(args[args.index("-d") + 1]) if "-d" in args else {}
        found.append(("POST" if body else "GET", url.split("localhost:8000", 1)[1], body))
    return found


def test_the_readme_has_curl_examples() -> None:
    assert curl_examples(), "the quick start shows how to send a first request"


@pytest.mark.timeout(300)
def test_every_curl_example_of_the_readme_works(live_api: ApiServer) -> None:
    with live_api.client() as http:
        for method, path, body in curl_examples():
            with http.stream(method, path, json=body or None) as response:
                assert response.status_code == 200, (path, response.read())
                lines = list(response.iter_lines())
            if path.endswith("_stream") or "stream" in json.dumps(body):
                events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
                assert events and events[-1]["details"]["finish_reason"] in ("length", "eos_token"), events[-1:]


def settings_rows(text: str) -> dict[str, str]:
    """Variable -> default of a markdown settings table."""
    return dict(re.findall(r"^\| `(INFLIGHTQ_[A-Z0-9_]+)` \| `([^`]*)` \|", text, flags=re.M))


def test_the_readme_settings_table_is_what_inflightq_settings_prints() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHTQ_")}  # defaults, not this machine's
    printed = subprocess.run(
        [sys.executable, "-m", "inflightq_cli", "settings"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert printed.returncode == 0, printed.stderr
    shown, documented = settings_rows(printed.stdout), settings_rows(README)
    assert len(shown) > 20, printed.stdout[:500]
    assert documented == shown, {
        "only in the README": sorted(set(documented) - set(shown)),
        "missing from the README": sorted(set(shown) - set(documented)),
        "defaults differ": {
            k: (documented[k], shown[k]) for k in set(shown) & set(documented) if documented[k] != shown[k]
        },
    }
