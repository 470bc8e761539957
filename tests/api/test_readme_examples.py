"""The README's commands, run: its curl examples against a real API and worker (tiny model), and the
settings tables (docs/settings.md whole, the README's selection) against what ``inflightq settings``
prints. A README that drifts from the code fails here instead of on a reader's first try."""

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
SETTINGS_DOC = (ROOT / "docs" / "settings.md").read_text()


def curl_commands() -> list[str]:
    """Every ``curl`` command of the README's bash blocks, whole: continued lines and quoted JSON over
    several lines included."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README, flags=re.S | re.M):
        pending = ""
        for line in block.splitlines():
            if not pending and not line.startswith("curl "):
                continue
            pending += line + "\n"
            try:
                shlex.split(pending.replace("\\\n", " "))
            except ValueError:  # a quote still open: the JSON goes on
                continue
            if not line.endswith("\\"):
                commands.append(pending.replace("\\\n", " "))
                pending = ""
    return commands


def curl_examples() -> list[tuple[str, str, dict]]:
    """(method, path, JSON body) of every ``curl ... localhost:8000/...`` in the README that stands alone
    (the /v1/jobs walk-through, which passes an id between commands, runs in tests/test_readme.py)."""
    found = []
    for command in curl_commands():
        args = shlex.split(command)
        (url,) = [a for a in args if "localhost:8000" in a]
        if "$" in url:
            continue
        body = json.loads(args[args.index("-d") + 1]) if "-d" in args else {}
        found.append(("POST" if body else "GET", url.split("localhost:8000", 1)[1], body))
    return found


def test_the_readme_has_curl_examples() -> None:
    paths = [path for _, path, _ in curl_examples()]
    assert "/v1/chat/completions" in paths, "the quick start shows how to send a first request"
    assert len(paths) >= 4, paths  # the first request, TGI's stream, structured output, tools


@pytest.mark.timeout(300)
def test_every_curl_example_of_the_readme_works(live_api: ApiServer) -> None:
    with live_api.client() as http:
        for method, path, body in curl_examples():
            if "model" in body:  # the README names the default model; this stack serves the tiny one
                body = {**body, "model": live_api.settings.model}
            with http.stream(method, path, json=body or None) as response:
                assert response.status_code == 200, (path, response.read())
                lines = list(response.iter_lines())
            if path.endswith("_stream") or "stream" in json.dumps(body):
                events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
                assert events and events[-1]["details"]["finish_reason"] in ("length", "eos_token"), events[-1:]


def settings_rows(text: str) -> dict[str, str]:
    """Variable -> default of a markdown settings table."""
    return dict(re.findall(r"^\| `(INFLIGHTQ_[A-Z0-9_]+)` \| `([^`]*)` \|", text, flags=re.M))


def test_the_settings_tables_are_what_inflightq_settings_prints() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHTQ_")}  # defaults, not this machine's
    printed = subprocess.run(
        [sys.executable, "-m", "inflightq_cli", "settings"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert printed.returncode == 0, printed.stderr
    shown, documented, selected = settings_rows(printed.stdout), settings_rows(SETTINGS_DOC), settings_rows(README)
    assert len(shown) > 20, printed.stdout[:500]
    assert len(selected) >= 5 and all(shown.get(k) == v for k, v in selected.items()), {
        k: (v, shown.get(k)) for k, v in selected.items() if shown.get(k) != v
    }
    assert documented == shown, {
        "only in the README": sorted(set(documented) - set(shown)),
        "missing from the README": sorted(set(shown) - set(documented)),
        "defaults differ": {
            k: (documented[k], shown[k]) for k in set(shown) & set(documented) if documented[k] != shown[k]
        },
    }
