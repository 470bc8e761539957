#!/usr/bin/env bash
# Installs everything into ./.venv, then runs the service: Redis (a private one if none
# answers at INFLIGHTQ_REDIS_URL), the API on :8000 and one worker with the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/inflightq up "$@"
