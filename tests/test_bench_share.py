"""bench.share alternates the offline engine and the stack on fresh bursts and reports each round's ratio."""

from __future__ import annotations

import gc
import json
import statistics
from pathlib import Path

import pytest

from shared.settings import get_settings


def test_share_alternates_the_two_on_fresh_bursts(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import share

    monkeypatch.setenv("INFLIGHTQ_REDIS_URL", redis_url)
    get_settings.cache_clear()
    try:
        report = share.main(
            [
                "--model", str(tiny_model_dir), "--dtype", "float32", "--num-requests", "3", "--input-len", "20",
                "--output-len", "3", "--rounds", "3", "--out", str(tmp_path), "--tag", "t",
            ]
        )  # fmt: skip
    finally:
        get_settings.cache_clear()
        gc.unfreeze()  # the benchmark froze this process's objects, as it does its own
    rounds = report["rounds"]
    assert [r["order"] for r in rounds] == [["offline", "stack"], ["stack", "offline"], ["offline", "stack"]]
    for r in rounds:
        assert r["tok_s"]["offline"] > 0 and r["tok_s"]["stack"] > 0
        assert r["share"] == pytest.approx(r["tok_s"]["stack"] / r["tok_s"]["offline"], abs=0.001)
    assert report["share_median"] == pytest.approx(statistics.median(r["share"] for r in rounds))
    assert report["dataset"]["requests"] == 3 and report["workers"] == 1
    saved = json.loads(next(tmp_path.glob("share-*-t.json")).read_text())
    assert saved["rounds"] == rounds
    assert "| 3 | offline then stack |" in next(tmp_path.glob("share-*-t.md")).read_text()
