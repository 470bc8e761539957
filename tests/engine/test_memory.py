"""KV sizing: the cache holds what the batch can use (max_num_seqs sequences of max_model_len
tokens), capped by the memory budget; the budget reads the memory cgroup: a worker in a container
with a memory limit sizes its cache from what the limit leaves, not from the host's MemAvailable
(which a container reads too). And the weights' memory asks the kernel for 2 MB pages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.engine.core.memory import (
    HUGE_PAGE_BYTES,
    anonymous_memory,
    available_memory_bytes,
    cgroup_memory_headroom,
    kv_cache_size,
)
from worker.engine.model.model_runner import ModelRunner

GiB = 1 << 30


def write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_limit_less_usage_without_reclaimable_cache(tmp_path: Path) -> None:
    write(tmp_path, memory_max=str(8 * GiB), memory_current=str(3 * GiB), memory_stat=f"anon 1\ninactive_file {GiB}\n")
    assert cgroup_memory_headroom(tmp_path, "0::/\n") == 6 * GiB


def test_cgroup_v2_unlimited_is_none(tmp_path: Path) -> None:
    write(tmp_path, memory_max="max", memory_current=str(GiB))
    assert cgroup_memory_headroom(tmp_path, "0::/\n") is None


def test_cgroup_v2_the_tightest_ancestor_binds(tmp_path: Path) -> None:
    write(tmp_path / "slice", memory_max=str(4 * GiB), memory_current=str(GiB))
    write(tmp_path / "slice" / "worker", memory_max="max", memory_current=str(GiB))
    assert cgroup_memory_headroom(tmp_path, "0::/slice/worker\n") == 3 * GiB


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    write(
        memory,
        memory_limit_in_bytes=str(2 * GiB),
        memory_usage_in_bytes=str(GiB),
        memory_stat="total_inactive_file 0\n",
    )
    proc = "9:pids:/\n4:memory:/\n0::/\n"
    assert cgroup_memory_headroom(tmp_path, proc) == GiB
    # No limit: v1 writes a number near 2^63.
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert cgroup_memory_headroom(tmp_path, proc) is None


def test_usage_past_the_limit_leaves_nothing(tmp_path: Path) -> None:
    write(tmp_path, memory_max=str(GiB), memory_current=str(2 * GiB))
    assert cgroup_memory_headroom(tmp_path, "0::/\n") == 0


def test_a_limited_cgroup_sizes_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.engine.core.memory as memory

    monkeypatch.setattr(memory, "cgroup_memory_headroom", lambda: 64 << 20)
    # 25% of the 64 MiB the limit leaves, in 1 MiB blocks; the host's free memory is far larger.
    big_batch = {"max_num_seqs": 10, "max_model_len": 16_000, "block_size": 16}  # 10,000 blocks
    assert kv_cache_size(1 << 20, torch.device("cpu"), **big_batch).num_blocks == 16
    monkeypatch.setattr(memory, "cgroup_memory_headroom", lambda: 400 << 20)
    assert kv_cache_size(1 << 20, torch.device("cpu"), **big_batch).num_blocks == 100


# SmolLM2-135M's KV in bfloat16: 30 layers x (K, V) x 3 heads x 64 dims x 2 bytes a token, 16 tokens a block.
SMOLLM2_BLOCK = 30 * 2 * 3 * 64 * 2 * 16


def test_the_cache_holds_what_the_batch_can_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.engine.core.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 16 * GiB)
    size = kv_cache_size(SMOLLM2_BLOCK, torch.device("cpu"), max_num_seqs=8, max_model_len=2048, block_size=16)
    assert size.num_blocks == 8 * 128 and size.set_by_batch  # 360 MiB, not a quarter of the 16 GiB
    assert "8 sequences x 2048 tokens can use" in size.described()
    # 64 x 8192 tokens would take 11.25 GiB: the budget (a quarter of 16 GiB) holds less, and caps it.
    size = kv_cache_size(SMOLLM2_BLOCK, torch.device("cpu"), max_num_seqs=64, max_model_len=8192, block_size=16)
    assert size.num_blocks == 4 * GiB // SMOLLM2_BLOCK and not size.set_by_batch
    assert "4.0 GiB" in size.described() and "less than the 11.2 GiB 64 sequences x 8192 tokens" in size.described()


def test_an_engine_told_no_block_count_sizes_for_its_batch(make_engine: Callable[..., Any]) -> None:
    engine = make_engine(num_kv_blocks=None, max_num_seqs=4, max_model_len=128, block_size=16)
    assert engine.config.num_kv_blocks == 4 * 128 // 16 == engine.num_total_blocks
    assert engine.kv_cache_size is not None and engine.kv_cache_size.set_by_batch
    per_block = ModelRunner.kv_bytes_per_block(engine.model, 16, next(engine.model.parameters()).dtype)
    assert engine.kv_cache_size.bytes_per_block == per_block
    assert make_engine(num_kv_blocks=64).kv_cache_size is None  # the caller's count stands


def test_available_memory_is_at_most_the_host_s() -> None:
    meminfo = Path("/proc/meminfo").read_text()
    total = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemTotal:"))
    assert 0 < available_memory_bytes(torch.device("cpu")) <= total


def _thp_eligible(address: int) -> int | None:
    """smaps' THPeligible for the mapping holding ``address`` (None where the kernel does not say)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return int(line.split()[1])
    return None


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def test_anonymous_memory_is_zeros_aligned_to_a_huge_page() -> None:
    t = anonymous_memory(3 * HUGE_PAGE_BYTES // 2 + 7, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (3 * HUGE_PAGE_BYTES // 2 + 7,)
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0  # a huge page backs only an aligned 2 MB
    assert not t.any()
    t[-1] = 1.5  # writable to its last element
    assert t[-1].item() == 1.5 and t.sum().item() == 1.5


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="this kernel gives no transparent huge pages")
def test_anonymous_memory_asks_for_huge_pages_or_refuses_them() -> None:
    huge = anonymous_memory(4 * HUGE_PAGE_BYTES, torch.uint8)
    small = anonymous_memory(4 * HUGE_PAGE_BYTES, torch.uint8, huge_pages=False)
    assert _thp_eligible(huge.data_ptr()) == 1
    assert _thp_eligible(small.data_ptr()) == 0
