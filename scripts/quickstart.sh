#!/usr/bin/env bash
# Installs what running needs into ./.venv (scripts/test.sh adds what the tests need), then runs the service:
# Redis (the one answering at INFLIGHTQ_REDIS_URL, whoever runs it, else a private one; --private-redis for a
# private one always), the API on :8000 and one worker with the default model; it prints "inflightq: ready"
# (its time counts the install) once the API answers with a live worker. Ctrl-C stops it all.
# Arguments go to `inflightq up` (inflightq up --help).
#   INFLIGHTQ_SKIP_INSTALL=1  start without installing (the README's test, right after scripts/test.sh installed)
set -euo pipefail
cd "$(dirname "$0")/.."
STARTED_AT=$(date +%s)
if [ "${INFLIGHTQ_SKIP_INSTALL:-0}" != "1" ]; then
  bash scripts/install.sh
fi
exec .venv/bin/inflightq up --started-at "$STARTED_AT" "$@"
