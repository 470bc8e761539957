"""Where a process's cgroup limits live: every directory whose limit binds it, for one controller.

A container reads the host's /proc/meminfo and sees the host's cores, so the engine reads its
limits (memory for the KV cache, the CPU quota for its threads) from the cgroup tree: v2's one
hierarchy or v1's per-controller mounts. In a container the cgroup namespace makes its own cgroup
the root; outside one, every ancestor's limit binds too, so the walk goes from the process's cgroup
up to the root."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def binding_dirs(
    v1_mounts: tuple[str, ...], v1_controller: str, root: Path = ROOT, proc_cgroup: str | None = None
) -> Iterator[tuple[Path, bool]]:
    """(directory, is v2) for each cgroup directory, innermost first, whose limits bind this process:
    in v2's hierarchy, and in v1's ``v1_controller`` hierarchy under any of ``v1_mounts``.
    ``proc_cgroup`` (the text of /proc/self/cgroup) and ``root`` for tests."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            bases, v2 = [root], True
        elif v1_controller in controllers.split(","):
            bases, v2 = [root / mount for mount in v1_mounts], False
        else:
            continue
        parts = [p for p in path.strip("/").split("/") if p]
        for base in bases:
            for depth in range(len(parts), -1, -1):
                yield base.joinpath(*parts[:depth]), v2
