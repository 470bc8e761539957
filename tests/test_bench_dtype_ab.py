"""bench.dtype_ab runs our engine in bf16 and fp32 on the same loads, round by round, and reports
each load's ratio from the same rounds."""

from __future__ import annotations

import json
from pathlib import Path

from bench import dtype_ab


def test_dtype_ab_reports_both_dtypes_on_every_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    report = dtype_ab.main(
        [
            "--model", str(tiny_model_dir), "--rounds", "2", "--input-len", "12", "--output-len", "3",
            "--burst", "3", "--out", str(tmp_path), "--tag", "t",
        ]
    )  # fmt: skip
    assert [row["load"] for row in report["rows"]] == ["1 stream", "8 streams", "3-request burst"]
    for row in report["rows"]:
        bf16, fp32 = row["bfloat16"], row["float32"]
        assert len(bf16["rounds_tok_per_s"]) == len(fp32["rounds_tok_per_s"]) == 2
        assert row["bf16_vs_fp32"] == round(bf16["tok_per_s"] / fp32["tok_per_s"], 3)
    assert report["auto_picks"] in ("bfloat16", "float32")
    saved = json.loads(next(tmp_path.glob("dtype-ab-*-t.json")).read_text())
    assert saved["rows"] == report["rows"]
    assert "| 8 streams |" in next(tmp_path.glob("dtype-ab-*-t.md")).read_text()
