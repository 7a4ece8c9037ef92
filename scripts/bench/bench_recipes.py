"""The GRPO recipes side by side on the embedded default: sampled reward gain, held-out accuracy, time per step, clip_frac, wall time, 3 seeds.

    .venv/bin/python scripts/bench/bench_recipes.py                        # every recipe, seeds 1234 1 2, from outputs/sft/hf
    .venv/bin/python scripts/bench/bench_recipes.py --recipes dapo grpo --seeds 1234 --extra --train.eval_interval=5

Each run is `torchrun --nproc-per-node 2 -m trainer.grpo --config RECIPE --train.seed=SEED` from the default SFT's
export (run `torchrun --nproc-per-node 2 -m trainer.sft` first), one after another so that wall times compare. A run
whose output already holds its final export is read, not rerun (its wall time is kept in `wall.json`).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(path.stem for path in (REPO / "recipes").glob("*.yaml"))


def run(recipe: str, seed: int, out: Path, model: str, extra: list[str]) -> float:
    """Wall seconds of one run (start-up and held-out evaluations included), running it unless it finished before."""
    wall = out / "wall.json"
    if (out / "hf" / "config.json").is_file() and wall.is_file():
        return json.loads(wall.read_text())["seconds"]
    command = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "-m", "trainer.grpo",
               "--config", recipe, f"--model.path={model}", f"--train.seed={seed}", f"--train.out_dir={out}",
               "--train.overwrite_output_dir=true", *extra]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    wall.write_text(json.dumps({"seconds": seconds}))
    return seconds


def figures(out: Path, seconds: float) -> dict:
    """Sampled reward, first 10 steps -> last 10, held-out accuracy / answer accuracy, first row -> last, and the
    median step time and clip_frac over the steps."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward_mean" in row]
    evals = [row for row in rows if "eval_accuracy" in row]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {"gain": mean([row["reward_mean"] for row in steps[-10:]]) - mean([row["reward_mean"] for row in steps[:10]]),
            "held_out": (evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]),
            "answers": (evals[0]["eval_answer_accuracy"], evals[-1]["eval_answer_accuracy"]),
            "curve": [(row["step"], row["eval_accuracy"]) for row in evals], "minutes": seconds / 60,
            "step_s": statistics.median(row["step_time_s"] for row in steps),
            "clip_frac": statistics.median(row["clip_frac"] for row in steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234, 1, 2])
    parser.add_argument("--model", default="outputs/sft/hf", help="the policy to start from (the default SFT's export)")
    parser.add_argument("--out", default="runs/recipes")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer.grpo arguments, for every run")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"error: {args.model} is not an HF checkpoint; run `torchrun --nproc-per-node 2 -m trainer.sft` first.")
    print("| recipe | sampled reward gain (seeds " + " / ".join(map(str, args.seeds)) + ") | held-out accuracy | "
          "held-out answer accuracy | median step, s | median clip_frac | wall time, min (median) |\n"
          "|---|---|---|---|---|---|---|")
    for recipe in args.recipes:
        results = []
        for seed in args.seeds:
            out = Path(args.out) / f"{recipe}-{seed}"
            results.append(figures(out, run(recipe, seed, out, args.model, args.extra)))
        if any(len(result["curve"]) > 2 for result in results):
            print(f"<!-- {recipe} held-out accuracy by step: {[result['curve'] for result in results]} -->")
        join = lambda values: " / ".join(values)  # noqa: E731
        gains = join(f"{result['gain']:+.3f}" for result in results)
        held_out = join(f"{result['held_out'][1]:.3f}" for result in results)
        answers = join(f"{result['answers'][1]:.3f}" for result in results)
        minutes = join(f"{result['minutes']:.1f}" for result in results)
        median = statistics.median(result["minutes"] for result in results)
        step_s = join(f"{result['step_s']:.2f}" for result in results)
        clip = join(f"{result['clip_frac']:.3f}" for result in results)
        print(f"| {recipe} | {gains} | {results[0]['held_out'][0]:.3f} -> {held_out} "
              f"| {results[0]['answers'][0]:.3f} -> {answers} | {step_s} | {clip} | {minutes} ({median:.1f}) |", flush=True)


if __name__ == "__main__":
    main()
