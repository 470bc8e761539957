"""``inflightq bench streams`` end to end at a tiny N: a real API process (no worker), real Redis and a
private Redis Cluster, 20 queued jobs' streams held open. Checks that the report's figures agree
with each other and with what was asked, and that one pub/sub connection per node carries every
stream; no assertion on memory or CPU figures beyond their being measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.settings import get_settings

N = 20


def test_bench_streams_measures_a_real_api_on_redis_and_a_cluster(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.streams import main

    monkeypatch.setenv("INFLIGHTQ_REDIS_URL", redis_url)
    get_settings.cache_clear()
    argv = ["--counts", str(N), "--settle-s", "0", "--idle-s", "1", "--model", str(tiny_model_dir),
            "--out", str(tmp_path), "--tag", "test"]  # fmt: skip
    try:
        report = main(argv)
    finally:
        get_settings.cache_clear()

    assert report["command"] == "inflightq bench streams " + " ".join(argv)
    assert set(report["runs"]) == {"standalone", "cluster"}
    for name, nodes in (("standalone", 1), ("cluster", 3)):
        (row,) = report["runs"][name]
        side = row["redis_side"]
        assert row["streams"] == row["streams_open_after_idle"] == N
        # Every stream is subscribed, on one pub/sub connection per node: not one per stream.
        assert side["channels"] == N
        assert side["pubsub_connections"] <= nodes
        # What the API's sockets say and what Redis says of them agree.
        assert side["connections"] == row["redis_connections"]
        assert row["redis_connections_per_stream"] == pytest.approx(row["redis_connections"] / N, abs=1e-4)
        assert row["rss_mib"] > 0 and row["idle_window_s"] >= 1
        assert row["idle_cpu_s_per_s"] >= 0 and row["open_cpu_s"] > 0

    stem = tmp_path / f"streams-{report['date'][:10]}-test"
    assert json.loads(stem.with_suffix(".json").read_text())["runs"]["cluster"][0]["streams"] == N
    assert stem.with_suffix(".png").stat().st_size > 0
    assert report["command"] in stem.with_suffix(".md").read_text()
