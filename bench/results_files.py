"""One benchmark run's files: ``<stem>.json`` (the figures), ``<stem>.md`` (the command and a table) and
``<stem>.png`` (a plot; skipped where matplotlib is missing)."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend (no display), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_figure(fig: Any, path: Path) -> None:
    """Lays out ``fig``, writes it to ``path`` and frees it (pyplot keeps every open figure)."""
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)  # type: ignore[union-attr]  # a figure exists, so matplotlib does


def stem(folder: Path | str, kind: str, date: str, tag: str = "") -> Path:
    """``folder/<kind>-<YYYY-MM-DD>[-<tag>]``: where a run of one benchmark keeps its files."""
    return Path(folder) / f"{kind}-{date[:10]}{'-' + tag if tag else ''}"


def save(stem: Path, results: dict, markdown: list[str], plot: Callable[[dict, Path], None]) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text("\n".join(markdown) + "\n")
    plot(results, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md and .png")


def machine() -> str:
    """The machine line of a results file: architecture, cores, torch's threads and version."""
    import torch

    threads = torch.get_num_threads()
    return f"{platform.machine()}, {os.cpu_count()} cpus, {threads} torch threads, torch {torch.__version__}"


def run_header(module: str, argv: list[str] | None) -> dict[str, str]:
    """What every results file opens with: the command that made it (``python -m <module> ...``),
    when (UTC) and on what machine."""
    args = argv if argv is not None else sys.argv[1:]
    return {
        "command": f"python -m {module} " + " ".join(args),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }
