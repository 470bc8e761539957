"""Model names for the engine: shared's one table, in the terms the engine's loader takes. The
distribution declares ``locate`` as the engine's default resolver (pyproject.toml, entry point group
``inflightq.model_names``), so ``LLM("smollm2-135m-instruct")`` finds the packaged model."""

from __future__ import annotations

from shared.model_source import resolve


def locate(name: str) -> tuple[str, str | None]:
    """What the loader opens for ``name`` (a .gguf file, a directory or a hub id), and where a .gguf's
    de-quantized copy goes (None for the others)."""
    source = resolve(name)
    return source.file, str(source.converted_dir) if source.gguf_file else None
