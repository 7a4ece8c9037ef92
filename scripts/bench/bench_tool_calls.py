"""Tool execution cost: one turn of N episodes each calling a pure-Python tool that computes for 50 ms (it holds the
GIL), run by `tool_runtime.runner` in threads and in worker processes, at the default `grpo.tool_timeout` (10 s) and
`grpo.tool_workers` (this rank's share of the cores); and, for comparison, the way calls ran before (every call of
the turn in its own thread at once, one deadline for all). Then the cost of one call of a tool that does nothing.

    .venv/bin/python scripts/bench/bench_tool_calls.py [--episodes 64 512] [--rounds 3]

Prints, per way and episode count, the median turn wall time over the rounds and the calls that timed out.
"""

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tool_runtime import runner as tool_runner, worker as tool_worker  # noqa: E402

TIMEOUT = 10.0  # grpo.tool_timeout's default
SPEC = "bench_tool_calls:busy"  # this script's directory is on the import path a worker process is given


def calibrate(seconds: float = 0.05) -> int:
    """Loop iterations that take `seconds` alone on this machine (the best of a few tries)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        spin(100_000)
        best = min(best, time.perf_counter() - start)
    return int(100_000 * seconds / best)


def spin(iterations: int) -> int:
    """Pure-Python work."""
    total = 0
    for index in range(iterations):
        total += index * index % 7
    return total


WORK = calibrate()  # computed again in each worker process, on the same machine


def busy(number: str) -> str:
    """Computes for 50 ms in Python (a fixed amount of work), holding the GIL.

    Args:
        number: echoed back
    """
    spin(WORK)
    return number


def idle(number: str) -> str:
    """Does nothing.

    Args:
        number: echoed back
    """
    return number


def jobs(count: int, function, spec: str) -> list[tool_runner.Job]:
    """One call of `function` per episode."""
    return [tool_runner.Job([(function.__name__, function, spec, {"number": str(index)})], False, [function.__name__])
            for index in range(count)]


def one_deadline(count: int) -> tuple[float, int]:
    """The earlier way: every call in its own thread at once, joined against one deadline for the turn."""
    boxes = [[] for _ in range(count)]
    threads = [threading.Thread(target=lambda box=box, index=index: box.append(busy(str(index))), daemon=True)
               for index, box in enumerate(boxes)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + TIMEOUT
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    seconds, timeouts = time.perf_counter() - start, sum(not box for box in boxes)  # unanswered at the deadline
    for thread in threads:
        thread.join()  # let the late ones finish before the next measurement
    return seconds, timeouts


def runner_turn(runner: tool_runner.ToolRunner, count: int) -> tuple[float, int]:
    """One turn through the runner: seconds and timeouts."""
    start = time.perf_counter()
    results = runner.run(jobs(count, busy, SPEC))
    return time.perf_counter() - start, sum(outcome.kind == "timeout" for outcomes in results for outcome in outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workers = tool_runner.default_workers()
    print(f"tool_workers default on this machine: {workers}; tool_timeout {TIMEOUT:g} s; a call computes 50 ms")
    threads = tool_runner.ToolRunner(TIMEOUT, workers, "thread")
    processes = tool_runner.ToolRunner(TIMEOUT, workers, "process", preload=[SPEC])
    ways = {"threads, one deadline (before)": one_deadline,
            "threads (tool_isolation=thread)": lambda count: runner_turn(threads, count),
            "worker processes (tool_isolation=process)": lambda count: runner_turn(processes, count)}
    for count in args.episodes:
        measured = {name: [] for name in ways}
        for _ in range(args.rounds):  # alternating, so the machine's noise falls on every way alike
            for name, way in ways.items():
                measured[name].append(way(count))
        for name, runs in measured.items():
            print(f"{count:4d} episodes, {name:42s}: turn {statistics.median(s for s, _ in runs):6.2f} s, "
                  f"timeouts {max(t for _, t in runs)} of {count}")
    for name, runner in (("thread", threads), ("process", processes)):
        runner.run(jobs(8, idle, "bench_tool_calls:idle"))  # warm
        latencies = []
        for _ in range(50):
            start = time.perf_counter()
            runner.run(jobs(1, idle, "bench_tool_calls:idle"))
            latencies.append(time.perf_counter() - start)
        print(f"one call of a tool that does nothing, tool_isolation={name}: {statistics.median(latencies) * 1e3:.2f} ms "
              "(median of 50)")
    start = time.perf_counter()
    worker = tool_worker.Worker([SPEC])
    worker.wait_ready()  # started: the interpreter and the tool module's imports
    worker.kill()
    print(f"starting a worker process (once per worker, and after a timeout kills one): {time.perf_counter() - start:.2f} s")
    processes.close()


if __name__ == "__main__":
    main()
