"""Sizing the KV cache when the caller does not say how many blocks to use."""

from __future__ import annotations

import math
import mmap

import torch

KV_MEMORY_FRACTION = 0.25  # of the memory free now; the rest stays for activations and other processes


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:  # psutil is not a dependency
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def auto_num_kv_blocks(
    bytes_per_block: int, device: torch.device, *, max_blocks: int, fraction: float = KV_MEMORY_FRACTION
) -> int:
    budget = int(available_memory_bytes(device) * fraction)
    return max(16, min(budget // bytes_per_block, max_blocks))


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost memory only where written. On CPU an anonymous mmap hands out zero pages
    on first touch, so a KV cache sized for the worst case commits only what sequences fill
    (torch.zeros would commit it all at once on a box shared with other processes)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # the tensor keeps the mmap alive
