"""Sizing the KV cache when the caller does not say how many blocks to use."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine.core.cgroups import ROOT, binding_dirs

KV_MEMORY_FRACTION = 0.25  # of the memory free now; the rest stays for activations and other processes


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = 4 << 30
    with open("/proc/meminfo") as f:  # psutil is not a dependency
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    headroom = cgroup_memory_headroom()
    # A container reads the host's /proc/meminfo: sized from it alone, a worker in a container
    # with a memory limit would grow its cache past the limit and the cgroup's OOM killer ends it.
    return available if headroom is None else min(available, headroom)


def cgroup_memory_headroom(root: Path = ROOT, proc_cgroup: str | None = None) -> int | None:
    """Bytes this process's memory cgroup and its ancestors may still grow by (the tightest limit
    less its usage, reclaimable page cache not counted as used); None where none sets a limit.
    cgroup v2 and v1; ``root`` and ``proc_cgroup`` (the text of /proc/self/cgroup) for tests."""
    tightest: int | None = None
    for directory, v2 in binding_dirs(("memory",), "memory", root, proc_cgroup):
        if v2:
            headroom = _headroom(directory, "memory.max", "memory.current", "inactive_file")
        else:
            headroom = _headroom(directory, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        if headroom is not None:
            tightest = headroom if tightest is None else min(tightest, headroom)
    return tightest


def _headroom(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        raw = (directory / limit_file).read_text().strip()
        usage = int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    if raw == "max" or int(raw) >= UNLIMITED:
        return None
    reclaimable = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                reclaimable = int(value)
                break
    except (OSError, ValueError):
        pass
    return max(0, int(raw) - max(0, usage - reclaimable))


MIN_KV_BLOCKS = 16


@dataclass(frozen=True)
class KvCacheSize:
    """The KV cache the engine takes when the caller does not say: what its batch can use at most
    (``max_num_seqs`` sequences of ``max_model_len`` tokens, in blocks), unless the memory budget (a
    fraction of the memory free at start) holds less."""

    num_blocks: int
    bytes_per_block: int
    max_num_seqs: int
    max_model_len: int
    batch_blocks: int  # what the batch can use at most
    budget_bytes: int  # what the memory fraction allows

    @property
    def set_by_batch(self) -> bool:
        return self.num_blocks >= self.batch_blocks

    def described(self, budget: str = "kv_memory_fraction of free memory") -> str:
        """Its size's reason, for the worker's start; ``budget``: how the memory budget was set."""
        gib = 1 << 30
        batch = f"{self.max_num_seqs} sequences x {self.max_model_len} tokens"
        allowed = f"{self.budget_bytes / gib:.1f} GiB ({budget})"
        if self.set_by_batch:
            return f"what {batch} can use (max_num_seqs x max_model_len), within {allowed}"
        need = self.batch_blocks * self.bytes_per_block / gib
        return f"{allowed}, less than the {need:.1f} GiB {batch} could use (max_num_seqs x max_model_len)"


def kv_cache_size(
    bytes_per_block: int,
    device: torch.device,
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    fraction: float = KV_MEMORY_FRACTION,
) -> KvCacheSize:
    """Sized for the batch: blocks beyond what ``max_num_seqs`` full-length sequences fill would only
    keep more prefixes cached, so a small model does not take a quarter of the machine; the memory
    budget caps it."""
    batch_blocks = max_num_seqs * -(-max_model_len // block_size)
    budget = int(available_memory_bytes(device) * fraction)
    num_blocks = max(MIN_KV_BLOCKS, min(budget // bytes_per_block, batch_blocks))
    return KvCacheSize(num_blocks, bytes_per_block, max_num_seqs, max_model_len, batch_blocks, budget)


HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page


def anonymous_memory(count: int, dtype: torch.dtype, *, huge_pages: bool = True) -> torch.Tensor:
    """``count`` zeros of ``dtype`` in private anonymous memory: committed page by page on first
    touch, and advised (``madvise``) to be backed by 2 MB pages, or explicitly not.

    A decode step streams every weight once and, with many streams, the KV blocks of every sequence;
    in 4 KB pages that is a TLB miss and a stop of the hardware prefetcher (which does not cross a
    page) every 64 cache lines. Systems whose transparent huge pages are ``madvise`` (the default of
    most distributions) give 2 MB pages only to memory that asks. Private, not shared: a shared
    anonymous map is shmem, whose huge pages are a separate setting (off by default). Where the
    kernel has no huge pages the advice is a no-op and the memory is plain 4 KB pages."""
    size = max(1, count) * torch.empty((), dtype=dtype).element_size()  # an mmap cannot be empty
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buffer = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=flags) if flags else mmap.mmap(-1, size + HUGE_PAGE_BYTES)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)  # the tensor keeps the mmap alive
    start = (-flat.data_ptr()) % HUGE_PAGE_BYTES  # a huge page backs only a 2 MB-aligned range
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            buffer.madvise(advice, start, size)
        except OSError:  # a kernel built without transparent huge pages refuses the advice: 4 KB pages
            pass
    return flat[start : start + size].view(dtype)[:count]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost memory only where written. On CPU an anonymous mmap hands out zero pages
    on first touch, so a KV cache sized for the worst case commits only what sequences fill
    (torch.zeros would commit it all at once on a host shared with other processes). In 4 KB pages:
    2 MB ones (``anonymous_memory``) would commit memory 2 MB at a time and serve the KV cache no
    faster (see docs/benchmarks.md)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # the tensor keeps the mmap alive
