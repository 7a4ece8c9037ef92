"""Running a turn's tool calls: each episode's calls one after another, in the order the policy wrote them; different
episodes' calls side by side on a bounded pool of `grpo.tool_workers`; every call within `grpo.tool_timeout` seconds
of its own start. A `module:function` reward runs here too (`data.rewards.IsolatedReward`): one call per completion,
its arguments positional and its value (or exception) sent back whole, within `grpo.reward_timeout`.

Where a call runs (`grpo.tool_isolation`):
- `process` (the default for plain functions): in a worker process (`tool_runtime.worker`, a module run by `python -m`),
  started on first use and reused; a call past its timeout kills its worker (the next call starts a fresh one), so a
  hung or CPU-bound tool neither holds the trainer's GIL nor outlives its call. The worker imports the tool by its
  `module:function` name and sends back only text.
- `thread`: in a thread of the trainer. Cheapest, but a call past its timeout cannot be stopped: its thread runs on
  (a daemon: it never holds the process at exit), counted in `ToolRunner.leaked_threads` and said once, by the rank
  whose call it was (its threads hold its GIL: `config.console.ABOUT_THIS_RANK`).
An environment's methods always run in threads: the instance lives in the trainer. A call of one past its timeout
ends the episode's use of that instance: the rest of its calls are not run, the episode ends, and its `reward()` is
never called while the call may still be running against the state it reads. Its `reward()` runs on the trainer's
main thread (graders that time themselves with signals work only there), within `grpo.reward_timeout` by a SIGALRM
timer (`call_on_main_thread_within`).

A scheduler on the calling thread hands out calls, each on a thread of its own, which first waits for its worker process
when one was started for it: a call's clock starts once its worker is ready, so a slow start (the tool module's imports)
times out no call. Every answer in is taken before any call is judged late. Never raises.
"""

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable

from config import console
from tool_runtime.worker import Outcome, Worker, awaited, call_tool

log = logging.getLogger(__name__)


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


def call_on_main_thread_within(seconds: float, function: Callable, late: str):
    """`function()` on this thread, stopped by a TimeoutError(`late`) raised in it after `seconds` (a SIGALRM timer);
    off the main thread, or at 0, with no limit. A function that sets an alarm of its own (math_verify's graders do)
    replaces this one while it runs: its own limit holds. An environment's `reward()` (an `async def` one awaited)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        return awaited(function())
    armed = True

    def expire(signum, frame):
        if armed:
            raise TimeoutError(late)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return awaited(function())
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
                                "`--grpo.tool_isolation=process` is killed instead", extra=console.ABOUT_THIS_RANK)
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
