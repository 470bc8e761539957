"""Sizing the KV cache when the caller does not say how many blocks to use."""

from __future__ import annotations

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


def auto_num_kv_blocks(bytes_per_block: int, device: torch.device, *, max_blocks: int) -> int:
    budget = int(available_memory_bytes(device) * KV_MEMORY_FRACTION)
    return max(16, min(budget // bytes_per_block, max_blocks))
