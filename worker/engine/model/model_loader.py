"""Load a Hugging Face causal LM and its tokenizer from a local directory, a ``.gguf`` file or a
hub id. A model *name* such as ``smollm2-135m-instruct`` goes through a ``Resolve``: the one passed
in, else the one the installed distribution declares (the ``inflightq.model_names`` entry point:
the table of names lives outside the engine, which may not import it).

GGUF models are de-quantized once and cached as safetensors, so later loads skip the conversion."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

# name -> (what to open: a directory, a .gguf file or a hub id; where a .gguf's de-quantized copy goes, or None)
Resolve = Callable[[str], tuple[str, str | None]]
RESOLVER_GROUP = "inflightq.model_names"

DEFAULT_CACHE = Path("~/.cache/inflightq/models")


@dataclass(frozen=True)
class _Location:
    path: str  # a directory or a hub id
    gguf_file: str | None
    cache: Path | None  # where a converted copy lives (GGUF only)


@functools.cache
def installed_resolver() -> Resolve | None:
    """The resolver the installed distribution declares in the ``inflightq.model_names`` entry point
    group; None where none does (a spec is then opened as given)."""
    # Every distribution on the path, not entry_points(): that keeps only the first of each name,
    # and a stale inflightq.egg-info in a checkout's root would hide the installed one.
    for dist in distributions():
        for entry in dist.entry_points.select(group=RESOLVER_GROUP):
            return entry.load()
    return None


def _locate(spec: str, converted_dir: str | None, resolve: Resolve | None) -> _Location:
    resolve = resolve or installed_resolver()
    path, named_cache = resolve(spec) if resolve is not None else (spec, None)
    file = Path(path).expanduser()
    if file.suffix != ".gguf":
        return _Location(path, None, None)
    if not file.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    cache = converted_dir or named_cache or DEFAULT_CACHE.expanduser() / spec.replace("/", "--")
    return _Location(str(file.parent), file.name, Path(cache))


def load_tokenizer(spec: str, converted_dir: str | None = None, *, resolve: Resolve | None = None) -> Any:
    from transformers import AutoTokenizer

    loc = _locate(spec, converted_dir, resolve)
    if loc.cache is not None and (loc.cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(loc.cache)
    kwargs = {"gguf_file": loc.gguf_file} if loc.gguf_file else {}
    return AutoTokenizer.from_pretrained(loc.path, **kwargs)


def load_model(
    spec: str,
    dtype: Any = None,
    device: Any = "cpu",
    converted_dir: str | None = None,
    *,
    resolve: Resolve | None = None,
) -> tuple[Any, Any]:
    """Returns ``(model, tokenizer)``; the model in eval mode on ``device`` in ``dtype``. ``converted_dir``: where
    a .gguf's de-quantized copy is kept (default: what the resolver says, else ~/.cache/inflightq/models);
    ``resolve``: how model names map to files (default: ``installed_resolver()``)."""
    import torch
    from transformers import AutoModelForCausalLM

    loc = _locate(spec, converted_dir, resolve)
    dtype = dtype or torch.float32
    tokenizer = load_tokenizer(spec, converted_dir, resolve=resolve)
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
