"""bench.sampling times the sampler's two paths on the model's own logits, and LLM.generate with either."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench import sampling
from tests.ci_skips import missing
from worker.engine.sampling.sampler import Sampler


def test_sampling_reports_both_paths_for_every_case(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (sample_rows is one of the paths it times)", "apt-get install g++"))
    kernel_calls = 0
    original = Sampler._draw_kernel

    def counted(self: Sampler, *args: object) -> torch.Tensor:
        nonlocal kernel_calls
        kernel_calls += 1
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Sampler, "_draw_kernel", counted)
    report = sampling.main(
        [
            "--model", str(tiny_model_dir), "--dtype", "float32", "--rows", "1,3", "--rounds", "2",
            "--generate-rounds", "1", "--generate-requests", "3", "--input-len", "20", "--output-len", "4",
            "--out", str(tmp_path), "--tag", "t",
        ]
    )  # fmt: skip
    assert kernel_calls > 0  # the kernel path really ran (the sampler falls back silently without it)
    assert [(r["rows"], r["params"]) for r in report["sampler"]] == [
        (rows, name) for rows in (1, 3) for name in sampling.PARAMS
    ]
    for row in report["sampler"]:
        assert set(row["us"]) == set(sampling.PATHS) and all(v > 0 for v in row["us"].values())
    generate = report["generate"]
    assert all(len(v) == 1 and v[0] > 0 for v in generate["tok_s_per_round"].values())
    assert generate["kernel_over_torch"] == pytest.approx(
        generate["best_tok_s"]["kernel"] / generate["best_tok_s"]["torch"], rel=0.01
    )
    saved = json.loads(next(tmp_path.glob("sampling-*-t.json")).read_text())
    assert saved["sampler"] == report["sampler"]
    assert "| 3 | top_k 50 |" in next(tmp_path.glob("sampling-*-t.md")).read_text()
