"""Per-call cost of the bundled `python` tool (data/sandbox.py) and the isolation this machine gives it.

Times `--calls` calls of `python('print(1)')` after one warm-up, against `--calls` bare starts of the same interpreter
(`python -I -c pass`, what any subprocess tool pays), and prints the medians and what `run(...).isolation` reports.

    .venv/bin/python scripts/bench/bench_sandbox.py [--calls 20]
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.sandbox import python, run  # noqa: E402


def median_seconds(call, calls: int) -> float:
    """The median wall seconds of `calls` calls of `call()`."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Print the medians and the isolation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    calls = parser.parse_args().calls
    assert python("print(1)") == "1"
    sandboxed = median_seconds(lambda: python("print(1)"), calls)
    bare = median_seconds(lambda: subprocess.run([sys.executable, "-I", "-c", "pass"], check=True), calls)
    print(f"python('print(1)'): median {sandboxed * 1000:.0f} ms over {calls} calls")
    print(f"bare `python -I -c pass`: median {bare * 1000:.0f} ms over {calls} calls")
    print(f"isolation: {', '.join(run('').isolation) or '(none beyond the limits)'}")


if __name__ == "__main__":
    main()
