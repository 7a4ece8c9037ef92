#!/usr/bin/env bash
# The main job on the embedded default: SFT on the tiny model and bundled arithmetic data, then GRPO from
# the SFT's output. NPROC (default 2) processes per node; extra arguments go to both entry points, except
# `--grpo.*` keys (GRPO's only). GRPO always starts from this SFT's export, outputs/sft/hf, whatever
# `--model.path` (the SFT's starting model) says. Both stages resume from their latest checkpoint: run again,
# it continues a stopped stage and skips a finished one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
sft_args=() grpo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --train.out_dir|--train.out_dir=*|--ckpt.dir|--ckpt.dir=*)
      echo "error: scripts/run.sh writes its SFT to outputs/sft and its GRPO to outputs/grpo, starting GRPO from" \
           "outputs/sft/hf; \`$1\` would send both stages to one directory (GRPO then refuses the SFT's checkpoint," \
           "or starts from another SFT's export). Drop \`${1%%=*}\`, or run the two entry points yourself" \
           "(.venv/bin/torchrun -m trainer.sft --train.out_dir=A, then -m trainer.grpo --model.path=A/hf" \
           "--train.out_dir=B)." >&2
      exit 2 ;;
    --help|-h)
      echo "scripts/run.sh runs trainer.sft, then trainer.grpo from its export, each with these arguments (\`--grpo.*\` keys GRPO's only):"
      scripts/setup.sh
      .venv/bin/python -m trainer.sft --help
      exec .venv/bin/python -m trainer.grpo --help ;;
    --grpo.*=*) grpo_args+=("$1") ;;
    --grpo.*) grpo_args+=("$1"); [ $# -gt 1 ] && { shift; grpo_args+=("$1"); } ;;
    *) sft_args+=("$1"); grpo_args+=("$1") ;;
  esac
  shift
done
scripts/setup.sh
nproc_per_node=${NPROC:-2}
.venv/bin/torchrun --nproc-per-node "$nproc_per_node" -m trainer.sft --resume-from-checkpoint latest \
    ${sft_args[@]+"${sft_args[@]}"}
# A stop on a signal exits 0 after saving, before the export: GRPO must not start (it would run the default
# SFT's own settings on this SFT's checkpoint).
if [ ! -f outputs/sft/hf/config.json ]; then
  echo "the SFT stopped before its last step (its checkpoint is in outputs/sft/checkpoints); run scripts/run.sh" \
       "again, with the same arguments, to continue it and then GRPO" >&2
  exit 0
fi
exec .venv/bin/torchrun --nproc-per-node "$nproc_per_node" -m trainer.grpo --resume-from-checkpoint latest \
    ${grpo_args[@]+"${grpo_args[@]}"} --model.path=outputs/sft/hf
