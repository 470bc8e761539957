#!/usr/bin/env bash
# Installs everything the tests need (the dev extra too), then runs the whole test suite against a real
# Redis: the one answering at INFLIGHTQ_REDIS_URL (default 127.0.0.1:6379, whoever runs it; the run writes
# only keys under its own iqtest-* prefix and deletes them), else a private server the tests start;
# `bash scripts/test.sh --private-redis` always starts a private one. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
. .venv/bin/activate
python -m pytest "$@"
