"""Decode steps replayed from CUDA graphs, one graph per padded batch-size bucket.

On a GPU a small model's decode step is bound by launches, not by the GPU: every layer is a dozen
kernels, each launched from Python. Captured once per bucket, the whole forward (head included)
is one replay. A graph replays fixed addresses and shapes, so each input lives in a static buffer
and a step of ``n`` decodes runs the smallest bucket ``b >= n``: the ``b - n`` padding rows write
their K/V into a scratch block that no sequence owns and attend only to it, and their logits are
dropped. A backend that reads the cache in place (flash-attn, the CPU kernel) gets block tables
padded to the longest context the engine admits (``max_model_len``) and skips what lies past each
row's context, so one graph per batch size serves every context; the plain-torch backend gathers
each row's whole padded table, so its graphs also come per context width (16, 64, 256, ... blocks),
or a decode of a short context would gather ``max_model_len`` tokens.

``capture=False`` runs the very same padded, static-shape step without capturing it: on a CPU that
is what the tests hold token for token against ``generate``, and on a GPU it tells a fault of the
capture from a fault of the padding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from worker.engine.core.sequence import Sequence
from worker.engine.model.attention.metadata import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself), as vLLM
    pads: a step pads at most 7 rows past 8 sequences."""
    sizes = {b for b in (1, 2, 4) if b <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return tuple(sorted(sizes))


def context_widths(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths for a backend that gathers each decode's whole table: 16, 64, 256, ... blocks
    below ``max_blocks``, then ``max_blocks``; a decode gathers at most 4x its context (or 16 blocks)."""
    widths = {max_blocks}
    w = 16
    while w < max_blocks:
        widths.add(w)
        w *= 4
    return tuple(sorted(widths))


class DecodeGraphs:
    def __init__(
        self,
        model: Any,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        buckets: Seq[int],
        capture: bool,
    ) -> None:
        """``scratch_block``: a block of ``kv_caches`` the block manager never hands out."""
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = tuple(sorted(buckets))
        self.capture = capture
        self.scratch_block = scratch_block
        self.device = dev = kv_caches[0][0].device
        most = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self.widths = context_widths(max_blocks) if backend.needs_decode_bias else (max_blocks,)
        # The static inputs; every graph reads a prefix of them (and of its width's tables).
        self.input_ids = torch.zeros(most, dtype=torch.long, device=dev)
        self.positions = torch.zeros(most, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(most, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(most, dtype=torch.long, device=dev)
        self.tables = {w: torch.full((most, w), scratch_block, dtype=torch.long, device=dev) for w in self.widths}
        acc = torch.float64 if kv_caches[0][0].dtype == torch.float64 else torch.float32
        self.bias = {w: torch.zeros(1, most, 1, w * block_size, dtype=acc, device=dev) for w in self.widths}
        self._span = torch.arange(self.widths[-1] * block_size, device=dev)
        self.tables32 = torch.zeros(most, self.widths[-1], dtype=torch.int32, device=dev)
        self.context_lens32 = torch.ones(most, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(most + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.warmup_s = 0.0

    def fits(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.buckets[-1]

    def bucket_for(self, num_decodes: int) -> int:
        return next(b for b in self.buckets if b >= num_decodes)

    def width_for(self, num_blocks: int) -> int:
        return next((w for w in self.widths if w >= num_blocks), self.widths[-1])

    def warmup(self) -> float:
        """Captures every (batch size, width), largest first so the smaller ones reuse its memory pool;
        returns seconds."""
        if not self.capture:
            return 0.0
        started = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for w in reversed(self.widths):
                self._reset_inputs(self.buckets[-1], w)
                for b in reversed(self.buckets):
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # lazy initialisations (cuBLAS handles, autotuning) stay out of the capture
                            self._forward(b, w)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._outputs[b, w] = self._forward(b, w)
                    pool = graph.pool()
                    self._graphs[b, w] = graph
        torch.cuda.synchronize()
        self.warmup_s = time.perf_counter() - started
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s, context widths %s blocks) in %.1f s",
            len(self._graphs),
            self.buckets,
            self.widths,
            self.warmup_s,
        )
        return self.warmup_s

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one decode step of ``seqs`` (each computes its next token)."""
        n = len(seqs)
        b = self.bucket_for(n)
        w = self.width_for(max(s.num_computed_tokens // self.block_size + 1 for s in seqs))
        self._fill(seqs, b, w)
        if self.capture:
            self._graphs[b, w].replay()
            return self._outputs[b, w][:n]
        return self._forward(b, w)[:n]

    def _fill(self, seqs: list[Sequence], b: int, w: int) -> None:
        bs, scratch = self.block_size, self.scratch_block
        ids, pos, slots, lens, tables = [], [], [], [], []
        for seq in seqs:
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            table = seq.block_table[:w]
            tables.append(table + [scratch] * (w - len(table)))
        pad = b - len(seqs)
        ids += [0] * pad
        pos += [0] * pad
        slots += [scratch * bs] * pad
        lens += [1] * pad
        tables += [[scratch] * w] * pad
        self.input_ids[:b].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(pos), non_blocking=True)
        self.slot_mapping[:b].copy_(torch.tensor(slots), non_blocking=True)
        self.context_lens[:b].copy_(torch.tensor(lens), non_blocking=True)
        self.tables[w][:b].copy_(torch.tensor(tables), non_blocking=True)
        self._derive_views(b, w)

    def _reset_inputs(self, b: int, w: int) -> None:
        """Every row a padding row: what the capture runs on (it writes the scratch block only)."""
        self.input_ids[:b].zero_()
        self.positions[:b].zero_()
        self.slot_mapping[:b].fill_(self.scratch_block * self.block_size)
        self.context_lens[:b].fill_(1)
        self.tables[w][:b].fill_(self.scratch_block)
        self._derive_views(b, w)

    def _derive_views(self, b: int, w: int) -> None:
        """The backend's own views of the step, written in place outside the graph."""
        if self.backend.needs_decode_bias:
            padding = self._span[: w * self.block_size].unsqueeze(0) >= self.context_lens[:b].unsqueeze(1)
            self.bias[w][0, :b, 0].zero_().masked_fill_(padding, float("-inf"))
        if self.backend.needs_flat_views:
            self.tables32[:b].copy_(self.tables[w][:b])
            self.context_lens32[:b].copy_(self.context_lens[:b])

    def _meta(self, b: int, w: int) -> AttentionMetadata:
        return AttentionMetadata(
            backend=self.backend,
            kv_caches=self.kv_caches,
            slot_mapping=self.slot_mapping[:b],
            block_size=self.block_size,
            num_decodes=b,
            decode_blocks=self.tables[w][:b].view(-1),
            decode_context_lens=self.context_lens[:b],
            decode_bias=self.bias[w][:, :b] if self.backend.needs_decode_bias else None,
            block_tables=self.tables32[:b],
            context_lens=self.context_lens32[:b],
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            max_query_len=1,
            max_context_len=w * self.block_size,
        )

    def _forward(self, b: int, w: int) -> torch.Tensor:
        out = self.model(
            input_ids=self.input_ids[:b].unsqueeze(0),
            position_ids=self.positions[:b].unsqueeze(0),
            use_cache=False,
            inflightq_meta=self._meta(b, w),
        )
        return out.logits[0]
