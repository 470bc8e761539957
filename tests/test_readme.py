"""Every example in README.md, run as typed against the stack the Quick start starts, with the default model.

The quick start (``bash scripts/quickstart.sh``, without its install step: scripts/test.sh installed
everything just before) must print its ready line; then every other fenced ``bash`` or ``python`` block
runs in README order, with ``localhost:8000`` pointed at this stack's port. A generation example must
exit 0 and answer sensibly: every one asks for the capital of France (or continues "The capital of
France is"), so its output must name Paris. Blocks that need the stack stopped (``inflightq purge``)
run after Ctrl-C, last. A new example with no rule here fails this test until it gets one. Each
block runs exactly as printed: nothing is defined for it beforehand.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
import redis

from inflightq_cli.redis_server import free_port
from shared.keys import Keys

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# What each non-generation example must print (a substring of its block -> a substring of its output).
EXPECTED = {
    "inflightq status": "1 live worker(s)",
    "inflightq purge": "deleted",
    # The speculation examples ask the model to copy a sentence.
    "speculate": "quick brown fox",
    # The LoRA examples run the pirate adapter: Paris, in its style.
    "pirate": "Paris, arr",
}


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block with a language; the unlabelled one is the diagram."""
    return [(lang, code) for lang, code in FENCE.findall(README.read_text()) if lang]


def test_readme_blocks_are_found() -> None:
    langs = [lang for lang, _ in readme_blocks()]
    assert langs.count("bash") >= 4 and langs.count("python") >= 2, langs


def test_ci_runs_the_test_command_the_readme_gives() -> None:
    """`bash scripts/test.sh` is the one README command this test cannot run (it is this test's own run)."""
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_the_fast_tier_the_readme_gives_leaves_out_the_quick_start_run() -> None:
    """The README's fast tier passes ``-m "not slow"`` through scripts/test.sh to pytest; ``slow`` is a
    registered marker, and this module's quick start run (minutes) carries it."""
    assert 'bash scripts/test.sh -m "not slow"' in README.read_text()
    assert 'python -m pytest "$@"' in (REPO / "scripts" / "test.sh").read_text()
    pytest_options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(marker.startswith("slow:") for marker in pytest_options["markers"]), pytest_options
    marks = [mark.name for mark in test_every_readme_example_works_as_typed.pytestmark]
    assert "slow" in marks, marks


class Stack:
    """``bash scripts/quickstart.sh`` in its own process group, its output collected line by line."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            ["bash", "scripts/quickstart.sh"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} from the quick start:\n{self.output[-5000:]}")
            time.sleep(0.2)

    def interrupt(self) -> int:
        """Ctrl-C, as the README says."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(timeout=10)


def run_block(lang: str, code: str, env: dict[str, str], port: int) -> subprocess.CompletedProcess[str]:
    code = code.replace("localhost:8000", f"127.0.0.1:{port}")
    if lang == "bash":
        args = ["bash", "-euo", "pipefail", "-c", code]
    elif lang == "python":
        args = [sys.executable, "-c", code]  # as printed: nothing defined for it beforehand
    else:
        raise AssertionError(f"a README block in {lang!r}: teach tests/test_readme.py to run it")
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def expected_output(code: str) -> str:
    rules = [out for needle, out in EXPECTED.items() if needle in code]
    return rules[0] if rules else "Paris"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_readme_example_works_as_typed(redis_url: str, run_prefix: str, default_model_name: str) -> None:
    prefix = f"{run_prefix}-readme"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHTQ_")}
    env |= {
        "INFLIGHTQ_SKIP_INSTALL": "1",
        # The answers the README shows are the default model's in bfloat16. "auto" picks float32 on a
        # CPU without AVX512-BF16/AMX, where this 135M model answers differently (the README says so
        # and gives this setting); bf16 there runs its matmuls on exact fp32 upcasts (fast_linear).
        "INFLIGHTQ_DTYPE": "bfloat16",
        "INFLIGHTQ_REDIS_URL": redis_url,
        "INFLIGHTQ_KEY_PREFIX": prefix,
        "INFLIGHTQ_API_PORT": str(port),
        "INFLIGHTQ_METRICS_PORT": str(free_port()),
        "INFLIGHTQ_DRAIN_TIMEOUT_S": "5",
        "PYTHONPATH": str(REPO),
    }
    env.pop("RQ_KEY_PREFIX", None)  # the deployment's own: {prefix}:rq, as a user's stack has it
    # Another deployment's keys in the same Redis: the README's purge must leave them alone.
    other = redis.Redis.from_url(redis_url, decode_responses=True)
    neighbour = Keys.for_prefix(f"{run_prefix}-neighbour")
    other.set(neighbour.request("r1"), "x")
    other.set(neighbour.rq() + ":job:j1", "x")

    blocks = readme_blocks()
    assert "bash scripts/quickstart.sh" in blocks[0][1], "the README starts with the quick start"
    stack = Stack(env)
    failures: list[str] = []
    try:
        stack.wait_for("inflightq: ready", timeout=420)
        ready = stack.output[stack.output.index("inflightq: ready") :]
        assert f"http://127.0.0.1:{port}" in ready, ready
        assert f"external, at {redis_url}" in ready and "{" + prefix + "}" in ready, ready
        assert "Prometheus metrics on :" in ready and "status" in ready and "Ctrl-C" in ready, ready
        later = []
        for lang, code in blocks[1:]:
            if "inflightq purge" in code:
                later.append((lang, code))
                continue
            done = run_block(lang, code, env, port)
            want = expected_output(code)
            if done.returncode != 0 or want not in done.stdout:
                failures.append(
                    f"--- {lang} block:\n{code}\n--- exit {done.returncode}, wanted {want!r}; got:\n"
                    f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
                )
    finally:
        code = stack.interrupt()
    assert "cleaning registries" not in stack.output, "RQ's maintenance is debug noise"
    assert code == 0, stack.output[-3000:]
    for lang, code_ in later:
        done = run_block(lang, code_, env, port)
        if done.returncode != 0 or expected_output(code_) not in done.stdout:
            failures.append(f"--- {lang} block:\n{code_}\n--- exit {done.returncode}:\n{done.stdout}\n{done.stderr}")
    assert not failures, "\n".join(failures)
    left = list(other.scan_iter(match=Keys.for_prefix(prefix).pattern()))
    assert left == [], f"purge left {left[:10]}"
    assert other.get(neighbour.request("r1")) == "x" and other.get(neighbour.rq() + ":job:j1") == "x"
    other.close()
