"""A real, private Redis Cluster for tests and benchmarks: masters and replicas started from the
``redis-server`` binary on free loopback ports, joined by ``redis-cli --cluster create``.

AOF is on (``appendfsync always``), so a master killed with SIGKILL loses nothing it answered;
its replica takes over. ``stop()`` kills every node it started and removes their files."""

from __future__ import annotations

import atexit
import contextlib
import random
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from inflightq_cli.redis_server import LISTEN_PORTS, find_redis_binary, port_bindable

# Node ports, and their cluster bus ports (port + 10000), are drawn below the kernel's ephemeral
# range (32768 and up on Linux), as free_port's are: a port picked from that range can be taken by
# any outgoing connection before redis-server binds it, and with hundreds of test connections that
# happened (a node that "did not start" because its bus port was a client's source port).
_BUS_OFFSET = 10000
_PORT_LOW, _PORT_HIGH = LISTEN_PORTS.start, LISTEN_PORTS.stop - _BUS_OFFSET  # bus ports stay in range too
_START_ATTEMPTS = 3


@dataclass
class ClusterNode:
    port: int
    workdir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, binary: str, node_timeout_ms: int) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--dir", str(self.workdir),
            "--daemonize", "no",
        ]  # fmt: skip
        # The log is kept: when a node fails to start, its reason is in workdir/redis.log.
        with open(self.workdir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 5) -> str:
        path = self.workdir / "redis.log"
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, socket_timeout=2)

    def kill(self) -> None:
        """SIGKILL, as a crashed machine would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
            if self.process.poll() is None:
                self.kill()


@dataclass
class PrivateRedisCluster:
    masters: int = 3
    replicas_per_master: int = 1
    node_timeout_ms: int = 2000
    binary: str = field(default_factory=find_redis_binary)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="inflightq-cluster-")))
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Any one node: the clients discover the rest."""
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> PrivateRedisCluster:
        atexit.register(self.stop)
        count = self.masters * (1 + self.replicas_per_master)
        self.nodes = [ClusterNode(port, self.workdir / str(port)) for port in _free_ports(count)]
        try:
            for index in range(count):
                self.nodes[index] = self._start_node(self.nodes[index], timeout)
            cli = shutil.which("redis-cli") or str(Path(self.binary).with_name("redis-cli"))
            subprocess.run(
                [cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                 "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout,
            )  # fmt: skip
            _wait_for(self.healthy, timeout, "the cluster did not reach cluster_state:ok")
            # A replica that has not finished its first sync refuses to take over (its data is
            # "too old"): without this, a master killed in the first seconds is never replaced.
            _wait_for(self.replicas_synced, timeout, "the replicas did not finish their first sync")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, node: ClusterNode, timeout: float) -> ClusterNode:
        """Start ``node``; if it exits at once (a port taken between the check and the bind),
        start it again on other free ports, a few times, before giving up with its log."""
        for _attempt in range(_START_ATTEMPTS):
            node.start(self.binary, self.node_timeout_ms)
            _wait_for(
                lambda n=node: _answers(n) or n.process.poll() is not None,  # type: ignore[union-attr]
                timeout,
                f"node {node.port} did not start",
            )
            if node.process is not None and node.process.poll() is None:
                return node
            taken = {n.port for n in self.nodes}
            port = next(p for p in _free_ports(len(taken) + 1) if p not in taken)
            node = ClusterNode(port, self.workdir / str(port))
        raise RuntimeError(f"no cluster node started after {_START_ATTEMPTS} tries: {node.log_tail()}")

    def healthy(self) -> bool:
        """Every live node says ok and agrees that all slots are served by as many masters as were made."""
        for node in self.live_nodes():
            try:
                with node.client() as client:
                    info = client.cluster("info")
                    if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) < len(self.nodes):
                        return False
            except redis.RedisError:
                return False
        return len(self.master_nodes()) == self.masters

    def replicas_synced(self) -> bool:
        """Every live replica has its link to its master up (its first full sync is done)."""
        for node in self.live_nodes():
            try:
                with node.client() as client:
                    info = client.info("replication")
            except redis.RedisError:
                return False
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def live_nodes(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def master_nodes(self) -> list[ClusterNode]:
        masters = []
        for node in self.live_nodes():
            with contextlib.suppress(redis.RedisError), node.client() as client:
                if client.info("replication").get("role") == "master":
                    masters.append(node)
        return masters

    def node_of(self, key: str) -> ClusterNode:
        """The master serving ``key``'s slot right now."""
        slot = redis.cluster.key_slot(key.encode())
        with self.master_nodes()[0].client() as client:
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise LookupError(f"no master serves slot {slot}")

    def wait_replicated(self, key: str, timeout: float = 10.0) -> None:
        """Until every replica of ``key``'s master has what that master has written so far. Replication
        is asynchronous: a write acknowledged in a master's last milliseconds can die with it, so a
        test that kills a master after a write must wait for this first."""
        master = self.node_of(key)
        with master.client() as client:
            target = int(client.info("replication")["master_repl_offset"])

        def caught_up() -> bool:
            with master.client() as client:
                info = client.info("replication")
            replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            return bool(replicas) and all(int(r.get("offset", -1)) >= target for r in replicas)

        _wait_for(caught_up, timeout, f"the replicas of {master.url} did not catch up")

    def wait_failover(self, timeout: float = 30.0) -> None:
        """After a master died: until its replica is promoted and every slot is served again."""
        _wait_for(self.healthy, timeout, "no replica took over the dead master's slots")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _answers(node: ClusterNode) -> bool:
    try:
        with node.client() as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def _free_ports(count: int) -> list[int]:
    """Distinct ports, outside the ephemeral range, that are free and whose cluster bus port
    (port + 10000) is free too."""
    ports: list[int] = []
    candidates = list(range(_PORT_LOW, _PORT_HIGH))
    random.shuffle(candidates)  # two clusters started at once rarely draw the same ports
    for port in candidates:
        if port_bindable(port) and port_bindable(port + _BUS_OFFSET):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"fewer than {count} free port pairs in {_PORT_LOW}-{_PORT_HIGH}")


def _wait_for(check: object, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise RuntimeError(message)
