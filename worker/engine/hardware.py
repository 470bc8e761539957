"""Which device and dtype to run on when the caller says "auto"."""

from __future__ import annotations

import functools

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    device = device or resolve_device()
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # Without native bf16 instructions bf16 matmuls are emulated and slower than fp32.
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
