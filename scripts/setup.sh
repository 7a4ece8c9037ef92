#!/usr/bin/env bash
# Creates .venv/ with the locked dependencies (uv.lock) when it is missing or out of date.
# Sourced by scripts/run.sh and scripts/test.sh; safe to run on its own.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" "$(command -v python3.12 2>/dev/null || true)" \
                   "$(command -v pyenv >/dev/null 2>&1 && ls -d "$(pyenv root)"/versions/3.12.*/bin/python3.12 2>/dev/null | tail -n 1)" \
                   /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

# The stamp names the set-up's own version too, so a change here re-syncs existing environments; it holds the lock
# and pyproject.toml (whose package list the editable install records).
stamp=.venv/.uv-lock-synced-v4
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && cat uv.lock pyproject.toml | cmp -s - "$stamp"; then
  exit 0
fi
python312=$(find_python312) || {
  echo "error: Python 3.12 is required (megatron-core 0.19 and Megatron-Bridge 0.6 need it) and none was found." >&2
  echo "Install it (e.g. 'pyenv install 3.12', 'apt install python3.12 python3.12-venv', or 'uv python install 3.12')," >&2
  echo "or point PYTHON312 at its interpreter: PYTHON312=/path/to/python3.12 $0" >&2
  exit 1
}
echo "setting up .venv with $python312 (first time: a few minutes, mostly downloading torch)" >&2
start=$(date +%s)
[ -x .venv/bin/python ] || "$python312" -m venv .venv
# uv resolves and installs exactly what uv.lock records (it is pinned in the lock itself too).
# --compile-bytecode writes every module's .pyc now: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines) Python would otherwise compile torch, megatron and transformers from source in every process, which
# was 37 of a run's 69.5 CPU-seconds of start-up (docs/figures.md, Start-up time).
[ -x .venv/bin/uv ] || .venv/bin/python -m pip install --quiet --disable-pip-version-check uv==0.13.9
# The project itself is reinstalled every time: its editable install lists its packages, and a pull that adds one
# (as tool_runtime/ was) would otherwise not be importable outside the checkout's directory.
UV_PYTHON_DOWNLOADS=never .venv/bin/uv sync --locked --compile-bytecode --python .venv/bin/python \
    --reinstall-package megatron-trainer
cat uv.lock pyproject.toml > "$stamp"
echo "environment ready in $(( $(date +%s) - start )) s" >&2
