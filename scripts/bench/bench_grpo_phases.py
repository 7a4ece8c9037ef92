"""A GRPO step's phases under several settings, side by side: alternating runs of `trainer.grpo`, medians per phase.

Each variant is a name and the arguments it adds to the same run (`--variant NAME=ARGS`, ARGS split on spaces); the
first is the control the others are divided by. ARGS starting with `@DIR` run DIR's code (another checkout, e.g. a
`git worktree` of the commit before a change) with this environment's packages: the same settings before and after a
code change. Every run is `torchrun --nproc-per-node N -m trainer.grpo` from the same
model and seed, without evaluation; each run's first step (warm-up) is left out and the medians are over the other
steps of every round. Rounds alternate the variants' order, so a busy machine slows them alike.

    .venv/bin/python scripts/bench/bench_grpo_phases.py --model outputs/sft/hf \\
        --variant rows= --variant budget=--train.micro_batch_tokens=8192 [--steps 6] [--rounds 2] [--nproc 1]
    git worktree add ../before HEAD~1 && .venv/bin/python scripts/bench/bench_grpo_phases.py --variant before=@../before \\
        --variant after= --rounds 4
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEYS = ("step_time_s", "rollout_time_s", "reward_time_s", "pi_old_time_s", "reference_time_s", "update_time_s",
        "padding_share")


def run(model: str, extra: list[str], steps: int, nproc: int, work: Path) -> list[dict]:
    """The step rows of one run, its first left out; with `@DIR` first in `extra`, of DIR's code."""
    checkout = Path(extra.pop(0)[1:]).resolve() if extra and extra[0].startswith("@") else REPO
    out = work / "run"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), "-m",
               "trainer.grpo", f"--model.path={model}", f"--train.steps={steps}", "--train.eval_samples=0",
               f"--train.out_dir={out}", "--train.overwrite_output_dir=true", "--ckpt.async_save=false", *extra]
    with (work / "log.txt").open("w") as log:
        # `python -m` puts the working directory first on the path, ahead of this environment's editable install.
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=checkout).returncode:
            tail = "\n".join((work / "log.txt").read_text(errors="replace").splitlines()[-30:])
            sys.exit(f"error: {' '.join(extra) or 'the control'} failed:\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row][1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="outputs/sft/hf", help="HF checkpoint directory (default: the default SFT's)")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=ARGS",
                        help="a name and the arguments it adds; the first is the control")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first is warm-up")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    variants = dict(variant.partition("=")[::2] for variant in args.variant)
    model = str(Path(args.model).resolve())
    rows = {name: [] for name in variants}
    for round_number in range(args.rounds):
        order = list(variants) if round_number % 2 == 0 else list(reversed(variants))
        for name in order:
            with tempfile.TemporaryDirectory(prefix="bench-grpo-phases-") as work:
                rows[name] += run(model, variants[name].split(), args.steps, args.nproc, Path(work))
            print(f"round {round_number + 1}/{args.rounds} {name}: step "
                  f"{statistics.median(row['step_time_s'] for row in rows[name]):.3f} s so far", flush=True)
    medians = {name: {key: statistics.median(row.get(key, 0.0) for row in found) for key in KEYS}
               for name, found in rows.items()}
    control = next(iter(variants))
    print(f"\nmedians over {args.rounds} rounds x {args.steps - 1} steps, {args.nproc} process(es), load average "
          f"{os.getloadavg()[0]:.1f}; ratios against `{control}`")
    print("| variant | " + " | ".join(key.removesuffix("_time_s") for key in KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for name, values in medians.items():
        cells = [f"{values[key]:.3f}" + (f" ({values[key] / medians[control][key]:.2f}x)"
                                         if name != control and key.endswith("_s") and medians[control][key] > 1e-3 else "")
                 for key in KEYS]
        print(f"| {name} `{variants[name]}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
