"""Running a turn's tool calls: each episode's calls one after another, in the order the policy wrote them; different
episodes' calls side by side on a bounded pool of `grpo.tool_workers`; every call within `grpo.tool_timeout` seconds
of its own start.

Where a call runs (`grpo.tool_isolation`):
- `process` (the default for plain functions): in a worker process of this module (`python -m data.tool_runner`),
  started on first use and reused; a call past its timeout kills its worker (the next call starts a fresh one), so a
  hung or CPU-bound tool neither holds the trainer's GIL nor outlives its call. The worker imports the tool by its
  `module:function` name and sends back only text.
- `thread`: in a thread of the trainer. Cheapest, but a call past its timeout cannot be stopped: its thread runs on
  (a daemon: it never holds the process at exit), counted in `leaked_tool_threads`.
An environment's methods always run in threads: the instance lives in the trainer. A call of one past its timeout
ends the episode's use of that instance: the rest of its calls are not run, the episode ends, and its `reward()` is
never called while the call may still be running against the state it reads.

A scheduler on the calling thread hands out calls and waits for the first to finish or time out; never raises.
"""

import dataclasses
import logging
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


# A worker process has this long to start and import the tools before its first call is sent anyway.
WORKER_START_SECONDS = 60.0


@dataclasses.dataclass
class Outcome:
    """A tool call's result as the tool message's text, and what it ended as: `ok`, `error`, `timeout` or `unknown_tool`."""

    text: str
    kind: str


@dataclasses.dataclass
class Job:
    """One episode's calls of a turn, in order: (name, function or None when unknown, `module:function` or None for an
    environment's method, arguments) each; `stateful` when they run against an environment instance (a timeout then
    ends the episode)."""

    calls: list[tuple[str, Callable | None, str | None, dict]]
    stateful: bool
    tool_names: list[str]  # the episode's tools, named in an unknown name's error


def default_workers() -> int:
    """`grpo.tool_workers=0`: this rank's share of the machine's cores (those it may run on, over the ranks started
    on this node), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def result_text(result) -> str:
    """A tool's return value as the tool message's text: strings as they are, anything else as JSON where it can be."""
    import json

    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def error_text(error: BaseException) -> str:
    """The tool message of a call that raised (as TRL and verl do): its type and message."""
    return f"Error: {type(error).__name__}: {error}"


def call_tool(function: Callable, arguments: dict) -> Outcome:
    """One call in this process: its text, or its error's; never raises."""
    try:
        return Outcome(result_text(function(**arguments)), "ok")
    except Exception as error:  # a user's tool may fail in any way
        return Outcome(error_text(error), "error")


class ToolRunner:
    """Runs tool calls for a rollout; built once per run. `close()` stops its worker processes."""

    def __init__(self, timeout: float, workers: int = 0, isolation: str = "process", preload: list[str] = ()):
        self.timeout, self.isolation, self.preload = timeout, isolation, list(preload)
        self.workers = workers or default_workers()
        self.idle: list[Worker] = []  # worker processes waiting for a call
        self.leaked_threads = 0  # thread calls abandoned at their timeout, still running

    def run(self, jobs: list[Job]) -> list[list[Outcome]]:
        """Per job, its calls' outcomes in order: all of them, or with a stateful job whose call timed out, those up
        to and including the timeout (the rest are not run)."""
        results: list[list[Outcome]] = [[] for _ in jobs]
        waiting = list(range(len(jobs)))  # jobs whose next call may start, in order
        running: dict[int, tuple[float, object]] = {}  # job -> (the call's start, its handle)
        done: queue.Queue = queue.Queue()  # (job, call number, outcome) from the threads running calls
        while waiting or running:
            while waiting and len(running) < self.workers:
                job = waiting.pop(0)
                outcome = self._start(jobs[job], job, len(results[job]), done, running)
                if outcome is not None:  # answered without running (an unknown name)
                    results[job].append(outcome)
                    self._next(jobs, job, results, waiting)
            if not running:
                continue
            first_deadline = min(start for start, _ in running.values()) + self.timeout
            try:
                job, number, outcome = done.get(timeout=max(0.0, first_deadline - time.monotonic()))
            except queue.Empty:
                job, number, outcome = None, None, None
            if job is not None and job in running and number == len(results[job]):
                self._finish(running.pop(job)[1], timed_out=False)
                results[job].append(outcome)
                self._next(jobs, job, results, waiting)
            now = time.monotonic()
            for job in [job for job, (start, _) in running.items() if now - start >= self.timeout]:
                self._finish(running.pop(job)[1], timed_out=True)
                results[job].append(Outcome(f"Error: the tool did not answer within {self.timeout:g} s "
                                            "(grpo.tool_timeout).", "timeout"))
                if not jobs[job].stateful:
                    self._next(jobs, job, results, waiting)
        return results

    @staticmethod
    def _next(jobs: list[Job], job: int, results: list, waiting: list[int]) -> None:
        """Queue the job's next call, if it has one."""
        if len(results[job]) < len(jobs[job].calls):
            waiting.append(job)

    def _start(self, job: Job, index: int, number: int, done: queue.Queue, running: dict) -> Outcome | None:
        """Start call `number` of a job on a thread (and, isolated, in a worker process); an unknown name's outcome."""
        name, function, spec, arguments = job.calls[number]
        if function is None:
            return Outcome(f"Error: unknown tool {name!r}; the tools are {', '.join(sorted(job.tool_names))}.", "unknown_tool")
        worker = None
        if spec is not None and self.isolation == "process":
            worker = self.idle.pop() if self.idle else Worker(self.preload)  # ready before the call's clock starts
            target = lambda: worker.call(spec, arguments)  # noqa: E731: the worker answers with an Outcome
        else:
            target = lambda: call_tool(function, arguments)  # noqa: E731
        thread = threading.Thread(target=lambda: done.put((index, number, target())), daemon=True,
                                  name=f"tool-call-{index}")
        running[index] = (time.monotonic(), (thread, worker))
        thread.start()
        return None

    def _finish(self, handle: tuple, timed_out: bool) -> None:
        """A call's end: its worker back to the pool, or at a timeout killed (a thread call left to run, counted)."""
        thread, worker = handle
        if worker is None:
            if timed_out:
                self.leaked_threads += 1
                if self.leaked_threads == 1:  # said once: a thread cannot be stopped
                    log.warning("a tool call ran past grpo.tool_timeout in a thread (grpo.tool_isolation=thread): its "
                                "thread cannot be stopped and runs on beside training, holding the GIL while it computes; "
                                "`--grpo.tool_isolation=process` kills such a call")
        elif timed_out or not worker.alive():
            worker.kill()
        else:
            self.idle.append(worker)

    def close(self) -> None:
        """Stop the idle worker processes."""
        for worker in self.idle:
            worker.kill()
        self.idle = []


# ---------------------------------------------------------------- worker processes


def _send(stream, value) -> None:
    """One length-prefixed pickle."""
    data = pickle.dumps(value)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    """One length-prefixed pickle; EOFError when the other end is gone."""
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


class Worker:
    """A worker process running plain-function tools by name: a new session (a terminal's Ctrl-C reaches the trainer,
    which finishes its step, not the worker), gone with its trainer (its stdin closes, and the parent-death signal).
    Built ready: the tool modules of `preload` imported, so no call's timeout pays for the start."""

    def __init__(self, preload: list[str]):
        self.process = subprocess.Popen([sys.executable, "-m", "data.tool_runner"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True, cwd=os.getcwd())
        try:  # the trainer's import path, so the user's tool modules import alike, and the modules to import now
            _send(self.process.stdin, (list(sys.path), preload))
            ready, _, _ = select.select([self.process.stdout], [], [], WORKER_START_SECONDS)
            if ready:
                _receive(self.process.stdout)
        except (EOFError, OSError):  # a worker that could not start: its first call says so
            pass

    def call(self, spec: str, arguments: dict) -> Outcome:
        """Run `spec(**arguments)` in the worker; a dead worker's outcome is an error."""
        try:
            _send(self.process.stdin, (spec, arguments))
            kind, text = _receive(self.process.stdout)
            return Outcome(text, kind)
        except (EOFError, OSError, pickle.PickleError) as error:
            code = self.process.poll()
            return Outcome(f"Error: the tool's worker process ended ({'exit status ' + str(code) if code is not None else error}).",
                           "error")

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.poll() is None

    def kill(self) -> None:
        """Kill the worker and whatever it started (its session), and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:  # its stdout is left to the thread that may be reading it: it reads the end of the pipe and returns
            self.process.stdin.close()
        except OSError:
            pass
        self.process.wait()


def worker_main() -> None:
    """A worker process's loop: read (spec, arguments), answer (kind, text), until the trainer closes the pipe."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed when the trainer dies
    except (OSError, AttributeError):  # not Linux: stdin closing still ends the loop
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when to stop
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a tool's prints go to the log, never into the answers' pipe
    path, preload = _receive(stdin)
    sys.path[:] = path
    from data import user_code

    functions = {}
    for spec in preload:
        try:
            functions[spec] = user_code.load(spec, "grpo.tools", "")
        except Exception:  # said by the call that needs it
            pass
    _send(stdout, "ready")
    while True:
        try:
            spec, arguments = _receive(stdin)
        except EOFError:
            return
        try:
            if spec not in functions:
                functions[spec] = user_code.load(spec, "grpo.tools", "")
            outcome = call_tool(functions[spec], arguments)
        except Exception as error:  # the module failed to import here (it imported in the trainer)
            outcome = Outcome(error_text(error), "error")
        _send(stdout, (outcome.kind, outcome.text))


if __name__ == "__main__":
    worker_main()
