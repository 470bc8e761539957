"""Tensors in, logits out: owns the model and its paged KV cache and runs one forward per step
over the flattened ragged batch (input_ids and position_ids of shape (1, T))."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from worker.engine.core.config import EngineConfig
from worker.engine.core.memory import available_memory_bytes, lazy_zeros
from worker.engine.core.sequence import Sequence
from worker.engine.core.step_interrupt import StepInterrupt
from worker.engine.model import attention
from worker.engine.model.attention.custom_op import step_metadata
from worker.engine.model.attention.metadata import AttentionMetadata, PrefillChunk
from worker.engine.model.compiled_forward import CompiledForward, buckets_for, route_linears_through_ops
from worker.engine.model.decode_forward import DecodeForward
from worker.engine.model.decode_graphs import DecodeGraphs, graph_buckets
from worker.engine.model.fast_linear import (
    decode_copy_fits,
    decode_rows_for,
    gather_decode_layouts,
    prepack_linears,
    prepack_supported,
    tile_rows_for,
)
from worker.engine.model.fused_decoder_layer import fuse_decoder_layers
from worker.engine.model.fused_norms import fuse_rms_norms
from worker.engine.model.fused_projections import fuse_sibling_projections
from worker.engine.model.lora import AdapterSet, LoraStep
from worker.engine.model.lora import uninstall as uninstall_lora

log = logging.getLogger(__name__)


def kv_geometry(model: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a Hugging Face causal LM."""
    config = model.config.get_text_config()
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


class ModelRunner:
    def __init__(
        self, model: Any, config: EngineConfig, *, prepack_weights: bool = True, fuse_projections: bool = True
    ) -> None:
        """``config.num_kv_blocks`` must be set (the engine sizes it when the caller did not)."""
        assert config.num_kv_blocks is not None
        self.model = model
        self.block_size = block_size = config.block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        num_layers, num_kv_heads, head_dim = kv_geometry(model)
        self.backend = attention.make_backend(
            config.attention_backend,
            self.device,
            block_size,
            cpu_kernels=config.cpu_kernels,
            kernel_cache_dir=config.kernel_cache_dir,
        )
        wants_compile = compile_wanted(config.compile, model, self.device, self.dtype)
        graphs = None if wants_compile else decode_graphs_mode(config.cuda_graphs, self.device)
        # Decode graphs pad with a scratch block past the block manager's ones.
        num_blocks = config.num_kv_blocks + (graphs is not None)
        shape = self.backend.cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [
            (
                lazy_zeros(shape, self.dtype, self.device),
                lazy_zeros(shape, self.dtype, self.device),
            )
            for _ in range(num_layers)
        ]
        attention.register()
        self.compiled: CompiledForward | None = None
        self.decode_forward: DecodeForward | None = None
        self.decode_graphs: DecodeGraphs | None = None
        if wants_compile:
            if prepack_weights:
                route_linears_through_ops(model)
            buckets = buckets_for(config.max_num_batched_tokens, config.compile_buckets)
            self.compiled = CompiledForward(
                model, buckets, cache_dir=config.compile_cache_dir, dynamic=config.compile_dynamic
            )
        else:
            self._reroute_eager(model, config, prepack_weights=prepack_weights, fuse_projections=fuse_projections)
            self.decode_forward = DecodeForward.build(model)
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        # After the reroutes: the LoRA forwards wrap the rerouted linears (a step without adapters never calls them
        # on the fused paths).
        self.adapters = AdapterSet(model, config.max_loras, config.cpu_kernels) if config.max_loras > 0 else None
        if self.adapters is None:
            uninstall_lora(model)
        self.warmup_s = self.compiled.warmup(self._warmup_step) if self.compiled is not None else 0.0
        if graphs is not None:
            assert config.max_model_len is not None  # the engine sets it before building the runner
            self.decode_graphs = DecodeGraphs(
                model,
                self.backend,
                self.kv_caches,
                block_size=block_size,
                max_model_len=config.max_model_len,
                scratch_block=config.num_kv_blocks,
                buckets=graph_buckets(config.max_num_seqs),
                capture=graphs == "capture",
            )
            try:
                self.warmup_s += self.decode_graphs.warmup()
            except RuntimeError as exc:
                if config.cuda_graphs != "auto":
                    raise
                # Asked for by default, not by the user: a model whose forward cannot be captured still serves.
                log.warning("decode CUDA graphs could not be captured (%s); decode steps run eager", exc)
                self.decode_graphs = None

    def _reroute_eager(
        self, model: Any, config: EngineConfig, *, prepack_weights: bool, fuse_projections: bool
    ) -> None:
        """The eager forward's fused and prepacked pieces, each where it applies: sibling matmuls
        fused, linears prepacked (and laid out for ``decode_linear``), then on CPU with the kernels
        built the fused norms and decoder layers, which call those pieces."""
        kernels = (
            config.cpu_kernels
            and self.device.type == "cpu"
            and attention.cpu_kernels_available(config.kernel_cache_dir)
        )
        decode_rows = decode_rows_for(self.dtype) if kernels else 0
        tile_rows = tile_rows_for(self.dtype) if kernels and config.amx_linear else 0
        free = available_memory_bytes(self.device) if decode_rows or tile_rows else 0
        if tile_rows and not decode_copy_fits(model, free, 1 + bool(decode_rows)):
            log.info("bf16 matmuls of a few dozen rows stay on oneDNN: one more copy of the weights would not fit")
            tile_rows = 0
        if decode_rows and not decode_copy_fits(model, free):
            log.info("small bf16 matmuls stay on oneDNN: a second copy of the weights would not fit")
            decode_rows = 0
        if fuse_projections:
            fuse_sibling_projections(model, pack=prepack_weights, decode_rows=decode_rows, tile_rows=tile_rows)
        if prepack_weights and prepack_supported(self.device, self.dtype):
            prepack_linears(model, decode_rows=decode_rows, tile_rows=tile_rows)
        if decode_rows:
            gather_decode_layouts(model)
        if kernels:
            fuse_rms_norms(model)
            fuse_decoder_layers(model)

    @staticmethod
    def kv_bytes_per_block(model: Any, block_size: int, dtype: torch.dtype) -> int:
        num_layers, num_kv_heads, head_dim = kv_geometry(model)
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @torch.inference_mode()
    def run(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        sample: list[bool],
        interrupt: StepInterrupt | None = None,
    ) -> torch.Tensor:
        """Computes K/V for each sequence's next ``num_new_tokens`` tokens; returns logits [S, V] for
        the sequences flagged in ``sample`` (in their order), at their last position only. A decode
        with a ``draft`` also computes its draft tokens (each one more decode row of the same
        sequence) and gets 1 + len(draft) rows of logits, in position order. With ``interrupt``,
        each layer may raise ``StepInterrupted`` (a decode step replayed from a CUDA graph or run as
        one op of all layers cannot stop: it is the shortest kind of step anyway)."""
        # A step with adapter rows runs transformers' forward, whose LoRA linears add each row's delta (lora.py).
        adapters = self.adapters is not None and self.adapters.begin_step(seqs)
        graphs = None if adapters else self.decode_graphs
        drafts = any(s.draft for s, n in zip(seqs, num_new_tokens, strict=True) if n == 1)
        if graphs is not None and graphs.fits(len(seqs)) and all(n == 1 for n in num_new_tokens) and not drafts:
            logits = graphs.run(seqs)
            return logits if all(sample) else logits[[i for i, s in enumerate(sample) if s]]
        order = sorted(range(len(seqs)), key=lambda i: num_new_tokens[i] != 1)  # decodes first, stable
        meta, input_ids, positions, last_rows = self._prepare(
            [seqs[i] for i in order], [num_new_tokens[i] for i in order]
        )
        meta.interrupt = interrupt
        if adapters:
            meta.lora = self._lora_step([seqs[i] for i in order], last_rows)
        row_of = dict(zip(order, last_rows, strict=True))
        rows = [row_of[i] for i in range(len(seqs)) if sample[i]]
        if drafts:  # a draft's rows end at its decode's last row
            rows = [
                r
                for i in range(len(seqs))
                if sample[i]
                for r in range(row_of[i] - (len(seqs[i].draft) if num_new_tokens[i] == 1 else 0), row_of[i] + 1)
            ]
        keep = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.compiled is not None and meta.lora is None:
            with step_metadata(meta):
                hidden = self.compiled(input_ids, positions)
            if hidden is not None:
                return self.model.get_output_embeddings()(hidden[keep])
        if self.decode_forward is not None:  # its fused layers add a LoRA step's deltas themselves
            logits = self.decode_forward(meta, input_ids, positions, keep)
            if logits is not None:
                return logits
        out = self.model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=keep,
            inflightq_meta=meta,
        )
        return out.logits[0]

    def _lora_step(self, seqs: list[Sequence], last_rows: list[int]) -> LoraStep:
        """The step's rows grouped by adapter (``seqs`` in row order, each ending at its ``last_rows``), made the
        one the LoRA linears read."""
        assert self.adapters is not None
        entries: list[tuple[int, int, str | None]] = []
        first = 0
        for seq, last in zip(seqs, last_rows, strict=True):
            entries.append((first, last + 1 - first, seq.adapter))
            first = last + 1
        self.adapters.step = step = self.adapters.step_for(entries)
        return step

    @torch.inference_mode()
    def _warmup_step(self, num_tokens: int) -> None:
        """One compiled step of ``num_tokens`` one-token sequences, all at block 0 slot 0: the slot is
        written before any real sequence could read it, since a sequence writes each slot it reads."""
        assert self.compiled is not None
        dummy = SimpleNamespace(num_computed_tokens=0, token_ids=[0], block_table=[0], draft=[])
        meta, input_ids, positions, _ = self._prepare([dummy] * num_tokens, [1] * num_tokens)  # type: ignore[list-item]
        with step_metadata(meta):
            self.compiled(input_ids, positions)

    def _prepare(
        self, seqs: list[Sequence], num_new_tokens: list[int]
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        prefills: list[PrefillChunk] = []
        num_decodes = 0
        # Per decode row: its block table and context length. A decode's draft tokens are decode rows
        # of their own, each seeing the context up to itself (the step writes all their K/V first).
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        dev = self.device
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start, ctx = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(ids)
            ids.extend(seq.token_ids[start:ctx])
            table = seq.block_table
            if n == 1 and seq.draft:
                ids.extend(seq.draft)
                ctx = start + 1 + len(seq.draft)
            pos.extend(range(start, ctx))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, ctx))
            last_rows.append(row + ctx - start - 1)
            if n == 1:
                num_decodes += ctx - start
                decode_tables.extend([table] * (ctx - start))
                decode_lens.extend(range(start + 1, ctx + 1))
            elif start == 0:
                prefills.append(PrefillChunk(row, row + n, ctx, None, None))
            else:
                ctx_blocks = torch.tensor(table[: -(-ctx // bs)], dtype=torch.long, device=dev)
                q_pos = torch.arange(start, ctx, device=dev).unsqueeze(1)
                mask = torch.arange(ctx, device=dev).unsqueeze(0) <= q_pos
                prefills.append(PrefillChunk(row, row + n, ctx, ctx_blocks, mask))
        meta = AttentionMetadata(
            backend=self.backend,
            kv_caches=self.kv_caches,
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=num_decodes,
            prefills=prefills,
        )
        if num_decodes and not self.backend.needs_flat_views:
            self._decode_views(meta, decode_tables, decode_lens)
        if self.backend.needs_flat_views:
            entries = [(t, c, 1) for t, c in zip(decode_tables, decode_lens, strict=True)]
            for s, n in zip(seqs, num_new_tokens, strict=True):
                if n != 1:
                    entries.append((s.block_table, s.num_computed_tokens + n, n))
            self._flat_views(meta, entries)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return meta, input_ids, positions, last_rows

    def _decode_views(self, meta: AttentionMetadata, block_tables: list[list[int]], lens: list[int]) -> None:
        """``block_tables`` and ``lens``: each decode row's blocks and context length (its own token included)."""
        bs = self.block_size
        max_blocks = -(-max(lens) // bs)
        # Padding points at block 0: real memory, masked out by the bias (the kernel never reads it).
        tables = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in block_tables]
        meta.decode_blocks = torch.tensor(tables, dtype=torch.long, device=self.device).view(-1)
        meta.decode_context_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
        if not self.backend.needs_decode_bias:
            return
        positions = torch.arange(max_blocks * bs, device=self.device).unsqueeze(0)
        padding = positions >= meta.decode_context_lens.unsqueeze(1)
        # Scores are summed in fp32 (fp64 for fp64 models), so the bias is in that dtype.
        acc = torch.float64 if self.dtype == torch.float64 else torch.float32
        bias = torch.zeros(padding.shape, dtype=acc, device=self.device).masked_fill_(padding, float("-inf"))
        meta.decode_bias = bias.view(1, len(lens), 1, -1)

    def _flat_views(self, meta: AttentionMetadata, entries: list[tuple[list[int], int, int]]) -> None:
        """``entries``: (block table, context length, query tokens) of each query of the step, in row order."""
        max_blocks = max(len(table) for table, _, _ in entries)
        rows = [table + [0] * (max_blocks - len(table)) for table, _, _ in entries]
        meta.block_tables = torch.tensor(rows, dtype=torch.int32, device=self.device)
        meta.context_lens = torch.tensor([c for _, c, _ in entries], dtype=torch.int32, device=self.device)
        cu = [0]
        for _, _, n in entries:
            cu.append(cu[-1] + n)
        meta.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=self.device)
        meta.max_query_len = max(n for _, _, n in entries)
        meta.max_context_len = max(c for _, c, _ in entries)


def decode_graphs_mode(setting: bool | str, device: torch.device) -> str | None:
    """``capture`` (CUDA graphs), ``eager`` (the same padded static-shape step, not captured) or None.
    ``auto``: capture on CUDA; True asks for it and fails elsewhere."""
    if setting == "eager":
        return "eager"
    if setting == "auto":
        return "capture" if device.type == "cuda" else None
    if not setting:
        return None
    if device.type != "cuda":
        raise ValueError("cuda_graphs=True needs a CUDA device ('eager' runs the padded decode step anywhere)")
    return "capture"


def compile_wanted(setting: bool | str, model: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """``auto``: CPU bf16/fp32 models whose logits are the head's plain output (no soft-capping)."""
    if setting == "auto":
        plain_head = getattr(model.config.get_text_config(), "final_logit_softcapping", None) is None
        return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and plain_head
    return bool(setting)
