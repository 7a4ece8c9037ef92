"""A worker process of the tool runtime (`python -m tool_runtime.worker`): it imports plain-function tools (and
`module:function` rewards) by name and runs one call at a time, each answered as an `Outcome`; `tool_runtime.runner`
starts, reuses and kills workers. Started with the trainer's import path, its own session, and, on a GPU rank, only
that rank's GPU visible; gone with its trainer.
"""

import dataclasses
import inspect
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
from collections.abc import Callable

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


def result_text(result) -> str:
    """A tool's return value as the tool message's text: strings as they are, anything else as JSON where it can be
    (numpy's numbers and arrays as the values they hold: `{"temp": 21}`, not `{'temp': np.int64(21)}`), else `str`."""
    import json

    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, default=numpy_value)
    except (TypeError, ValueError):
        return str(result)


def numpy_value(value):
    """`json.dumps`'s fallback: a numpy scalar's or array's plain value (`tolist`); a TypeError for anything else."""
    numpy = sys.modules.get("numpy")  # a value of numpy's means the tool imported it
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def error_text(error: BaseException) -> str:
    """The tool message of a call that raised (as TRL and verl do): its type and message."""
    return f"Error: {type(error).__name__}: {error}"


RAISED_AT = "raised at "  # the note `note_where_raised` adds to an exception


def where_raised(error: BaseException, own_file: str | None) -> str:
    """`FILE, line N`: the innermost frame of `error`'s traceback in `own_file` (the user's code, not a library it
    called into); "" when none of its frames is there (or it has no traceback)."""
    import traceback

    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if own_file and frame.filename == own_file]
    return f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else ""


def note_where_raised(error: BaseException, function: Callable) -> BaseException:
    """`error` with a note naming where in `function`'s own file it was raised (`raised at FILE, line N`), if there:
    a note travels with the exception through pickle, where its traceback does not."""
    where = where_raised(error, getattr(getattr(function, "__code__", None), "co_filename", None))
    if where:
        error.add_note(RAISED_AT + where)
    return error


def awaited(value):
    """`value`, or what it returns when it is a coroutine (an `async def` tool, as TRL takes), run to its end on an event
    loop of this thread (a call's thread, or a worker's)."""
    if inspect.iscoroutine(value):
        import asyncio

        return asyncio.run(value)
    return value


def call_tool(function: Callable, arguments: dict | tuple) -> Outcome:
    """One call in this process: a tool's (keyword `arguments`) as its text, or its error's; a reward function's (a
    tuple of positional ones) with its value, or its exception (noted where it was raised), kept; an `async def`
    function's awaited. Never raises."""
    try:
        if isinstance(arguments, tuple):
            return Outcome("", "ok", awaited(function(*arguments)))
        return Outcome(result_text(awaited(function(**arguments))), "ok")
    except Exception as error:  # a user's tool may fail in any way
        return Outcome(error_text(error), "error",
                       note_where_raised(error, function) if isinstance(arguments, tuple) else None)


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
        self.process = subprocess.Popen([sys.executable, "-m", "tool_runtime.worker"], stdin=subprocess.PIPE,
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

    def only_this_process() -> None:
        """End a fork of this worker that came back here from a tool (or an import): it shares the pipes, and its
        answer would be taken for the next call's, and it would read calls meant for the worker."""
        if os.getpid() != worker:
            os._exit(0)

    worker, functions = os.getpid(), {}
    for spec in preload:
        try:
            functions[spec] = load(spec)
        except Exception:  # said by the call that needs it
            pass
    only_this_process()
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
        only_this_process()
        _send(answers, sendable(outcome))


if __name__ == "__main__":
    worker_main()
