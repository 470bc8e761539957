"""The private cluster the tests and benchmarks start must not fail on a port some other socket
took: CI once lost a run to "node 40969 did not start" (a port drawn from the ephemeral range,
whose bus port a client connection could hold)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflightq_cli import redis_cluster
from inflightq_cli.redis_cluster import PrivateRedisCluster

pytestmark = pytest.mark.slow


def _listen_on(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_ports_are_outside_the_ephemeral_range_and_skip_a_held_bus_port() -> None:
    first = redis_cluster._free_ports(1)[0]
    with _listen_on(first + 10000):
        ports = redis_cluster._free_ports(200)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert first not in ports
    assert len(set(ports)) == 200
    assert all(port + 10000 < low for port in ports)


@pytest.fixture
def held_port() -> Iterator[int]:
    port = redis_cluster._free_ports(1)[0]
    with _listen_on(port):
        yield port


def test_a_node_whose_port_was_taken_starts_again_elsewhere(held_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    real = redis_cluster._free_ports
    calls: list[int] = []

    def first_draw_is_taken(count: int) -> list[int]:
        # The race CI hit, made certain: the first port handed out is held by another socket.
        calls.append(count)
        return [held_port, *real(count - 1)] if len(calls) == 1 else real(count)

    monkeypatch.setattr(redis_cluster, "_free_ports", first_draw_is_taken)
    cluster = PrivateRedisCluster(masters=3, replicas_per_master=0)
    try:
        cluster.start()
        assert len(calls) == 2  # the first draw, then one more port for the node that failed
        assert held_port not in [n.port for n in cluster.nodes]
        assert "Address already in use" in (cluster.workdir / str(held_port) / "redis.log").read_text()
        assert cluster.healthy()
    finally:
        cluster.stop()


def test_free_ports_for_single_servers_are_outside_the_ephemeral_range_too() -> None:
    from inflightq_cli.redis_server import free_port, port_bindable

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(port < low and port_bindable(port) for port in ports)
    with _listen_on(next(iter(ports))) as held:
        assert not port_bindable(held.getsockname()[1])
