"""The engine a worker runs, configured from the worker's settings (the engine itself reads no environment)."""

from __future__ import annotations

from typing import Any

import torch

from shared.settings import Settings
from worker.engine import EngineConfig
from worker.models import locate


def engine_config(settings: Settings, **overrides: Any) -> EngineConfig:
    """``overrides``: EngineConfig fields that differ from the settings (e.g. a resolved device or dtype)."""
    model, converted_model_dir = locate(settings.model)  # the name resolved once, here; the engine gets a path
    fields: dict[str, Any] = {
        "model": model,
        "served_model_name": settings.model,
        "converted_model_dir": converted_model_dir,
        "dtype": settings.dtype,
        "device": settings.device,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_prefill_tokens_beside_decodes": settings.max_prefill_tokens_beside_decodes or None,
        "block_size": settings.block_size,
        "num_kv_blocks": settings.num_kv_blocks,
        # The API admits no longer sequence; the KV cache is sized for max_num_seqs of them.
        "max_model_len": settings.max_total_tokens,
        # Workers sharing a host each take their share, so the caches together fit the budget.
        "kv_memory_fraction": settings.kv_cache_memory_fraction / settings.workers_per_host,
        "cpu_kernels": settings.cpu_kernels,
        "amx_linear": settings.amx_linear,
        "kernel_cache_dir": settings.kernel_cache,
        "compile": settings.compile,
        "compile_cache_dir": settings.compile_cache,
        "compile_dynamic": settings.compile_dynamic,
        "cuda_graphs": {"on": True, "off": False}.get(settings.cuda_graphs, settings.cuda_graphs),
        # Workers sharing a host share its CPUs as they share its memory.
        "cpu_threads": settings.torch_threads,
        "cpu_share": 1 / settings.workers_per_host,
        "max_loras": settings.max_loras,
        "speculative_tokens": settings.speculative_tokens,
        "speculative_ngram_max": settings.speculative_ngram_max,
        "speculative_ngram_min": max(1, min(settings.speculative_ngram_min, settings.speculative_ngram_max)),
        "speculate_by_default": settings.speculate_by_default,
        "fair_share": settings.fair_share,
    }
    return EngineConfig(**(fields | overrides))


def settings_dtype(settings: Settings, device: torch.device | None = None) -> torch.dtype:
    """What ``settings.dtype`` means on ``device`` for a worker with these settings (``auto``
    depends on whether its CPU kernels are on: ``worker.engine.model.hardware.resolve_dtype``)."""
    from worker.engine.model.hardware import resolve_dtype

    return resolve_dtype(
        settings.dtype, device, cpu_kernels=settings.cpu_kernels, kernel_cache_dir=settings.kernel_cache
    )
