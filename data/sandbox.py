"""The bundled tool `data.sandbox:python`: it runs a model-written Python program, as in ToRL and ReTool.

What it isolates: each call runs in a fresh process (`python -I`) in a fresh temporary directory (its cwd, deleted
afterwards) with a minimal environment, under CPU-time, address-space, process-count (threads count), file-size and
open-file limits, with no new privileges; its supervisor kills it at the wall timeout (whether or not the caller still
waits), what it prints is cut, and every process it started is killed and reaped when it ends. A root-run trainer runs
it as the user nobody, so that the process limit counts; where the OS refuses that switch (a user namespace that maps
no uid 65534) it runs nothing, answers why, and logs that once. Where the OS allows them it also gets a network
namespace of its own (no network at all) and a Landlock rule that lets it write, make and remove files only beneath
its directory (so multiprocessing's semaphores in /dev/shm are refused); `run(...).isolation` lists what a call got,
and `scripts/bench/bench_sandbox.py` prints it for a machine. What it does not isolate: reading files (it reads what any user
may, or the trainer's user; where the interpreter is readable to root only, as under /root, nobody keeps the capability
to read everything), system calls (no seccomp), the kernel, the programs of concurrent calls from each other (one user
runs them all: they share its process limit and may signal each other), and in a non-root run a program that kills
its own supervisor or the trainer. RLIMIT_AS limits each process, not a program's processes together. It keeps a well-meaning model's mistakes (endless loops, memory and fork bombs, huge prints, stray writes)
from harming the trainer; it is NOT a security boundary against hostile code, which needs a container or a VM (gVisor,
Firecracker).
"""

import dataclasses
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from config import console

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 5.0
CPU_SECONDS = 5
MEMORY_MB = 1024  # of address space: numpy and sympy fit; `import torch` (CUDA build) needs run(..., memory_mb=8192)
MAX_PROCESSES = 64  # more than its user (nobody, under a root trainer) already runs; threads count too
MAX_OUTPUT_CHARS = 4000
FILE_SIZE_MB = 16
MAX_OPEN_FILES = 64
# Past this many bytes of stdout and stderr together the program is stopped: `print('x' * 10**8)` neither fills the
# trainer's memory nor blocks on a full pipe.
READ_LIMIT_BYTES = 1_000_000
ERROR_LINE_CHARS = 1000  # an exception may carry a megabyte of message
# How long the supervisor may take to kill and reap the program once asked or past its deadline, before it is stopped
# from outside.
STOP_GRACE_SECONDS = 2.0
NOBODY = 65534

# Runs as `python -I -u -B -c LAUNCHER settings`, so it imports nothing of ours. Forking a worker rather than using
# preexec_fn keeps the trainer's threads out of it. The launcher stays behind as the worker's supervisor: a child
# subreaper, so orphans of the program's processes (forks whose parent exited, ones that left with setsid) come to it,
# are killed and reaped; it keeps the program's wall time; a root launcher cannot be signalled by the program it
# supervises. It tells the caller what it must know in lines on the status pipe (see `run`).
LAUNCHER = r'''
import ctypes, json, os, resource, signal, struct, sys, time, types

settings = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_KEEPCAPS, PR_SET_CHILD_SUBREAPER = 1, 38, 8, 36
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
worker = 0

def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:  # it ended already
        pass

def tell(message):
    """Send the caller one line of the status pipe."""
    try:
        os.write(settings["status_fd"], message.encode("utf-8", "replace") + b"\n")
    except OSError:  # the caller is gone (its signal comes), or the program filled or closed the pipe
        pass

def remove_directory_if_orphaned():
    """Remove the program's directory if the caller, who would, is gone (a tool worker killed at grpo.tool_timeout)."""
    if os.getppid() != settings["caller"]:
        import shutil
        shutil.rmtree(os.path.dirname(settings["path"]), ignore_errors=True)

def stop_now(*_):
    """SIGTERM: the trainer's "stop now" or, as the parent-death signal, the caller's death."""
    if worker:
        kill(-worker)  # supervise() then reaps what is left and ends
    else:  # the program has not started
        remove_directory_if_orphaned()
        os._exit(128 + signal.SIGTERM)

def time_out(*_):
    """SIGALRM at the deadline: kill the program and tell the caller why."""
    kill(-worker)
    tell("timeout")

def processes():
    """(pid, parent pid, real uid, threads) of every process."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as file:
                fields = dict(line.split(":", 1) for line in file)
        except OSError:  # it ended meanwhile
            continue
        yield int(pid), int(fields["PPid"]), int(fields["Uid"].split()[0]), int(fields["Threads"])

def supervise():
    """Wait for the worker until its deadline, kill and reap every process it left, and end as the worker did."""
    try:
        os.setpgid(worker, worker)  # as the worker does, so that neither waits on the other
    except OSError:
        pass
    # The caller's deadline, on the monotonic clock every process shares, kept here: the program ends at its wall time
    # even when nobody waits for it.
    signal.signal(signal.SIGALRM, time_out)
    signal.setitimer(signal.ITIMER_REAL, max(settings["deadline"] - time.monotonic(), 0.001))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # now that the worker's group exists
    _, status = os.waitpid(worker, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    while True:
        kill(-worker)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:  # alive outside the worker's group (setsid): kill orphans by pid
                for pid, parent, _, _ in processes():
                    if parent == os.getpid():
                        kill(pid)
                time.sleep(0.01)
        except ChildProcessError:  # none left
            break
    remove_directory_if_orphaned()
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # die of the worker's signal, so the trainer reads it from the exit status
        if code != -signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)

def world_searchable(path):
    """Whether anyone may pass through every directory down to `path`."""
    while path != "/":
        if not os.stat(path).st_mode & 0o001:
            return False
        path = os.path.dirname(path)
    return True

def landlock(directory):
    """Let files be written, made and removed only beneath `directory` (and /dev/null); False if unavailable."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        return False
    abi = libc.syscall(444, None, 0, 1)
    if abi < 1:
        return False
    file_rights = 1 << 1 | (1 << 14 if abi >= 3 else 0)  # write, truncate
    rights = file_rights | sum(1 << bit for bit in range(4, 13)) | (1 << 13 if abi >= 2 else 0)  # remove, make; refer
    ruleset = libc.syscall(444, struct.pack("=Q", rights), 8, 0)
    if ruleset < 0:
        return False
    added = True
    for path, allowed in ((directory, rights), ("/dev/null", file_rights)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        added = libc.syscall(445, ruleset, 1, struct.pack("=Qi", allowed, fd), 0) == 0 and added
        os.close(fd)
    applied = added and libc.syscall(446, ruleset, 0) == 0
    os.close(ruleset)
    return applied

def report(kind, value, trace):
    """Print the traceback as Python does, and send this process's error line (not a fork's, whose stderr it shares)."""
    sys.__excepthook__(kind, value, trace)
    if os.getpid() == worker_pid:
        try:
            import traceback
            # The exception's own line: after a SyntaxError's source lines, before any notes, its message's first line.
            lines = traceback.format_exception_only(kind, value)
            line = next(line for line in lines if not line.startswith(" ")).strip().splitlines()[0]
            tell("error " + line[:settings["error_chars"]])
        except Exception:  # out of memory: its stderr's last line stands
            pass

signal.signal(signal.SIGTERM, stop_now)
# The caller gone (a tool worker killed at grpo.tool_timeout, a trainer killed) is a "stop now" too. The signal watches
# the parent of the moment, so a caller that died while this interpreter started (we have another parent) is one too.
libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
if os.getppid() != settings["caller"]:
    stop_now()
libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# Held over the fork, so that a "stop now" lands before it (nothing to kill) or where the worker is known, not between.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
worker = os.fork()
if worker:
    supervise()
os.setpgid(0, 0)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
path, directory, root = settings["path"], os.path.dirname(settings["path"]), os.getuid() == 0
with open(path, "rb") as file:
    source = file.read()
# RLIMIT_NPROC counts every task (threads too) of the real user; counted before a user namespace hides the uids.
uid = settings["nobody"] if root else os.getuid()
tasks = sum(threads for _, _, owner, threads in processes() if owner == uid)
applied = []
if libc.unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET) == 0:
    applied += ["network namespace"] if root else ["user namespace", "network namespace"]
libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
if landlock(directory):
    applied.append("landlock")
if root:
    # Of root's capabilities only CAP_DAC_READ_SEARCH is kept, and only where nobody could not otherwise import the
    # interpreter's own modules (one installed under /root).
    reads_as_root = not all(world_searchable(entry) for entry in sys.path + [directory] if os.path.exists(entry))
    libc.prctl(PR_SET_KEEPCAPS, int(reads_as_root), 0, 0, 0)
    try:
        os.setgroups([])
        os.setgid(settings["nobody"])
        os.setuid(settings["nobody"])
    except OSError as error:  # as root the program would escape the process limit and could signal the trainer
        tell(f"refused {error}")
        os._exit(1)
    applied += ["nobody"] + (["reads as root"] if reads_as_root else [])
    if reads_as_root:
        keep = 1 << 2  # header v3, then (effective, permitted, inheritable) for capabilities 0-31 and 32-63
        if libc.capset(struct.pack("=Ii", 0x20080522, 0), struct.pack("=6I", keep, keep, 0, 0, 0, 0)) != 0:
            sys.exit("Error: the sandbox could not drop root's capabilities")
cpu_seconds, megabyte = settings["cpu_seconds"], 1 << 20
resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))  # SIGXCPU first, SIGKILL a second later
for limit, value in [(resource.RLIMIT_AS, settings["memory_mb"] * megabyte),
                     (resource.RLIMIT_FSIZE, settings["file_size_mb"] * megabyte),
                     (resource.RLIMIT_NOFILE, settings["max_open_files"]),
                     (resource.RLIMIT_NPROC, tasks + settings["max_processes"])]:
    resource.setrlimit(limit, (value, value))
tell("isolation " + ",".join(applied))
os.set_inheritable(settings["status_fd"], False)
os.set_blocking(settings["status_fd"], False)  # a full pipe (the program may write to it too) must not hang the report

worker_pid, sys.excepthook = os.getpid(), report
main = types.ModuleType("__main__")
main.__file__ = path
sys.modules["__main__"], sys.argv = main, [path]
exec(compile(source, path, "exec"), main.__dict__)
'''


@dataclasses.dataclass
class Result:
    """How a program run by `run` ended."""

    stdout: str  # what it printed, cut to max_output_chars with a note saying so
    error: str | None  # its uncaught exception's line (else stderr's last), or what stopped it; None on success
    killed: bool  # whether it was stopped rather than ending by itself
    reason: str | None  # what stopped it: "timeout", "output", "cpu" (its CPU limit) or "signal" (another signal)
    # What this run got beyond the limits: "nobody", "user namespace", "network namespace", "landlock"; and "reads as
    # root" where nobody keeps the capability to read everything (an interpreter under /root).
    isolation: tuple[str, ...]

    def text(self) -> str:
        """The tool message: the output, then the error's line; `(no output)` for a silent success."""
        return "\n".join(part for part in (self.stdout.rstrip(), self.error) if part) or "(no output)"


def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: The whole program, for example "print(2**10)". Only what it prints is returned, so print the results
            you need. Each call starts afresh: nothing is kept between calls.
    """
    return run(code).text()


def run(code: str, *, timeout: float = TIMEOUT_SECONDS, cpu_seconds: int = CPU_SECONDS, memory_mb: int = MEMORY_MB,
        max_processes: int = MAX_PROCESSES, max_output_chars: int = MAX_OUTPUT_CHARS,
        file_size_mb: int = FILE_SIZE_MB) -> Result:
    """Run `code` in a fresh, limited process in a fresh temporary directory; never raises for what the code does.

    Callers with other limits wrap this in a tool of their own, returning `run(code, ...).text()`."""
    if not isinstance(code, str):
        raise ValueError(f"The code must be a string, not {type(code).__name__}.")
    directory = tempfile.mkdtemp(prefix="sandbox-")
    # The launcher's lines, read once all its processes ended: "isolation <what it got>", "error <its uncaught
    # exception's line>", "timeout" (stopped at its deadline), "refused <why it could not switch to nobody>".
    status_read, status_write = os.pipe()
    os.set_blocking(status_read, False)
    try:
        path = os.path.join(directory, "main.py")
        # surrogatepass: a lone surrogate from the model's JSON becomes the program's own SyntaxError, not ours.
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as file:
            file.write(code)
        if os.getuid() == 0:
            os.chown(directory, NOBODY, NOBODY)
        settings = {"path": path, "caller": os.getpid(), "deadline": time.monotonic() + timeout,
                    "status_fd": status_write, "nobody": NOBODY, "cpu_seconds": cpu_seconds,
                    "memory_mb": memory_mb, "file_size_mb": file_size_mb, "max_open_files": MAX_OPEN_FILES,
                    "max_processes": max_processes, "error_chars": ERROR_LINE_CHARS}
        environment = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": directory,
                       "TMPDIR": directory, "PYTHONDONTWRITEBYTECODE": "1",
                       # One thread per library: many sandboxes run at once, and the process limit counts threads.
                       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        process = subprocess.Popen([sys.executable, "-I", "-u", "-B", "-c", LAUNCHER, json.dumps(settings)],
                                   cwd=directory, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True, pass_fds=(status_write,))
        try:
            # The supervisor stops the program at its deadline; from here only a supervisor that is stuck past it.
            stdout, stderr, reason = read_output(process, settings["deadline"] + STOP_GRACE_SECONDS)
        finally:
            stop(process)
        try:
            status = os.read(status_read, 65536).decode("utf-8", "replace")
        except BlockingIOError:  # it said nothing: the worker died before it got that far
            status = ""
    finally:
        os.close(status_read)
        os.close(status_write)
        shutil.rmtree(directory, ignore_errors=True)
    messages = dict(line.partition(" ")[::2] for line in status.splitlines())
    if reason is None and "timeout" in messages:
        reason = "timeout"
    output = stdout.decode("utf-8", "replace")
    if len(output) > max_output_chars:
        more = "more than " if reason == "output" else ""  # it was stopped before it printed all
        output = (f"{output[:max_output_chars]} [output cut: {more}{len(output):,} characters, the limit is "
                  f"{max_output_chars:,}]")
    error_line = refusal(messages["refused"]) if "refused" in messages else messages.get("error") or stderr_line(stderr)
    reason, error = ending(process.returncode, error_line, reason, timeout, cpu_seconds)
    isolation = tuple(filter(None, messages.get("isolation", "").split(",")))
    return Result(output, error, reason is not None, reason, isolation)


@functools.cache
def refusal(why: str) -> str:
    """The error of a root-run sandbox that could not switch to nobody; logged once, as every call meets it, by every
    rank that meets it (whether a node may switch to nobody is that node's own: `config.console.ABOUT_THIS_RANK`)."""
    message = (f"Error: the sandbox runs no program as root, and could not switch to the user nobody (uid {NOBODY}): "
               f"{why}. Run the trainer as a user other than root, or where it may switch to uid {NOBODY} (a container "
               "whose user namespace maps it).")
    log.warning(message, extra=console.ABOUT_THIS_RANK)
    return message


def ending(returncode: int, error_line: str, reason: str | None, timeout: float,
           cpu_seconds: int) -> tuple[str | None, str | None]:
    """What stopped a program (None if nothing did) and its error: the sandbox's, or else for a failure `error_line`
    (`ZeroDivisionError: division by zero`); (None, None) for a success."""
    if reason is None and returncode < 0:
        reason = "cpu" if returncode == -signal.SIGXCPU else "signal"
    if reason == "timeout":
        return reason, f"Error: the program did not finish within {timeout:g} s"
    if reason == "output":
        return reason, f"Error: the program printed more than {READ_LIMIT_BYTES:,} bytes and was stopped"
    if reason == "cpu":
        return reason, f"Error: the program used its {cpu_seconds:g} s of CPU time and was stopped"
    if reason == "signal":
        return reason, f"Error: the program was killed by {signal.Signals(-returncode).name}"
    if returncode == 0:
        return None, None
    return None, error_line or f"Error: the program exited with status {returncode}"


def stderr_line(stderr: bytes) -> str:
    """The last line a program wrote to stderr (its `sys.exit('message')`), cut to ERROR_LINE_CHARS."""
    lines = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1][:ERROR_LINE_CHARS] if lines else ""


def read_output(process: subprocess.Popen, deadline: float) -> tuple[bytes, bytes, str | None]:
    """The program's stdout and stderr until both close, and "timeout" (at `deadline`, on `time.monotonic()`) or
    "output" when it had to be stopped first."""
    chunks = {process.stdout: [], process.stderr: []}
    received, reason = 0, None
    with selectors.DefaultSelector() as selector:
        for stream in chunks:
            selector.register(stream, selectors.EVENT_READ)
        # The supervisor holds both pipes until every process of the program is gone, so their end means all ended.
        while selector.get_map() and reason is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = "timeout"
                break
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                chunks[key.fileobj].append(chunk)
                received += len(chunk)
                if received > READ_LIMIT_BYTES:
                    reason = "output"
                    break
    return b"".join(chunks[process.stdout]), b"".join(chunks[process.stderr]), reason


def stop(process: subprocess.Popen) -> None:
    """Have the supervisor kill and reap every process of the program; kill the supervisor if it does not in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for stream in (process.stdout, process.stderr):
        stream.close()
