"""Running a turn's tool calls: each episode's calls one after another, in the order the policy wrote them; different
episodes' calls side by side on a bounded pool of `grpo.tool_workers`; every call within `grpo.tool_timeout` seconds
of its own start. A `module:function` reward runs here too (`data.rewards.IsolatedReward`): one call per completion,
its arguments positional and its value (or exception) sent back whole, within `grpo.reward_timeout`.

Where a call runs (`grpo.tool_isolation`):
- `process` (the default for plain functions): in a worker process of this module (`python -m tool_runtime.runner`),
  started on first use and reused; a call past its timeout kills its worker (the next call starts a fresh one), so a
  hung or CPU-bound tool neither holds the trainer's GIL nor outlives its call. The worker imports the tool by its
  `module:function` name and sends back only text.
- `thread`: in a thread of the trainer. Cheapest, but a call past its timeout cannot be stopped: its thread runs on
  (a daemon: it never holds the process at exit), counted in `leaked_tool_threads`.
An environment's methods always run in threads: the instance lives in the trainer. A call of one past its timeout
ends the episode's use of that instance: the rest of its calls are not run, the episode ends, and its `reward()` is
never called while the call may still be running against the state it reads.

A scheduler on the calling thread hands out calls, each on a thread of its own, which first waits for its worker process
when one was started for it: a call's clock starts once its worker is ready, so a slow start (the tool module's imports)
times out no call. Every answer in is taken before any call is judged late. Never raises.
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


# A worker process has this long to start and import the tools before its first call's clock starts anyway (the rest of
# its start then counts against that call).
WORKER_START_SECONDS = 60.0


@dataclasses.dataclass
class Outcome:
    """A tool call's result as the tool message's text, and what it ended as: `ok`, `error`, `timeout` or `unknown_tool`;
    a call with positional arguments (a reward function's) keeps its return value or its exception in `value`."""

    text: str
    kind: str
    value: object = None


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


def call_tool(function: Callable, arguments: dict | tuple) -> Outcome:
    """One call in this process: a tool's (keyword `arguments`) as its text, or its error's; a reward function's (a
    tuple of positional ones) with its value, or its exception, kept. Never raises."""
    try:
        if isinstance(arguments, tuple):
            return Outcome("", "ok", function(*arguments))
        return Outcome(result_text(function(**arguments)), "ok")
    except Exception as error:  # a user's tool may fail in any way
        return Outcome(error_text(error), "error", error if isinstance(arguments, tuple) else None)


def call_within(seconds: float | None, function: Callable, *arguments):
    """`function(*arguments)` on a thread, within `seconds` (None or 0: no limit, on this thread): its value, or its
    exception raised here; past the limit a TimeoutError (the thread cannot be stopped: it runs on as a daemon). An
    environment's `reset`."""
    if not seconds:
        return function(*arguments)
    answer: dict = {}

    def run() -> None:
        try:
            answer["value"] = function(*arguments)
        except BaseException as error:  # noqa: BLE001 - raised again on the caller's thread
            answer["error"] = error

    thread = threading.Thread(target=run, daemon=True, name="environment-reset")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"it did not return within {seconds:g} s (grpo.tool_timeout)")
    if "error" in answer:
        raise answer["error"]
    return answer["value"]


@dataclasses.dataclass
class Running:
    """A call in flight: its number in its job, its worker process (None in a thread) and its clock's start (None while
    its worker starts)."""

    number: int
    worker: "Worker | None" = None
    start: float | None = None


class ToolRunner:
    """Runs tool calls for a rollout; built once per run. `close()` stops its worker processes."""

    def __init__(self, timeout: float, workers: int = 0, isolation: str = "process", preload: list[str] = (),
                 late: str = "the tool did not answer within {:g} s (grpo.tool_timeout)."):
        self.timeout, self.isolation, self.preload, self.late = timeout, isolation, list(preload), late
        self.workers = workers or default_workers()
        self.idle: list[Worker] = []  # worker processes waiting for a call
        self.leaked_threads = 0  # thread calls abandoned at their timeout, still running

    def run(self, jobs: list[Job]) -> list[list[Outcome]]:
        """Per job, its calls' outcomes in order: all of them, or with a stateful job whose call timed out, those up
        to and including the timeout (the rest are not run)."""
        results: list[list[Outcome]] = [[] for _ in jobs]
        waiting = list(range(len(jobs)))  # jobs whose next call may start, in order
        running: dict[int, Running] = {}  # job -> its call in flight
        done: queue.Queue = queue.Queue()  # (job, call number, its clock's start or its Outcome) from the calls' threads
        while waiting or running:
            while waiting and len(running) < self.workers:
                job = waiting.pop(0)
                outcome = self._start(jobs[job], job, len(results[job]), done, running)
                if outcome is not None:  # answered without running (an unknown name)
                    results[job].append(outcome)
                    self._next(jobs, job, results, waiting)
            if not running:
                continue
            starts = [call.start for call in running.values() if call.start is not None]
            # With no clock running every call's worker is starting, and says so within WORKER_START_SECONDS.
            wait = max(0.0, min(starts) + self.timeout - time.monotonic()) if starts else None
            now, messages = _take_all(done, wait)
            for job, number, message in messages:
                call = running.get(job)
                if call is None or call.number != number:  # a timed-out call's late answer
                    continue
                if isinstance(message, Outcome):
                    self._finish(running.pop(job), timed_out=False)
                    results[job].append(message)
                    self._next(jobs, job, results, waiting)
                else:
                    call.start = message
            late = [job for job, call in running.items() if call.start is not None and now - call.start >= self.timeout]
            for job in late:
                self._finish(running.pop(job), timed_out=True)
                results[job].append(Outcome("Error: " + self.late.format(self.timeout), "timeout"))
                if not jobs[job].stateful:
                    self._next(jobs, job, results, waiting)
        return results

    @staticmethod
    def _next(jobs: list[Job], job: int, results: list, waiting: list[int]) -> None:
        """Queue the job's next call, if it has one."""
        if len(results[job]) < len(jobs[job].calls):
            waiting.append(job)

    def _start(self, job: Job, index: int, number: int, done: queue.Queue, running: dict) -> Outcome | None:
        """Start call `number` of a job on a thread of its own (isolated, in an idle worker process or a new one); an
        unknown name's outcome."""
        name, function, spec, arguments = job.calls[number]
        if function is None:
            return Outcome(f"Error: unknown tool {name!r}; the tools are {', '.join(sorted(job.tool_names))}.", "unknown_tool")
        worker = None
        if spec is not None and self.isolation == "process":
            # Started here, on a thread that outlives it: a worker's parent-death signal follows the thread that started it.
            worker = self.idle.pop() if self.idle else Worker(self.preload)
        running[index] = Running(number, worker)

        def run_call() -> None:
            """The call's thread: its worker's imports (waited for here, where no other answer waits), clock, outcome.
            Whatever fails here is the call's error outcome: a thread that ended without one would leave `run`
            waiting for it forever."""
            try:
                if worker is not None:
                    worker.wait_ready()
                done.put((index, number, time.monotonic()))
                outcome = call_tool(function, arguments) if worker is None else worker.call(spec, arguments)
            except BaseException as error:  # noqa: BLE001 - reported as the call's outcome, and logged
                log.exception("running tool %s failed", name)
                done.put((index, number, time.monotonic()))
                outcome = Outcome(f"Error: the tool could not be run ({type(error).__name__}: {error}).", "error")
            done.put((index, number, outcome))

        threading.Thread(target=run_call, daemon=True, name=f"tool-call-{index}").start()
        return None

    def _finish(self, call: Running, timed_out: bool) -> None:
        """A call's end: its worker back to the pool, or at a timeout killed (a thread call left to run, counted)."""
        worker = call.worker
        if worker is None:
            if timed_out:
                self.leaked_threads += 1
                if self.leaked_threads == 1:  # said once: a thread cannot be stopped
                    log.warning("a call ran past grpo.tool_timeout in a thread (an environment's method, or a tool under "
                                "grpo.tool_isolation=thread): its thread cannot be stopped and runs on beside training, "
                                "holding the GIL while it computes; a plain function's call under "
                                "`--grpo.tool_isolation=process` is killed instead")
        elif timed_out or not worker.alive():
            worker.kill()
        else:
            self.idle.append(worker)

    def close(self) -> None:
        """Stop the idle worker processes."""
        for worker in self.idle:
            worker.kill()
        self.idle = []


def _take_all(done: queue.Queue, wait: float | None) -> tuple[float, list]:
    """The messages in `done` once one comes (or `wait` seconds pass; None: no limit), and the time to judge deadlines
    by: taken before the queue is emptied, so no answer put before it is ever judged a timeout."""
    messages = []
    try:
        messages.append(done.get(timeout=wait))
    except queue.Empty:
        pass
    now = time.monotonic()
    while True:
        try:
            messages.append(done.get_nowait())
        except queue.Empty:
            return now, messages


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


def _readable(stream, seconds: float) -> bool:
    """Whether `stream` has something to read within `seconds`: `poll`, which takes any descriptor (`select` raises for
    one numbered 1024 or more, as in a process holding many files, and the call's thread died with it)."""
    poller = select.poll()
    poller.register(stream, select.POLLIN)
    return bool(poller.poll(seconds * 1000))


class Worker:
    """A worker process running plain-function tools by name: a new session (a terminal's Ctrl-C reaches the trainer,
    which finishes its step, not the worker), gone with its trainer (its stdin closes, and the parent-death signal,
    sent when the thread that started it ends). Built starting: it imports the tool modules of `preload` while the
    caller goes on, until `wait_ready`."""

    def __init__(self, preload: list[str]):
        self.process = subprocess.Popen([sys.executable, "-m", "tool_runtime.runner"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True, cwd=os.getcwd(),
                                        env=worker_environment())
        self.ready = False  # whether its "ready" was read: a start past WORKER_START_SECONDS leaves it to the first call
        self.broken = False  # a call found its pipes closed
        try:  # the trainer's import path, so the user's tool modules import alike, and the modules to import now
            _send(self.process.stdin, (list(sys.path), preload))
        except OSError:  # a worker that could not start: its first call says so
            pass

    def wait_ready(self) -> None:
        """Wait until the worker has imported the tool modules, at most WORKER_START_SECONDS."""
        try:
            if not self.ready and _readable(self.process.stdout, WORKER_START_SECONDS):
                _receive(self.process.stdout)
                self.ready = True
        except (EOFError, OSError):  # a worker that could not start: its first call says so
            pass

    def call(self, spec: str, arguments: dict | tuple) -> Outcome:
        """Run `spec(**arguments)` (a tuple: `spec(*arguments)`) in the worker; a dead worker's outcome is an error."""
        try:
            _send(self.process.stdin, (spec, arguments))
            if not self.ready:  # "ready" comes first, never to be taken for the answer
                _receive(self.process.stdout)
                self.ready = True
            return Outcome(*_receive(self.process.stdout))
        except pickle.PickleError as error:  # nothing half-sent or half-read: the worker goes on
            return Outcome(f"Error: the call could not be passed to or from its worker process ({error}).", "error")
        except (EOFError, OSError) as error:
            self.broken = True  # its pipe is gone even while its process is still exiting: never reused
            try:  # it is exiting: its status says how
                code = self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
            why = f"exit status {code}" if code is not None else f"{type(error).__name__}: {error}"
            return Outcome(f"Error: the worker process running it ended ({why}).", "error")

    def alive(self) -> bool:
        """Whether the process still runs and its pipes still carry calls."""
        return not self.broken and self.process.poll() is None

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


def worker_environment() -> dict[str, str]:
    """The trainer's environment, with only its own GPU visible when it uses one: user code in a worker that touches
    CUDA (a model moved to "cuda" at import) then lands on the rank's GPU, not every rank's workers on the node's first."""
    environment = dict(os.environ)
    torch = sys.modules.get("torch")  # never imported here: a trainer without it has no GPU to share
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        visible = [device for device in environment.get("CUDA_VISIBLE_DEVICES", "").split(",") if device.strip()]
        environment["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
    return environment


def sendable(outcome: Outcome) -> tuple:
    """`(text, kind, value)` of an outcome, the value left out (said in the text) when it would not arrive whole: what
    pickle cannot write, or an exception it cannot read back (one whose constructor takes other arguments)."""
    try:
        pickle.loads(pickle.dumps(outcome.value))
        return outcome.text, outcome.kind, outcome.value
    except Exception as error:  # noqa: BLE001 - any value a user's function returns
        if outcome.kind == "ok":
            return f"Error: its return value could not be sent from the worker process ({error}).", "error", None
        return outcome.text, outcome.kind, None


def worker_main() -> None:
    """A worker process's loop: read (spec, arguments), answer (text, kind, value), until the trainer closes the pipe."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed when the trainer dies
    except (OSError, AttributeError):  # not Linux: stdin closing still ends the loop
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when to stop
    # The pipes move to descriptors of their own; 0 and 1, which every program a tool starts inherits (a shell command,
    # a C library's printf), become empty input and the log (stderr): nothing a tool runs reads a request or writes
    # into an answer, where a stray byte would leave the trainer waiting for an answer that never ends.
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    empty = os.open(os.devnull, os.O_RDONLY)
    os.dup2(empty, 0)
    os.close(empty)
    os.dup2(2, 1)
    sys.stdout = sys.stderr  # Python's own prints line-buffered, in order with the log's lines
    path, preload = _receive(requests)
    sys.path[:] = path
    import importlib

    def load(spec: str):  # `module:function`, which imported in the trainer
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name)

    functions = {}
    for spec in preload:
        try:
            functions[spec] = load(spec)
        except Exception:  # said by the call that needs it
            pass
    _send(answers, "ready")
    while True:
        try:
            spec, arguments = _receive(requests)
        except EOFError:
            return
        try:
            if spec not in functions:
                functions[spec] = load(spec)
            outcome = call_tool(functions[spec], arguments)
        except Exception as error:  # the module failed to import here (it imported in the trainer)
            outcome = Outcome(error_text(error), "error", error if isinstance(arguments, tuple) else None)
        _send(answers, sendable(outcome))


if __name__ == "__main__":
    worker_main()
