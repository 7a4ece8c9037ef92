"""Asynchronous GRPO against the colocated loop, side by side: per process count and task, the colocated step, the
asynchronous step (half the processes sampling, max_staleness 1, the decoupled objective), both sides' busy times,
the weights' push, the idle shares, and whether the step overlaps: its ratio to max(sampling side, training side) +
sync (1.0: perfect overlap; their sum would be far above).

Tasks: `default` (the bundled arithmetic task, about 21-token completions), and `slow-reward` (the same with a reward
that takes 4 ms a completion, standing in for a slow tool or a verifier: the sampling side's work grows, the
training side's does not). Runs alternate colocated and asynchronous in each round; the first two steps of each run
(start-up, the asynchronous pipeline filling) are left out and medians are taken over the rest.

    .venv/bin/python scripts/bench/bench_async.py [--model outputs/sft/hf] [--nproc 2 4] [--steps 8] [--rounds 1]
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
SLOW_REWARD = ("import time\nfrom data.rewards import get_reward\n_arithmetic = get_reward('arithmetic')\n"
               "def reward(completion, reference):\n    time.sleep(0.004)\n    return _arithmetic(completion, reference)\n")
TASKS = {"default": [], "slow-reward": ["--grpo.reward=slow_reward:reward"]}


def run(model: str, extra: list[str], steps: int, nproc: int, work: Path) -> list[dict]:
    """The step rows of one run, its first two left out."""
    out = work / "run"
    (work / "slow_reward.py").write_text(SLOW_REWARD)
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), "-m",
               "trainer.grpo", f"--model.path={model}", f"--train.steps={steps}", "--train.eval_samples=0",
               f"--train.out_dir={out}", "--train.overwrite_output_dir=true", "--ckpt.async_save=false", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work), str(REPO), os.environ.get("PYTHONPATH", "")])}
    with (work / "log.txt").open("w") as log:
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode:
            tail = "\n".join((work / "log.txt").read_text(errors="replace").splitlines()[-30:])
            sys.exit(f"error: {' '.join(extra)} failed:\n{tail}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row][2:]


def sides(rows: list[dict], nproc: int) -> dict:
    """Medians of an asynchronous run's step and of each side's busy seconds a step."""
    trainers = nproc - nproc // 2
    serves = trainers // (nproc // 2)  # the trainers' data-parallel ranks each rollout process samples for
    median = lambda values: statistics.median(list(values))  # noqa: E731
    return {"step": median(row["step_time_s"] for row in rows),
            "sampling": median((row["rollout_time_s"] + row["reward_time_s"]) * serves for row in rows),
            "training": median(row["step_time_s"] - row["rollout_wait_time_s"] - row["weight_sync_time_s"] for row in rows),
            "sync": median(row["weight_sync_time_s"] for row in rows),
            "trainer_idle": median(row["trainer_idle_share"] for row in rows),
            "rollout_idle": median(row["rollout_idle_share"] for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="outputs/sft/hf", help="HF checkpoint directory (default: the default SFT's)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8, help="steps per run; the first two are left out")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    model = str(Path(args.model).resolve())
    table = []
    for nproc in args.nproc:
        for task, task_args in TASKS.items():
            modes = {"colocated": task_args,
                     "async": [*task_args, f"--grpo.rollout_processes={nproc // 2}", "--grpo.max_staleness=1",
                               "--grpo.rollout_correction=tis"]}
            rows = {mode: [] for mode in modes}
            for round_number in range(args.rounds):
                for mode in (modes if round_number % 2 == 0 else reversed(list(modes))):
                    with tempfile.TemporaryDirectory(prefix="bench-async-") as work:
                        rows[mode] += run(model, modes[mode], args.steps, nproc, Path(work))
            colocated = statistics.median(row["step_time_s"] for row in rows["colocated"])
            found = sides(rows["async"], nproc)
            bound = max(found["sampling"], found["training"]) + found["sync"]
            table.append((nproc, task, colocated, found, bound))
            print(f"{nproc} processes, {task}: colocated {colocated:.3f} s, async {found['step']:.3f} s", flush=True)
    print(f"\nmedians over {args.rounds} round(s) x {args.steps - 2} steps, load average {os.getloadavg()[0]:.1f}")
    print("| processes | task | colocated step | async step (x colocated) | sampling side | training side | sync | "
          "async / (max(sides) + sync) | sum of sides | trainer idle | rollout idle |")
    print("|---" * 11 + "|")
    for nproc, task, colocated, found, bound in table:
        print(f"| {nproc} | {task} | {colocated:.3f} s | {found['step']:.3f} s ({found['step'] / colocated:.2f}x) | "
              f"{found['sampling']:.3f} s | {found['training']:.3f} s | {found['sync']:.3f} s | "
              f"{found['step'] / bound:.2f} | {found['sampling'] + found['training'] + found['sync']:.3f} s | "
              f"{found['trainer_idle']:.0%} | {found['rollout_idle']:.0%} |")


if __name__ == "__main__":
    main()
