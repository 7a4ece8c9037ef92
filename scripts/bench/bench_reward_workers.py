"""What running a `module:function` reward in worker processes costs (`grpo.reward_timeout` > 0, the default)
against calling it in the trainer's process (`grpo.reward_timeout=0`): one rank's scoring of a batch of
completions (`data.rewards.score`), for a reward that does nothing and one that computes for 2 ms a call (a parser,
a symbolic check), side by side in alternating rounds.

    .venv/bin/python scripts/bench/bench_reward_workers.py [--completions 256] [--workers 1 2] [--rounds 5]

Prints the median seconds per batch of each way and the ratio to the in-process call.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data import rewards  # noqa: E402

REFERENCE = "#### 8"


def instant(completion: str, reference: str) -> float:
    """A reward that reads the answer and nothing more."""
    return float(completion.endswith(reference))


def busy(completion: str, reference: str) -> float:
    """A reward that computes for about 2 ms (pure Python, holding the GIL)."""
    deadline = time.perf_counter() + 0.002
    while time.perf_counter() < deadline:
        pass
    return float(completion.endswith(reference))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    completions = [f"{index} + 1 = {index + 1}\n#### {index % 9}" for index in range(args.completions)]
    references = [REFERENCE] * args.completions
    for name in ("instant", "busy"):
        ways = {"in process": rewards.get_reward(f"bench_reward_workers:{name}", timeout=0)}
        ways |= {f"{workers} worker(s)": rewards.get_reward(f"bench_reward_workers:{name}", timeout=30, workers=workers)
                 for workers in args.workers}
        seconds = {way: [] for way in ways}
        try:
            for way, reward in ways.items():  # the workers' start (imports) is not a step's cost: one batch first
                rewards.score(reward, completions[:8], references[:8])
            for _ in range(args.rounds):
                for way, reward in ways.items():
                    start = time.perf_counter()
                    rewards.score(reward, completions, references)
                    seconds[way].append(time.perf_counter() - start)
        finally:
            for reward in ways.values():
                rewards.close(reward)
        base = statistics.median(seconds["in process"])
        for way, times in seconds.items():
            median = statistics.median(times)
            print(f"{name:8s} {way:12s} {median * 1000:8.1f} ms per {args.completions} completions  "
                  f"({median / base:.2f}x in-process)")


if __name__ == "__main__":
    main()
