"""The rollout/training gap, side by side: the dense default and the embedded MoE, fp32 and bf16, MoE at EP=1 and
EP=2, routing replay off and on; one table of GRPO's per-step `rollout_logprob_diff_mean`, `_max`, `rollout_kl` and
`moe_route_mismatch` (medians over the steps).

    .venv/bin/python scripts/bench/bench_rollout_gap.py                  # from outputs/sft/hf and outputs/sft-moe/hf
    .venv/bin/python scripts/bench/bench_rollout_gap.py --dense tiny --moe tiny-moe --steps 2   # untrained, quick

Each row is `torchrun --nproc-per-node 2 -m trainer.grpo --model.path=... --train.steps=N` (default batch: 8 prompts x
8 samples), learning rate as the default GRPO's. Start from trained policies (`torchrun -m trainer.sft` and
`torchrun -m trainer.sft --config sft_moe`): a random model's flat distributions hide the gap. A row whose output
already holds its metrics is read, not rerun.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

FIGURES = ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl", "moe_route_mismatch")


def rows_of(args) -> list[tuple[str, list[str]]]:
    """(label, trainer.grpo arguments) of every row of the table."""
    rows = []
    for dtype in ("fp32", "bf16"):
        rows.append((f"dense {dtype}", [f"--model.path={args.dense}", f"--model.dtype={dtype}"]))
        for ep in (1, 2):
            for replay in ("false", "true"):
                rows.append((f"moe {dtype} EP={ep} replay={'on' if replay == 'true' else 'off'}",
                             [f"--model.path={args.moe}", f"--model.dtype={dtype}", f"--parallel.ep={ep}",
                              f"--grpo.routing_replay={replay}"]))
    return rows


def run(label: str, argv: list[str], out: Path, steps: int) -> list[dict]:
    """The step rows of one run, running it unless its metrics are there."""
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "-m", "trainer.grpo", *argv,
                   f"--train.steps={steps}", "--train.eval_samples=0", f"--train.out_dir={out}",
                   "--train.overwrite_output_dir=true"]
        print(f"running {label}: {' '.join(command[3:])}", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [row for row in map(json.loads, metrics.read_text().splitlines()) if "rollout_logprob_diff_mean" in row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", default="outputs/sft/hf", help="the dense policy (the default SFT's export, or `tiny`)")
    parser.add_argument("--moe", default="outputs/sft-moe/hf", help="the MoE policy (`--config sft_moe`'s export, or `tiny-moe`)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="runs/rollout-gap")
    args = parser.parse_args()
    print("| run | " + " | ".join(FIGURES) + " |\n|---|" + "---|" * len(FIGURES))
    for label, argv in rows_of(args):
        steps = run(label, argv, Path(args.out) / label.replace(" ", "_").replace("=", ""), args.steps)
        cells = [f"{statistics.median(row[key] for row in steps):.2e}" if key in steps[0] else "-" for key in FIGURES]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
