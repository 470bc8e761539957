"""What ``auto`` resolves to on a CPU: bf16 where it is faster than fp32 (bf16 units, or AVX-512 or
AVX2 with the engine's kernels built, ``bench.dtype_ab``), fp32 elsewhere; a named dtype as named."""

from __future__ import annotations

import pytest
import torch

from worker.engine.model import hardware
from worker.engine.model.kernels import cpu_kernel

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("fast_bf16", "flags", "kernels_on", "kernels_built", "expected"),
    [
        (True, {"avx512f"}, True, True, torch.bfloat16),  # AVX512-BF16 / AMX
        (True, set(), False, False, torch.bfloat16),  # bf16 units need no kernels of ours
        (False, {"avx512f"}, True, True, torch.bfloat16),  # Ice Lake: decode_linear reads bf16 weights
        (False, {"avx2", "fma"}, True, True, torch.bfloat16),  # AVX2: decode_linear widens them too
        (False, {"avx512f"}, False, True, torch.float32),  # kernels turned off: bf16 would be upcast, slower
        (False, {"avx2", "fma"}, True, False, torch.float32),  # kernels failed to build (no compiler)
        (False, {"avx2"}, True, True, torch.float32),  # AVX2 without FMA: the kernels' plain loops
        (False, {"sse4_2"}, True, True, torch.float32),
    ],
)
def test_auto_on_a_cpu_is_bf16_only_where_it_beats_fp32(
    monkeypatch: pytest.MonkeyPatch,
    fast_bf16: bool,
    flags: set[str],
    kernels_on: bool,
    kernels_built: bool,
    expected: torch.dtype,
) -> None:
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    asked: list[str | None] = []

    def built(cache_dir: str | None = None) -> bool:
        asked.append(cache_dir)
        return kernels_built

    monkeypatch.setattr(cpu_kernel, "paged_decode_available", built)
    assert hardware.resolve_dtype("auto", CPU, cpu_kernels=kernels_on, kernel_cache_dir="/k") == expected
    assert asked in ([], ["/k"])  # the kernels' own cache is where it looks
    assert hardware.resolve_dtype("float32", CPU) == torch.float32
    assert hardware.resolve_dtype("bf16", CPU) == torch.bfloat16


def test_the_cpu_flags_are_this_machines() -> None:
    with open("/proc/cpuinfo") as f:
        text = f.read()
    flags = hardware.cpu_flags()
    assert ("avx512f" in flags) == (" avx512f " in text.replace("\n", " "))
    assert hardware.cpu_has_avx512() == ("avx512f" in flags)
    assert hardware.cpu_widens_bf16() == ("avx512f" in flags or {"avx2", "fma"} <= flags)
    with pytest.raises(ValueError, match="unknown dtype"):
        hardware.resolve_dtype("float8", CPU)
