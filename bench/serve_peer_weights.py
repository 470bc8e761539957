"""The weights each serving-benchmark peer loads, written out once from the model our stack serves, so
every system runs the same numbers in the run's dtype (BF16 or F32):

- vLLM loads a Hugging Face directory: for a GGUF model that is the de-quantized copy our own loader
  keeps (shared/model_source.py's ``converted_dir``, float32 safetensors + tokenizer + chat template),
  which vLLM casts to the run's dtype as our engine does; a Hugging Face directory is used as it is.
- llama.cpp loads a GGUF: the shipped file re-quantized by ``llama-quantize --allow-requantize`` to BF16
  or F32 (de-quantized to float32, then rounded to the dtype: the values our engine computes with).

Both are cached; the first call for a model takes about 20 s each."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from shared.model_source import resolve


class WeightsUnavailable(RuntimeError):
    """The model cannot be written out in the form a peer loads."""


def hf_dir(model: str) -> Path:
    """A Hugging Face model directory with the model's weights, tokenizer and chat template."""
    source = resolve(model)
    if source.gguf_file is None:
        if not Path(source.path).is_dir():
            raise WeightsUnavailable(f"{model!r} is neither a GGUF nor a local Hugging Face directory")
        return Path(source.path)
    target = source.converted_dir
    if not (target / "config.json").exists():
        # Our own loader writes the de-quantized copy (and its tokenizer) on first load; the worker
        # package installs the name resolver that puts it where shared/model_source.py says.
        import worker  # noqa: F401
        from worker.engine.model.model_loader import load_model

        load_model(model)
    return target


GGUF_TYPES = {"bfloat16": "BF16", "float32": "F32"}


def gguf_in(model: str, dtype: str, quantize: Path, cache: Path) -> Path:
    """The model's GGUF in ``dtype`` (bfloat16 or float32), made with llama.cpp's own ``llama-quantize``
    (``quantize``) into ``cache``."""
    if dtype not in GGUF_TYPES:
        raise WeightsUnavailable(f"the llama.cpp peer runs {' or '.join(GGUF_TYPES)}, not {dtype}")
    kind = GGUF_TYPES[dtype]
    source = resolve(model)
    if source.gguf_file is None:
        raise WeightsUnavailable(
            f"the llama.cpp peer needs a .gguf model; {model!r} is not one (convert it with llama.cpp's"
            " convert_hf_to_gguf.py and pass the file as --model)"
        )
    target = cache / f"{Path(source.gguf_file).stem}.{kind}.gguf"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [str(quantize), "--allow-requantize", source.file, str(staging), kind]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        staging.unlink(missing_ok=True)
        raise WeightsUnavailable(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-800:]}")
    os.replace(staging, target)  # a concurrent run never sees half a file
    return target
