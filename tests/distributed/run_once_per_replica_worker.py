"""Run by tests/test_run_once_per_replica.py in the shared launch (shared_launch.py, 2 processes): what each rank of a
tensor-parallel group of 2 gets from `model.replica.run_once_per_replica` when the computing rank fails; then, at
PP=2 (the two ranks one replica's two pipeline stages), what each stage gets (`<out>/pp2-rank<R>.json`).

No model: megatron's parallel state alone, with TP=2 over the launch's gloo group. Its groups are made with a
30-second timeout, so a rank left waiting in the broadcast fails that check in 30 s instead of hanging the launch.
Each rank writes `<out>/rank<R>.json`: per case, the error type and message it got (or the value returned), the
seconds the call took, and how many tracebacks `model.replica` logged on it.
"""

import argparse
import json
import logging
import threading
import time
from pathlib import Path

import torch.distributed as dist

from config.errors import UserError
from model import replica

HANG_TIMEOUT_MINUTES = 0.5  # megatron's groups take minutes; timedelta accepts a fraction


def raises_runtime_error():
    """Stands for a chat template or a tool thread that fails."""
    raise RuntimeError("the chat template failed.\nsecond line")


def returns_a_lock():
    """A result pickle refuses."""
    return threading.Lock()


def returns_a_lambda():
    """A result pickle refuses (a local function has no importable name)."""
    return lambda: 7


def raises_user_error():
    """A mistake the user can fix, raised as is on every rank."""
    raise UserError("tools.calculator.timeout is 0; set it to a positive number of seconds.")


def returns_the_rank():
    """The computing rank's global rank: every rank must get it."""
    return {"computed_on": dist.get_rank()}


CASES = [raises_runtime_error, returns_a_lock, returns_a_lambda, raises_user_error, returns_the_rank]


class CountTracebacks(logging.Handler):
    """Counts the records with a traceback that `model.replica` logs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.exc_info is not None


def parse(argv: list[str]):
    """The worker's arguments: `--out`, the folder for each rank's results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def run(args) -> None:
    """Run every case at TP=2, then at PP=2, and write this rank's outcomes."""
    rank = dist.get_rank()
    for layout, prefix in (({"tensor_model_parallel_size": 2}, ""), ({"pipeline_model_parallel_size": 2}, "pp2-")):
        results = run_cases(layout)
        print(f"[run once per replica] {prefix}rank {rank}: {json.dumps(results)}", flush=True)
        Path(args.out, f"{prefix}rank{rank}.json").write_text(json.dumps(results))


def run_cases(layout: dict) -> dict:
    """Every case under megatron's parallel state laid out as `layout`: per case, this rank's outcome."""
    from megatron.core import parallel_state

    # The launch made the gloo process group; parallel.init_distributed would lay out the groups with megatron's
    # 30-minute timeout, which a hang in a test must not wait for.
    parallel_state.initialize_model_parallel(**layout, distributed_timeout_minutes=HANG_TIMEOUT_MINUTES)
    counter = CountTracebacks()
    logging.getLogger(replica.__name__).addHandler(counter)
    results = {}
    try:
        for case in CASES:
            before, start = counter.count, time.perf_counter()
            try:
                outcome = {"value": replica.run_once_per_replica(case)}
            except Exception as error:
                outcome = {"error": type(error).__name__, "message": str(error)}
            outcome |= {"seconds": time.perf_counter() - start, "tracebacks_logged": counter.count - before}
            results[case.__name__] = outcome
    finally:
        logging.getLogger(replica.__name__).removeHandler(counter)
        parallel_state.destroy_model_parallel()
    return results
