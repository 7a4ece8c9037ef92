"""Where a run's start-up goes, and what the import choices cost: `trainer.sft` for one step, one process, in rounds.

    .venv/bin/python scripts/bench/bench_startup.py [--rounds 3]

Each round starts the entry point once per variant (interleaved, so machine load affects all alike) and reads the
start-up line it prints (wall/CPU seconds per phase). Variants:
  now             as the code stands;
  no-bytecode     no .pyc cache (PYTHONPYCACHEPREFIX at an empty directory): every import compiled from source, as
                  before scripts/setup.sh compiled bytecode, where PYTHONDONTWRITEBYTECODE is set;
  eager-datasets  `datasets` imported before main(), as data/sft.py did at module level before it was imported where used;
  without-wandb   `wandb` hidden, as in an environment without the optional extra (megatron-core imports it when present).
Medians of the CPU seconds are printed (wall time on a shared machine mostly measures the other work).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--train.steps=1", "--train.global_batch_size=8", "--train.micro_batch_size=8", "--train.eval_samples=0"]
# variant: (Python run before main(), extra environment)
VARIANTS = {"now": ("", {}), "no-bytecode": ("", {"PYTHONPYCACHEPREFIX": "<scratch>/no-pycache"}),
            "eager-datasets": ("import datasets; ", {}), "without-wandb": ("sys.modules['wandb'] = None; ", {})}
LINE = re.compile(r"start-up before the first step, wall/CPU seconds: ([\d.]+)/([\d.]+) \((.*)\)")


def run_once(variant: str, scratch: Path, out_dir: Path) -> dict[str, tuple[float, float]]:
    """Phase -> (wall, CPU) seconds of one start."""
    prelude, extra_env = VARIANTS[variant]
    script = (f"import runpy, sys; {prelude}sys.argv = ['trainer.sft', *{ARGS + [f'--train.out_dir={out_dir}']!r}]; "
              "runpy.run_module('trainer.sft', run_name='__main__')")
    env = {**os.environ, **{key: value.replace("<scratch>", str(scratch)) for key, value in extra_env.items()}}
    output = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            check=True).stdout
    match = LINE.search(output)
    phases = {"total": (float(match[1]), float(match[2]))}
    for part in match[3].split(", "):
        name, _, figures = part.rpartition(" ")
        phases[name] = tuple(float(figure) for figure in figures.split("/"))
    return phases


def main() -> None:
    """Run the rounds and print the median CPU (and wall) seconds per phase and variant."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["now", "no-bytecode"], choices=list(VARIANTS))
    args = parser.parse_args()
    results = {variant: [] for variant in args.variants}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for variant in args.variants:
                results[variant].append(run_once(variant, Path(scratch), Path(scratch) / f"{variant}-{round_index}"))
                print(f"round {round_index + 1} {variant}: {results[variant][-1]['total']}", flush=True)
    phases = list(results[args.variants[0]][0])
    print(f"\nmedian CPU / wall seconds over {args.rounds} rounds")
    print(f"{'phase':40}" + "".join(f"{variant:>22}" for variant in args.variants))
    for phase in phases:
        cells = []
        for variant in args.variants:
            runs = [run[phase] for run in results[variant] if phase in run]
            cells.append(f"{statistics.median(r[1] for r in runs):.1f} / {statistics.median(r[0] for r in runs):.1f}")
        print(f"{phase:40}" + "".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
    main()
