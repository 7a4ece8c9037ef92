"""What each process prints on the console: rank 0 everything we log; every other rank only its errors, the
warnings about its own state and those of the user's own code (a reward, tools, an environment), each tagged
`rank N:`; the libraries' notices once, on rank 0, where they are not silenced outright. Set up once, at the top of
each loop's `main`, before any check can warn.

At 8 processes a warning every rank raised for the same reason (a run-wide setting, a data set without a held-out
split) printed 8 times, and so did each library's start-up notice. A rank's errors still reach the console from every
rank, with its number: a failure only rank 5 meets is never hidden behind rank 0.
"""

import contextlib
import logging
import os
import sys
import warnings

# `log.warning(..., extra=ABOUT_THIS_RANK)`: a warning about this rank's own state (its episodes, its shard), printed
# by every rank that meets it, tagged with the rank. Every other warning is a run-wide one, printed by rank 0.
ABOUT_THIS_RANK = {"about_this_rank": True}

# The files of the user's own code the config names (a reward, tools, an environment: `config.user_code.load`). Their
# warnings, logged or Python's, are about what that rank ran (its episodes' calls, its rewards): every rank prints them,
# tagged, as a reward run in a worker process does (the worker's own stderr).
USER_FILES: set[str] = set()

# Our packages print at INFO on rank 0 (the loops' progress lines); the libraries below only errors, on every rank.
OUR_PACKAGES = ("trainer", "config", "model", "data", "ckpt")
QUIET_LIBRARIES = ("megatron", "megatron.core", "megatron.bridge", "transformers", "datasets")


class RankFilter(logging.Filter):
    """On a rank other than 0, lets through only errors and `ABOUT_THIS_RANK` warnings; with several processes, tags
    those (on every rank) with the rank that logged them."""

    def __init__(self, rank: int, world_size: int):
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def filter(self, record: logging.LogRecord) -> bool | logging.LogRecord:
        """The record to print (tagged where it is one rank's), or False to drop it."""
        own = record.levelno >= logging.ERROR or getattr(record, "about_this_rank", False) or from_user_code(record)
        if self.rank != 0 and not own:
            return False
        if not own or self.world_size == 1 or getattr(record, "rank_tagged", False):
            return True
        tagged = logging.makeLogRecord(record.__dict__)  # a copy: other handlers keep the record as logged
        tagged.msg, tagged.args, tagged.rank_tagged = f"rank {self.rank}: {record.getMessage()}", None, True
        return tagged


def from_user_code(record: logging.LogRecord) -> bool:
    """Whether `record` is a warning the user's own code raised: logged from one of `USER_FILES`, or a Python warning
    (`py.warnings`, whose text starts with the file that warned) from one."""
    if record.levelno < logging.WARNING or not USER_FILES:
        return False
    if record.name == "py.warnings":
        text = str(record.args[0]) if record.args else str(record.msg)
        return any(text.startswith(f"{path}:") for path in USER_FILES)
    return record.pathname in USER_FILES


def setup(rank: int | None = None, world_size: int | None = None) -> None:
    """Route this process's console output by rank (see the module's docstring); `rank` and `world_size` default to
    torchrun's RANK and WORLD_SIZE (a process started without torchrun is rank 0 of 1). Safe to call again."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    # Python warnings go through logging (the `py.warnings` logger), so the rank filter applies to them too.
    logging.captureWarnings(True)
    # Deprecation and "X is not installed, falling back" notices from the stack are not actionable here.
    warnings.filterwarnings("ignore", module=r"(megatron|transformers|torch|modelopt)\b")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in OUR_PACKAGES:
        logging.getLogger(name).setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.ERROR)
    # transformers sets its logger's level and handler when it first logs (after this, on a fresh process), from
    # $TRANSFORMERS_VERBOSITY: the level set above would be undone (its "`torch_dtype` is deprecated" line, which
    # Megatron-Bridge 0.6.2 itself triggers, printed once per rank). Where it has set them already, the level stays.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not sys.stdout.isatty():  # a log file: Megatron-Bridge's weight-loading bar prints once there, cut to 80 columns
        with contextlib.suppress(ImportError):
            import rich

            rich.get_console().quiet = True
    rank_filter = RankFilter(rank, world_size)
    # The root logger's console handler (ours), and torch's own, which does not propagate ("No CUDA runtime is found").
    for handler in (*logging.getLogger().handlers, *logging.getLogger("torch").handlers):
        for earlier in [each for each in handler.filters if isinstance(each, RankFilter)]:
            handler.removeFilter(earlier)
        handler.addFilter(rank_filter)
    if world_size > 1:
        sys.excepthook = _tagged_excepthook(rank, sys.__excepthook__)


def _tagged_excepthook(rank: int, print_traceback):
    """`print_traceback` after a line naming the rank: with several processes their tracebacks interleave."""

    def excepthook(kind, error, traceback):
        print(f"rank {rank}: {kind.__name__} (its traceback follows)", file=sys.stderr, flush=True)
        print_traceback(kind, error, traceback)

    return excepthook
