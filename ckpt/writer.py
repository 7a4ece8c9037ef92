"""The background checkpoint writer: a forked process per save, through megatron-core's `AsyncCallsQueue`.

The writer dies with the trainer (PR_SET_PDEATHSIG), and its results, or its failure with the error text it
logged, come back through a file (`WriteResults`), which a synchronous save uses too.
"""

import contextlib
import logging
import os
import pickle
import queue
import signal
import tempfile


class BackgroundSaves:
    """Checkpoint writes in flight, through megatron-core's `AsyncCallsQueue`: each save's write runs in a process
    forked from this one (megatron-core's `TemporalAsyncCaller`; on a GPU the tensors are first copied to host memory,
    on a CPU the fork's copy-on-write pages are the snapshot), and its finalize functions (the checkpoint's index,
    then `save`'s publish: rename, `latest`, prune) run on every rank once every rank's writer has finished.
    `finish` is collective while a save is in flight."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.calls = AsyncCallsQueue(persistent=False)

    def start(self, request, finalize) -> None:
        """Start writing `request` (megatron-core's AsyncRequest) in the background; `finalize` runs when done."""
        if request.async_fn is not None:  # None: this rank has nothing to write
            request = request._replace(async_fn=_in_writer_process(request.async_fn, os.getpid()))
        self.calls.schedule_async_request(request._replace(finalize_fns=[finalize]))

    def pending(self) -> bool:
        """Whether a save is written or waits to be finalized (the same on every rank)."""
        return self.calls.get_num_unfinalized_calls() > 0

    def finish(self, wait: bool) -> None:
        """Finalize every save whose write has finished on every rank; with `wait`, wait for all of them first."""
        if self.pending():
            self.calls.maybe_finalize_async_calls(blocking=wait)


def _in_writer_process(write, trainer_pid: int):
    """megatron-core's write function as the forked writer process runs it: it dies with the trainer (a writer left
    behind by a trainer killed with -9 would go on writing into a checkpoint the next start-up deletes), and what its
    threads log on failure comes back in the results (`WriteResults`) instead of on the console."""

    def run(*args, **kwargs):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not Linux: the writer outlives a killed trainer, and finishes its write
            pass
        if os.getppid() != trainer_pid:  # the trainer died before the line above
            os._exit(1)
        try:
            with WriteResults._installed.capturing():
                write(*args, **kwargs)
        except BaseException:  # no results: the finalize step reports the failed write
            os._exit(1)

    return run


class WriteResults:
    """The channel megatron-core's checkpoint writer hands its results (or its exception) back through: a file.

    megatron-core 0.19.2 writes a checkpoint's shards in `write_preloaded_data_multithread`, in this process for a
    synchronous save and in a forked one for an asynchronous save, and hands the results to the finalize step through
    a module-level queue it otherwise creates as a multiprocessing Manager queue with the 'spawn' start method: a new
    Python process per rank that re-imports the main module (8.6 s on the first save here) and outlives a trainer
    killed with -9. A plain pipe would not do either: a writer whose results exceed the pipe's buffer (64 KiB, about
    300 tensors' results) blocks at exit until they are read, and they are read only after it exits. So the writer
    puts them into a file in the temporary directory (not on the checkpoint's disk, which may be the one that is
    full), and the finalize step reads and empties it: results that are missing or unreadable are a failed write.
    The file has no name: opened nameless at the first save (O_TMPFILE, or unlinked at once where the OS lacks it)
    and inherited by each forked writer, it goes when the trainer's last descriptor does, so a killed trainer
    leaves nothing in /tmp (a named file per process did, a few KB each), and trainers sharing /tmp cannot mix
    results. A second save waits for the first. A writer's failure comes back with the error text the writer only
    logged (`[Errno 28] No space left on device`), as an OSError, which the finalize step's exception names.
    """

    _installed = None

    def __init__(self):
        self.file = tempfile.TemporaryFile()
        self.logged = []

    @classmethod
    def install(cls) -> "WriteResults":
        """Make this process's channel megatron-core's queue, for the save about to be written."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if cls._installed is None:
            cls._installed = cls()
        filesystem_async._results_queue = cls._installed
        os.ftruncate(cls._installed.file.fileno(), 0)
        cls._installed.logged = []
        return cls._installed

    @contextlib.contextmanager
    def capturing(self):
        """Keep what the writer logs inside the block for `put` (one paragraph later, no lines of the writer's own)."""
        with _writer_errors() as self.logged:
            yield

    def put(self, results) -> None:
        """Called by the writer (in the writing process): the results, or its exception with what it logged. Never
        raises: results it cannot write (the temporary directory full too) are missing, which is a failed write."""
        if isinstance(results, Exception):
            # The writer's summary names no cause (`error: <class 'OSError'>`); its log has the OSError's text.
            cause = next((text for text in self.logged if "[Errno" in text), self.logged[0] if self.logged else None)
            if cause is not None:
                text = cause.rpartition("an error: ")[2]
                results = (OSError if "[Errno" in text else RuntimeError)(text)
        descriptor = self.file.fileno()
        try:
            data = pickle.dumps(results)
            if os.pwrite(descriptor, data, 0) != len(data):
                raise OSError("short write")
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(descriptor, 0)

    def get_nowait(self):
        """Called by the finalize step: what the writer put (read once: the file is emptied)."""
        descriptor = self.file.fileno()
        size = os.fstat(descriptor).st_size
        if size == 0:
            raise queue.Empty
        try:
            results = pickle.loads(os.pread(descriptor, size, 0))
        except Exception as error:  # a results file the writer could not finish
            results = RuntimeError(f"the checkpoint writer's results are unreadable ({type(error).__name__})")
        os.ftruncate(descriptor, 0)
        return results


# megatron-core's checkpoint writer logs each writer thread's exception here (an OSError's text among them) and then
# raises a summary without it.
WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


@contextlib.contextmanager
def _writer_errors():
    """The error messages megatron-core's checkpoint writer logs inside the block, kept for the failure paragraph
    instead of printed (one paragraph, no lines of the writer's own)."""
    messages = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: messages.append(record.getMessage())
    writer_log = logging.getLogger(WRITER_LOGGER)
    propagate = writer_log.propagate
    writer_log.addHandler(handler)
    writer_log.propagate = False
    try:
        yield messages
    finally:
        writer_log.removeHandler(handler)
        writer_log.propagate = propagate
