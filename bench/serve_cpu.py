"""Where a serving run's CPU goes: the CPU seconds each process of the stack (the API, the workers,
Redis) and the load generator itself used during one run, per generated token and as a share of
the machine's cores over the run.

Why it is in the report: on a small box every process shares the cores the worker's torch threads
need, so the stack's throughput against the offline engine (which has the cores to itself) is
bounded by what the others take. ``bound`` is that ceiling for the run: one minus the others' CPU
over (cores x duration). A measured share close to it says the gap is the cores the serving path
and the client use, not something the worker does wrong.

Read from ``/proc/<pid>/stat`` (utime + stime, every thread); on a system without ``/proc`` the
meter gives nothing and the report has no CPU table."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKERS = "workers"
LOAD_GENERATOR = "load generator"


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds ``pid`` has used (user + system, all its threads), or None when it is gone."""
    try:
        # The command name (field 2) is in parentheses and may hold spaces: split after its ")".
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def local_redis_pid(info: dict[str, object]) -> int | None:
    """The Redis server's pid from its ``INFO server``, when that server runs on this machine (a
    process of that pid whose command is redis-server); else None."""
    pid = info.get("process_id")
    if not isinstance(pid, int):
        return None
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"redis-server" in command else None


@dataclass
class CpuMeter:
    """Named groups of processes; ``start()`` then ``stop(tokens)`` around one run."""

    groups: dict[str, list[int]] = field(default_factory=dict)
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    _started: dict[str, float] = field(default_factory=dict)
    _wall: float = 0.0

    def _read(self) -> dict[str, float]:
        out: dict[str, float] = {LOAD_GENERATOR: time.process_time()}  # this process, all its threads
        for name, pids in self.groups.items():
            times = [process_cpu_s(pid) for pid in pids]
            out[name] = sum(t for t in times if t is not None)
        return out

    def start(self) -> None:
        self._started, self._wall = self._read(), time.perf_counter()

    def stop(self, tokens: int) -> dict[str, object] | None:
        """The run's CPU per group: seconds, ms per generated token, share of the machine; and the
        bound the other processes leave the workers. None when /proc is not there."""
        if not Path("/proc/self/stat").exists() or not self._started:
            return None
        wall = time.perf_counter() - self._wall
        ended = self._read()
        used = {name: max(0.0, ended[name] - self._started.get(name, ended[name])) for name in ended}
        capacity = self.cores * wall
        others = sum(s for name, s in used.items() if name != WORKERS)
        report: dict[str, object] = {
            "cores": self.cores,
            "wall_s": round(wall, 3),
            "cpu_s": {name: round(s, 3) for name, s in used.items()},
            "ms_per_token": {name: round(1000 * s / tokens, 3) for name, s in used.items()} if tokens else {},
            "share_of_cores": {name: round(s / capacity, 3) for name, s in used.items()},
        }
        if WORKERS in used:
            report["bound"] = round(max(0.0, 1 - others / capacity), 3)
        return report


def table(runs: list[dict[str, object]]) -> list[str]:
    """Markdown: one row per run that has a CPU measurement."""
    rows = [r for r in runs if isinstance(r.get("metrics"), dict) and r["metrics"].get("cpu")]  # type: ignore[union-attr]
    if not rows:
        return []
    names = sorted({n for r in rows for n in r["metrics"]["cpu"]["cpu_s"]}, key=_order)  # type: ignore[index]
    lines = [
        "CPU per generated token by process (ms), its share of the cores over the run, and the bound on the",
        "stack's throughput that the processes other than the workers leave (1 - their CPU / (cores x duration)):",
        "",
        "| system | concurrency | " + " | ".join(names) + " | others' share of the cores | bound |",
        "|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for r in rows:
        cpu = r["metrics"]["cpu"]  # type: ignore[index]
        per = cpu["ms_per_token"]
        others = sum(v for n, v in cpu["share_of_cores"].items() if n != WORKERS)
        cells = " | ".join(f"{per.get(n, '-')}" for n in names)
        lines.append(
            f"| {r['system']} | {r.get('concurrency') or '-'} | {cells} | {others:.1%} | {cpu.get('bound', '-')} |"
        )
    return lines


def _order(name: str) -> tuple[int, str]:
    return ({WORKERS: 0, "api": 1, "redis": 2, LOAD_GENERATOR: 3}.get(name, 4), name)
