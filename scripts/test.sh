#!/usr/bin/env bash
# Installs everything, then runs the whole test suite against a real Redis
# (the one at INFLIGHTQ_REDIS_URL, or a private server the tests start).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
python -m pytest "$@"
