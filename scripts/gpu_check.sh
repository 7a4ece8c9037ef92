#!/usr/bin/env bash
# The GPU check in one go (scripts/gpu_check.py says what it runs and prints):
#   scripts/gpu_check.sh [--report FILE.json] [--steps a,b]   on a machine with one GPU (--steps: a second try of some)
#   scripts/gpu_check.sh --cpu-smoke            the same steps on the tiny model on CPU (checks the script only)
#   scripts/gpu_check.sh --download-wheels      where a package registry is reachable: put the pinned wheels an
#                                               offline GPU machine lacks into $WHEEL_DIR (default .whl/, git-ignored)
# Which Python: scripts/setup.sh's .venv when it exists and sees a GPU (or for --cpu-smoke). Otherwise, on an
# offline GPU machine whose python3 already has PyTorch with CUDA (the venv's 3 GB of wheels cannot travel),
# the wheels in $WHEEL_DIR, at the versions uv.lock pins, are installed into a scratch directory on PYTHONPATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEEL_DIR=${WHEEL_DIR:-.whl}
# What a run imports (traced) beyond a CUDA PyTorch image's usual packages (torch, numpy, pyyaml, safetensors,
# huggingface-hub, einops, rich, requests, tqdm, scipy, pandas, pyarrow, xxhash): megatron, transformers at
# Bridge's pinned version with its tokenizers, what Bridge's HF export imports (modelopt, omegaconf, pydantic,
# pulp), and `datasets` for local data files. About 42 MB.
WHEELS="megatron-core megatron-bridge megatron-fsdp transformers tokenizers nvidia-modelopt omegaconf pulp
        pydantic pydantic-core annotated-types typing-inspection datasets dill multiprocess fsspec"

pinned_version() {  # the version uv.lock pins for a package
  awk -v name="$1" '$0 == "name = \"" name "\"" { found = 1; next } found && /^version = / { gsub(/"/, "", $3); print $3; exit }' uv.lock
}

if [ "${1:-}" = "--download-wheels" ]; then
  mkdir -p "$WHEEL_DIR"
  for name in $WHEELS; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$WHEEL_DIR" "$name==$(pinned_version "$name")"
  done
  du -sh "$WHEEL_DIR"
  exit 0
fi

if [ "${1:-}" = "--cpu-smoke" ] || { [ -x .venv/bin/python ] && .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }; then
  scripts/setup.sh
  python=.venv/bin/python
else
  python=${PYTHON:-python3}
  if ! compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
    echo "error: no .venv with CUDA and no wheels in $WHEEL_DIR: run scripts/setup.sh (needs a package registry)," >&2
    echo "or 'scripts/gpu_check.sh --download-wheels' where one is reachable and bring $WHEEL_DIR along." >&2
    exit 1
  fi
  site=$(mktemp -d /tmp/gpu-check-site.XXXX)
  "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEEL_DIR"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# Nothing is downloaded: the models are built locally and the data files are local.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec "$python" scripts/gpu_check.py "$@"
