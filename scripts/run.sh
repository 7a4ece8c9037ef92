#!/usr/bin/env bash
# The main job on the embedded default: SFT on the tiny model and bundled arithmetic data, then GRPO from
# the SFT's output. NPROC (default 2) processes per node; extra arguments go to both entry points. Both stages
# resume from their latest checkpoint: run again, it continues a stopped stage and skips a finished one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
nproc_per_node=${NPROC:-2}
.venv/bin/torchrun --nproc-per-node "$nproc_per_node" -m trainer.sft --resume-from-checkpoint latest "$@"
exec .venv/bin/torchrun --nproc-per-node "$nproc_per_node" -m trainer.grpo --resume-from-checkpoint latest "$@"
