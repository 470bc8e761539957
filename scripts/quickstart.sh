#!/usr/bin/env bash
# Installs everything into ./.venv, then runs the service: Redis (a private one if none answers at
# INFLIGHTQ_REDIS_URL), the API on :8000 and one worker with the default model; it prints
# "inflightq: ready" once the API answers with a live worker. Ctrl-C stops it all.
#   INFLIGHTQ_SKIP_INSTALL=1  start without installing (the README's test, right after scripts/test.sh installed)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${INFLIGHTQ_SKIP_INSTALL:-0}" != "1" ]; then
  bash scripts/install.sh
fi
exec .venv/bin/inflightq up "$@"
