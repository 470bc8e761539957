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
def _cpuinfo_field(name: str) -> str:
    """The first value of ``name`` in /proc/cpuinfo ("flags", "vendor_id", ...); empty where it can't be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo); empty where it can't be read."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor id (GenuineIntel, AuthenticAMD, ...); empty where unknown."""
    return _cpuinfo_field("vendor_id")


def cpu_has_fast_bf16() -> bool:
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def cpu_has_avx512() -> bool:
    return "avx512f" in cpu_flags()


def cpu_widens_bf16() -> bool:
    """Whether the CPU kernels have a vector path that widens bf16 weights to fp32 as they stream
    (AVX-512F, or AVX2 with FMA); elsewhere they fall back to plain loops."""
    return cpu_has_avx512() or {"avx2", "fma"} <= cpu_flags()


def resolve_dtype(
    dtype: str | torch.dtype = "auto",
    device: torch.device | None = None,
    *,
    cpu_kernels: bool = True,
    kernel_cache_dir: str | None = None,
) -> torch.dtype:
    """``auto``: bf16 on a GPU that has it (else fp16); on a CPU, bf16 where it is faster than fp32.

    That is where the CPU has bf16 units (AVX512-BF16, AMX), and where it has none but AVX-512 or
    AVX2 (``cpu_widens_bf16``) and the engine's CPU kernels are built (``cpu_kernels``, the build cached under
    ``kernel_cache_dir``): there decode steps read the bf16 weights through ``decode_linear`` and
    larger matmuls run in fp32 on an upcast copy, faster than fp32 at a few streams and level with it
    at many (``bench.dtype_ab``; see docs/benchmarks.md). Elsewhere bf16 matmuls are emulated or
    upcast and slower than fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    device = device or resolve_device()
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_has_fast_bf16():
        return torch.bfloat16
    if cpu_kernels and cpu_widens_bf16():
        from worker.engine.model.kernels.cpu_kernel import paged_decode_available

        if paged_decode_available(kernel_cache_dir):  # builds them once per machine, as the engine would
            return torch.bfloat16
    return torch.float32
