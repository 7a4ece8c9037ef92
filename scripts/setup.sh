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
# uv's check (0.05 s) also catches a damaged environment: a package removed or changed since the last sync. Inexact:
# a package the lock's default set does not list (Transformer Engine or W&B from `uv sync --extra ...`) is no damage,
# where an exact check re-synced, and so uninstalled it, at every start.
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && cat uv.lock pyproject.toml | cmp -s - "$stamp" && [ -x .venv/bin/uv ] \
   && UV_PYTHON_DOWNLOADS=never .venv/bin/uv sync --locked --check --inexact --quiet --python .venv/bin/python >/dev/null 2>&1; then
  exit 0
fi
python312=$(find_python312) || {
  if [ -n "${PYTHON312:-}" ]; then
    echo "error: PYTHON312=$PYTHON312 is not a Python 3.12 interpreter ($("$PYTHON312" -V 2>&1 || true))," \
         "and no other was found." >&2
  fi
  echo "error: Python 3.12 is required (megatron-core 0.19 and Megatron-Bridge 0.6 need it) and none was found." >&2
  echo "Install it (e.g. 'pyenv install 3.12', 'apt install python3.12 python3.12-venv', or 'uv python install 3.12')," >&2
  echo "or point PYTHON312 at its interpreter: PYTHON312=/path/to/python3.12 $0" >&2
  exit 1
}
echo "setting up .venv with $python312 (first time: a few minutes, mostly downloading torch)" >&2
start=$(date +%s)
# A .venv of another Python (or whose interpreter is gone) is made anew: uv refuses to sync it.
if ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  [ -e .venv ] && echo "recreating .venv: its interpreter is not Python 3.12 ($(.venv/bin/python -V 2>&1 || true))" >&2
  "$python312" -m venv --clear .venv
fi
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
