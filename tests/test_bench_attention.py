"""bench.attention times paged_decode over a model's layers against a read of the same K/V bytes,
after checking the kernel against float64 attention."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import attention
from tests.ci_skips import missing


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_attention_reports_both_tables_against_the_read(tmp_path: Path, dtype: str) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (paged_decode is what it times)", "apt-get install g++"))
    args = ["--cases", "1x40,3x17", "--layers", "2", "--rounds", "2", "--dtype", dtype]
    report = attention.main([*args, "--out", str(tmp_path), "--tag", "t"])
    assert [(row["batch"], row["context"]) for row in report["cases"]] == [(1, 40), (3, 17)]
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-5
    for row in report["cases"]:
        assert set(row["ms"]) == {*attention.TABLES, attention.FLOOR} and all(v > 0 for v in row["ms"].values())
        assert all(0 <= error < tolerance for error in row["max_error"].values())
    # 2 layers x (K and V) x 3 x 17 tokens x 3 heads x 64 values
    assert report["cases"][1]["kv_mb"] == round(2 * 2 * 3 * 17 * 3 * 64 * (2 if dtype == "bfloat16" else 4) / 1e6, 1)
    saved = json.loads(next(tmp_path.glob("attention-*-t.json")).read_text())
    assert saved["cases"] == report["cases"]
    assert "| 3 x 17 |" in next(tmp_path.glob("attention-*-t.md")).read_text()


def test_the_check_catches_a_kernel_that_attends_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    # The error column is what makes a fast figure trustworthy: a kernel returning something else
    # (here: the float64 answer's neighbour, every output doubled) must show a large error.
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler", "apt-get install g++"))
    import torch

    from worker.engine.model.kernels.cpu_kernel import paged_decode_available

    assert paged_decode_available()
    real = torch.ops.inflightq.paged_decode

    class Doubling:
        def __call__(self, *args: object) -> None:
            real(*args)
            args[-1].mul_(2)  # type: ignore[attr-defined]

    monkeypatch.setattr(torch.ops.inflightq, "paged_decode", Doubling())
    report = attention.main(["--cases", "2x20", "--layers", "1", "--rounds", "1", "--dtype", "float32", "--out", ""])
    assert all(error > 0.01 for error in report["cases"][0]["max_error"].values())
