#!/usr/bin/env bash
# The test suite: sets up .venv/ when needed, then runs every CPU test (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
