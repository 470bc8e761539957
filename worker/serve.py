"""``inflightq worker``: load the model, build the service, run until SIGTERM."""

from __future__ import annotations

import logging

from shared.settings import Settings
from shared.startup_objects import freeze_startup_objects
from worker.service import WorkerService


def log_kv_cache(settings: Settings, engine: object) -> None:
    """The KV cache's size, at start: operators add these up across the workers of a host."""
    from worker.engine.model.model_runner import ModelRunner

    config = engine.config  # type: ignore[attr-defined]
    param = next(engine.model.parameters())  # type: ignore[attr-defined]
    per_block = ModelRunner.kv_bytes_per_block(engine.model, config.block_size, param.dtype)  # type: ignore[attr-defined]
    sized = engine.kv_cache_size  # type: ignore[attr-defined]
    budget = f"{settings.kv_cache_memory_fraction:g} of free memory / {settings.workers_per_host} worker(s) per host"
    how = "set by num_kv_blocks" if sized is None else sized.described(budget)
    logging.getLogger("inflightq.worker").info(
        "KV cache: %d blocks of %d tokens, %.1f MiB (%s)",
        config.num_kv_blocks,
        config.block_size,
        config.num_kv_blocks * per_block / 2**20,
        how,
    )


def run_worker(settings: Settings, *, name: str | None = None) -> int:
    import torch

    from worker.engine import LLMEngine
    from worker.engine.model.hardware import resolve_device
    from worker.engine_config import engine_config, settings_dtype

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = resolve_device(settings.device)
    dtype = settings_dtype(settings, device)
    engine = LLMEngine.from_config(engine_config(settings, device=device, dtype=dtype))
    log_kv_cache(settings, engine)
    service = WorkerService(
        settings,
        engine,
        model=settings.model,
        name=name,
        device=str(device),
        dtype=str(dtype).replace("torch.", ""),
        threads=torch.get_num_threads(),
    )
    if settings.metrics_port is not None:
        from worker.metrics import serve_metrics

        serve_metrics(service, settings.metrics_port)
    logging.getLogger("inflightq.worker").info(
        "%d startup objects frozen (out of the garbage collector's full walks)", freeze_startup_objects()
    )
    return service.run()
