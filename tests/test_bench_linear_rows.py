"""bench.linear_rows times a model's linears through both kernels and a read of the weights, per row count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench import linear_rows
from tests.ci_skips import missing
from worker.engine.model import model_runner
from worker.engine.model.fast_linear import tile_rows_for


def test_linear_rows_reports_both_kernels_against_the_read(tiny_model_dir: Path, tmp_path: Path) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (decode_linear is one of the kernels it times)", "apt-get install g++"))
    threshold = model_runner.decode_rows_for
    report = linear_rows.main(
        ["--model", str(tiny_model_dir), "--rows", "1,20", "--rounds", "2", "--out", str(tmp_path), "--tag", "t"]
    )
    assert model_runner.decode_rows_for is threshold  # the engine's threshold is put back
    assert report["linears"] == 2 * 4 + 1  # per layer q/k/v, o, gate/up, down; then the head
    assert [row["rows"] for row in report["rows"]] == [1, 20]
    # amx_linear beside them where this CPU runs it on tiles (oneDNN's column then has the tiles put aside)
    amx = (linear_rows.AMX,) if tile_rows_for(torch.bfloat16) else ()
    kernels = (*linear_rows.KERNELS_BY_DTYPE["bfloat16"], *amx)
    assert tuple(report["kernels"]) == kernels
    for row in report["rows"]:
        assert set(row["ms"]) == {*kernels, linear_rows.FLOOR} and all(v > 0 for v in row["ms"].values())
        assert set(row["over_weights_read"]) == set(kernels)
    saved = json.loads(next(tmp_path.glob("linear-rows-*-t.json")).read_text())
    assert saved["rows"] == report["rows"]
    assert "| 20 |" in next(tmp_path.glob("linear-rows-*-t.md")).read_text()


@pytest.mark.skipif(not hasattr(__import__("torch").ops.mkl, "_mkl_linear"), reason="this torch has no MKL")
def test_linear_rows_in_fp32_compares_the_onednn_and_mkl_packings(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_model_dir), "--dtype", "float32", "--rows", "1,40", "--rounds", "2"]
    report = linear_rows.main([*args, "--out", str(tmp_path), "--tag", "f"])
    assert report["dtype"] == "float32" and report["linears"] == 2 * 4 + 1
    assert report["weight_bytes"] > 0
    for row in report["rows"]:
        assert set(row["ms"]) == {"oneDNN packed", "MKL packed", "engine's choice", linear_rows.FLOOR}
        assert all(v > 0 for v in row["ms"].values())
    assert "MKL packed" in next(tmp_path.glob("linear-rows-*-f.md")).read_text()
