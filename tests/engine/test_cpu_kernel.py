"""The compiled CPU paged-decode kernel computes what the plain-torch decode path computes, reads
only the blocks a sequence owns, and rejects bad tables with an error instead of reading wild
memory; the backend choice falls back to plain torch when the kernel can't be built."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.ci_skips import missing
from tests.engine.avx2_build import REPO, run_avx2_check
from worker.engine.model import attention
from worker.engine.model.attention.cpu_backend import CpuKernelAttentionBackend
from worker.engine.model.attention.metadata import AttentionMetadata
from worker.engine.model.attention.torch_backend import TorchAttentionBackend
from worker.engine.model.kernels.cpu_kernel import paged_decode_available

BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(missing("a C++ compiler (the engine falls back to plain torch without one)", "apt-get install g++"))
    assert paged_decode_available(), "the kernel failed to build although a compiler is present"


def decode_case(dtype: torch.dtype, num_kv_heads: int, group: int, lens: list[int], seed: int = 0, head_dim: int = 64):
    """A cache with random K/V, and decodes whose blocks are scattered over it (never in order)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // BLOCK)
    num_blocks = max(256, len(lens) * max_blocks + 1)
    k_cache = torch.randn(num_kv_heads, num_blocks * BLOCK, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_kv_heads, num_blocks * BLOCK, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    table = order[: len(lens) * max_blocks].view(len(lens), max_blocks).clone()
    for i, n in enumerate(lens):  # padding entries point at block 0, as the model runner's do
        table[i, -(-n // BLOCK) :] = 0
    q = torch.randn(num_kv_heads * group, len(lens), head_dim, generator=gen).to(dtype)  # [Hq, B, D]
    meta = AttentionMetadata(
        backend=TorchAttentionBackend(),
        kv_caches=[(k_cache, v_cache)],
        slot_mapping=torch.empty(0, dtype=torch.long),
        block_size=BLOCK,
        num_decodes=len(lens),
        decode_blocks=table.view(-1),
        decode_context_lens=torch.tensor(lens),
    )
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    padding = torch.arange(max_blocks * BLOCK).unsqueeze(0) >= meta.decode_context_lens.unsqueeze(1)
    bias = torch.zeros(padding.shape, dtype=acc).masked_fill_(padding, float("-inf"))
    meta.decode_bias = bias.view(1, len(lens), 1, -1)
    return meta, q


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)]
)
@pytest.mark.parametrize(("num_kv_heads", "group"), [(3, 3), (2, 1), (1, 8), (1, 7), (2, 5)])
@pytest.mark.parametrize("head_dim", [64, 128, 32])
def test_kernel_matches_the_torch_decode_path(
    dtype: torch.dtype, tolerance: float, num_kv_heads: int, group: int, head_dim: int
) -> None:
    """Groups of 1-8 query heads per kv head: the AVX-512 path sums V for up to four heads of 64 (two
    of 128) at a time, so 5 and 7 leave runs of every length; head sizes without a SIMD path (32)
    take the plain loops."""
    lens = [1, 3, 15, 16, 17, 40, 200, 63, 129, 256, 257, 700]  # one token, block edges, multi-block contexts
    meta, q = decode_case(dtype, num_kv_heads, group, lens, head_dim=head_dim)
    expected = q.new_empty(len(lens), q.shape[0], q.shape[2])
    TorchAttentionBackend()._attend_decodes(meta, 0, q, expected, 0.125)
    got = torch.full_like(expected, float("nan"))
    CpuKernelAttentionBackend()._attend_decodes(meta, 0, q, got, 0.125)
    assert not got.isnan().any()
    assert got.shape[-1] == head_dim
    assert torch.allclose(got.double(), expected.double(), atol=tolerance, rtol=tolerance)


def test_kernel_ignores_blocks_past_the_context() -> None:
    meta, q = decode_case(torch.float64, 2, 2, [20, 5])
    out = q.new_empty(2, 4, 64)
    CpuKernelAttentionBackend()._attend_decodes(meta, 0, q, out, 0.125)
    k_cache, v_cache = meta.kv_caches[0]
    table = meta.decode_blocks.view(2, -1)
    # Poison every slot no sequence owns; the result must not move.
    owned = torch.zeros(k_cache.shape[1], dtype=torch.bool)
    for seq, n in enumerate([20, 5]):
        for t in range(n):
            owned[int(table[seq, t // BLOCK]) * BLOCK + t % BLOCK] = True
    k_cache[:, ~owned] = float("nan")
    v_cache[:, ~owned] = float("nan")
    again = torch.empty_like(out)
    CpuKernelAttentionBackend()._attend_decodes(meta, 0, q, again, 0.125)
    assert torch.equal(out, again)


@pytest.mark.parametrize(
    ("bad", "message"),
    [("block", "outside the cache"), ("len_zero", "out of range"), ("len_long", "out of range")],
)
def test_kernel_rejects_bad_tables(bad: str, message: str) -> None:
    meta, q = decode_case(torch.float32, 2, 2, [20, 5])
    table = meta.decode_blocks.view(2, -1)
    lens = meta.decode_context_lens
    if bad == "block":
        table[0, 1] = 10_000
    elif bad == "len_zero":
        lens[1] = 0
    else:
        lens[0] = table.shape[1] * BLOCK + 1
    k_cache, v_cache = meta.kv_caches[0]
    out = torch.empty(2, 4, 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.inflightq.paged_decode(
            q.transpose(0, 1).contiguous(), k_cache, v_cache, table, lens, BLOCK, 0.125, out
        )


def test_auto_picks_the_kernel_on_cpu_and_falls_back_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert isinstance(attention.make_backend("auto", cpu, 16), CpuKernelAttentionBackend)
    assert type(attention.make_backend("torch", cpu, 16)) is TorchAttentionBackend
    assert type(attention.make_backend("auto", cpu, 16, cpu_kernels=False)) is TorchAttentionBackend
    monkeypatch.setattr(attention, "cpu_kernels_available", lambda cache_dir=None: False)
    assert type(attention.make_backend("auto", cpu, 16)) is TorchAttentionBackend
    with pytest.raises(RuntimeError, match="could not be built"):
        attention.make_backend("cpu", cpu, 16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cache_write_puts_each_token_where_index_copy_does(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    heads, slots, dim, tokens = 3, 64 * BLOCK, 64, 21
    # The model hands K/V over as [1, Hkv, T, D] views of a [1, T, Hkv, D] projection: not contiguous.
    key = torch.randn(1, tokens, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    value = torch.randn(1, tokens, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens]
    expected_k, expected_v = torch.zeros(heads, slots, dim, dtype=dtype), torch.zeros(heads, slots, dim, dtype=dtype)
    expected_k.index_copy_(1, slot_mapping, key[0])
    expected_v.index_copy_(1, slot_mapping, value[0])
    k_cache, v_cache = torch.zeros_like(expected_k), torch.zeros_like(expected_v)
    torch.ops.inflightq.cache_write(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    # The fused decoder layer's token-major [T, Hkv, D] lands in the same places.
    k_cache.zero_(), v_cache.zero_()
    token_major = [t[0].transpose(0, 1).contiguous() for t in (key, value)]
    torch.ops.inflightq.cache_write(*token_major, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_cache_write_rejects_a_slot_outside_the_cache_before_writing() -> None:
    k_cache, v_cache = torch.zeros(2, 4 * BLOCK, 8), torch.zeros(2, 4 * BLOCK, 8)
    key = value = torch.ones(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.inflightq.cache_write(key, value, k_cache, v_cache, torch.tensor([0, 1, 4 * BLOCK]))
    assert not k_cache.any() and not v_cache.any()


AVX2_CHECK = """
import itertools, sys, torch
from torch.utils import cpp_extension
source, folder = sys.argv[1], sys.argv[2]
cpp_extension.load(name="paged_decode_avx2", sources=[source], build_directory=folder, is_python_module=False,
                   extra_cflags=["-O3", "-march=haswell", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"])
import tests.engine.test_cpu_kernel as t
for (dtype, tolerance), (kv, group), head_dim in itertools.product(
    [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], [(3, 3), (1, 8), (2, 5)], [64, 128]
):
    t.test_kernel_matches_the_torch_decode_path(dtype, tolerance, kv, group, head_dim)
t.test_kernel_ignores_blocks_past_the_context()
print("ok")
"""


@pytest.mark.slow
def test_a_build_without_avx512_attends_the_same(tmp_path: Path) -> None:
    """This box builds the kernel for its AVX-512; CPUs with AVX2 only get the other code paths (8-wide
    dot products, V summed one query head at a time). Built for Haswell in a fresh process, they match
    the torch path as well."""
    run_avx2_check(AVX2_CHECK, REPO / "worker" / "engine" / "model" / "kernels" / "paged_decode.cpp", tmp_path)
