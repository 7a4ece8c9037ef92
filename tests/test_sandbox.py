"""data/sandbox.py, the bundled `python` tool: real programs in real subprocesses, each checked for what it returns,
how long it took, and that it left no process behind (the bombs run with short limits to stay fast)."""

import ctypes
import logging
import os
import platform
import signal
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from config import console
from data import sandbox
from data.sandbox import python, run

REPO = Path(__file__).resolve().parents[1]


def sandbox_processes() -> set[int]:
    """Pids a sandbox could have left: this process's descendants, and (a root-run sandbox's) the user nobody's."""
    parents, owners = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines())
        except OSError:  # it ended meanwhile
            continue
        parents[int(entry.name)], owners[int(entry.name)] = int(fields["PPid"]), int(fields["Uid"].split()[0])

    def descends_from_us(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return {pid for pid in parents if owners[pid] == sandbox.NOBODY or descends_from_us(pid)}


@pytest.fixture
def no_leftovers():
    """Fails the test if a process the sandbox started is still there (or a zombie nobody reaped) afterwards."""
    before = sandbox_processes()
    yield
    assert sandbox_processes() - before == set()


def program_processes(directory: Path) -> set[int]:
    """Live processes of the sandboxes whose directories lie in `directory` (their command lines name them)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(directory).encode() in (entry / "cmdline").read_bytes():
                pids.add(int(entry.name))
        except OSError:  # it ended meanwhile
            continue
    return pids


def wait_for(condition, seconds: float) -> bool:
    """Whether `condition()` came true within `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def start_caller(tmp_path: Path, code: str, timeout: float, before_run: str = "") -> subprocess.Popen:
    """A process that calls `run(code, timeout=timeout)` with its sandbox directories in `tmp_path`, after
    `before_run`."""
    script = f"import sys\nfrom data import sandbox\n{before_run}\nsandbox.run(sys.argv[1], timeout={timeout})"
    return subprocess.Popen([sys.executable, "-c", script, code], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)})


def timed(code: str, **limits) -> tuple[sandbox.Result, float]:
    """`run(code, **limits)` and the seconds it took."""
    start = time.monotonic()
    result = run(code, **limits)
    return result, time.monotonic() - start


# ---------------------------------------------------------------- what it returns


def test_print_returns_exactly_what_it_prints():
    assert python("print(2**10)").strip() == "1024"


@pytest.mark.parametrize("code, expected", [
    ("print('a')\n1/0", "a\nZeroDivisionError: division by zero"),
    ("print(", "SyntaxError: '(' was never closed"),
    ("import sys\nsys.exit(3)", "Error: the program exited with status 3"),
    ("import sys\nsys.exit('bad input')", "bad input"),
    ("x = 1", "(no output)"),
    ("print(open(__file__).read())", "print(open(__file__).read())"),  # runs as __main__ from its own file
])
def test_failures_end_with_the_errors_last_line(code, expected):
    assert python(code) == expected


def test_the_error_is_the_programs_own_not_a_forked_childs(no_leftovers):
    code = ("import os, sys, time\nif os.fork() == 0:\n    while True:\n        print('child noise', file=sys.stderr)\n"
            "        time.sleep(0.01)\ntime.sleep(0.3)\nraise ValueError('the parent failed')")
    assert python(code) == "ValueError: the parent failed"


def test_the_tools_schema_is_transformers_own():
    schema = get_json_schema(python)
    assert schema["function"]["name"] == "python"
    assert schema["function"]["description"] == "Run a Python program and return what it prints."
    assert schema["function"]["parameters"]["properties"]["code"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["code"]


def test_a_non_string_argument_is_a_value_error():
    with pytest.raises(ValueError, match="must be a string, not int"):
        python(12)


def test_the_environment_is_minimal_and_the_directory_fresh(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    code = ("import os, sys\nprint(os.environ.get('SANDBOX_TEST_SECRET'), os.environ['HOME'] == os.getcwd(), "
            "os.getcwd() in sys.path, '' in sys.path, os.listdir('.'))\nprint(os.getcwd())")
    first, directory = python(code).splitlines()
    assert first == "None True False False ['main.py']"
    assert not os.path.exists(directory)  # deleted afterwards
    assert python(code).splitlines()[1] != directory


def test_calls_from_several_threads_at_once_each_get_their_own_answer(no_leftovers):
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(python, [f"print({number} * 2)" for number in range(8)]))
    assert answers == [str(number * 2) for number in range(8)]


# ---------------------------------------------------------------- limits


def test_an_endless_loop_stops_at_the_timeout_with_its_output_so_far(no_leftovers):
    result, seconds = timed("print('started')\nwhile True: pass", timeout=1)
    assert result.text() == "started\nError: the program did not finish within 1 s"
    assert (result.killed, result.reason) == (True, "timeout")
    assert seconds < 1 + 2


def test_the_program_is_killed_at_its_wall_time_even_when_nobody_waits(tmp_path):
    """The supervisor keeps the wall time itself: a caller that stops waiting (here: stopped, so still alive and no
    parent-death signal comes) does not let the program run on."""
    caller = start_caller(tmp_path, "import time\ntime.sleep(60)", timeout=1)
    try:
        assert wait_for(lambda: len(program_processes(tmp_path)) >= 2, 10)  # the supervisor and the program
        caller.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: not program_processes(tmp_path), 5)
    finally:
        caller.kill()
        caller.wait()
        for pid in program_processes(tmp_path):  # on failure only: a program that outlived its wall time
            os.kill(pid, signal.SIGKILL)


def test_the_cpu_limit_stops_a_program_and_says_so(no_leftovers):
    result, seconds = timed("while True: pass", timeout=20, cpu_seconds=1)
    assert result.text() == "Error: the program used its 1 s of CPU time and was stopped"
    assert result.reason == "cpu" and seconds < 10


@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = []\nwhile True: x.append(bytearray(10**6))"])
def test_a_memory_bomb_is_a_memory_error(code, no_leftovers):
    result, seconds = timed(code, memory_mb=256)
    assert result.text() == "MemoryError" and not result.killed
    assert seconds < 5


@pytest.mark.parametrize("code, expected", [
    ("import os\nwhile True: os.fork()", "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
    # Each child leaves the process group and the session: only the supervisor's sweep of its orphans finds them.
    ("import subprocess\nwhile True: subprocess.Popen(['sleep', '60'], start_new_session=True)",
     "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
    # A child left behind by a program that has finished.
    ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')", "parent done"),
])
def test_fork_bombs_and_leftover_children_end_with_the_program(code, expected, no_leftovers):
    result, seconds = timed(code, timeout=3, max_processes=16)
    assert result.text() == expected
    assert seconds < 3


def test_a_huge_print_is_cut_without_reading_it_all(no_leftovers):
    tracemalloc.start()
    try:
        result, seconds = timed("print('x' * 10**8)")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.stdout.startswith("x" * sandbox.MAX_OUTPUT_CHARS + " [output cut: more than ")
    assert result.stdout.endswith(f" characters, the limit is {sandbox.MAX_OUTPUT_CHARS:,}]")
    assert len(result.stdout) < sandbox.MAX_OUTPUT_CHARS + 80
    assert result.error == "Error: the program printed more than 1,000,000 bytes and was stopped"
    assert peak < 20 * 2**20 and seconds < 5  # read about 1 MB of the 100 MB, then stopped it


def test_output_over_the_limit_says_how_much_there_was():
    assert python("print('y' * 10_000)") == "y" * 4000 + " [output cut: 10,001 characters, the limit is 4,000]"


def test_the_file_size_limit_is_an_os_error():
    result = run("open('big', 'wb').write(bytes(2 * 2**20))", file_size_mb=1)
    assert result.error == "OSError: [Errno 27] File too large"


# ---------------------------------------------------------------- isolation


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 without Landlock (probed here, independently of the sandbox)."""
    if platform.machine() not in ("x86_64", "aarch64"):
        return 0
    return max(0, ctypes.CDLL(None).syscall(444, None, 0, 1))


def test_isolation_is_what_this_machine_offers():
    isolation = run("").isolation
    assert ("landlock" in isolation) == (landlock_abi() >= 1)
    if os.getuid() == 0:
        assert "nobody" in isolation and "network namespace" in isolation


def test_writing_inside_its_directory_works():
    assert python("open('a.txt', 'w').write('x')\nprint(open('a.txt').read())") == "x"


@pytest.mark.parametrize("where", ["tmp_path", "repository"])
def test_writing_outside_its_directory_is_refused(where, tmp_path):
    isolation = run("").isolation
    if "landlock" not in isolation and "nobody" not in isolation:
        pytest.skip("neither Landlock nor a root trainer's drop to nobody is available: nothing refuses the write")
    target = tmp_path / "escaped.txt" if where == "tmp_path" else REPO / "tests" / "sandbox-escaped.txt"
    try:
        result = python(f"open({str(target)!r}, 'w').write('x')")
        assert result.startswith("PermissionError: [Errno 13] Permission denied")
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_landlock_refuses_even_a_world_writable_directory(tmp_path):
    if "landlock" not in run("").isolation:
        pytest.skip("this kernel has no Landlock")
    tmp_path.chmod(0o777)  # so that only Landlock, not the file's permissions, stands in the way
    target = tmp_path / "escaped.txt"
    assert python(f"open({str(target)!r}, 'w')").startswith("PermissionError")
    assert python(f"import os\nos.mkdir({str(tmp_path / 'made')!r})").startswith("PermissionError")
    assert list(tmp_path.iterdir()) == []


def test_no_network_in_its_own_namespace():
    if "network namespace" not in run("").isolation:
        pytest.skip("the OS refused a network namespace")
    result = python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)")
    assert result.startswith("OSError: [Errno 101] Network is unreachable")


def test_a_caller_killed_before_the_launcher_started_leaves_no_program_and_no_directory(tmp_path):
    """The caller dies the moment the launcher exists, before its interpreter has started (and so before it asked for
    a signal at its parent's death): the launcher notices that its parent is gone, ends, and removes the directory."""
    die_after_start = ("import os, signal, subprocess\n"
                       "class Popen(subprocess.Popen):\n"
                       "    def __init__(self, *args, **kwargs):\n"
                       "        super().__init__(*args, **kwargs)\n"
                       "        os.kill(os.getpid(), signal.SIGKILL)\n"
                       "subprocess.Popen = Popen")
    caller = start_caller(tmp_path, "import time\ntime.sleep(60)", timeout=60, before_run=die_after_start)
    try:
        assert caller.wait(10) == -signal.SIGKILL
        assert wait_for(lambda: not program_processes(tmp_path), 5)
        assert wait_for(lambda: not list(tmp_path.glob("sandbox-*")), 5)
    finally:
        for pid in program_processes(tmp_path):  # on failure only
            os.kill(pid, signal.SIGKILL)


def test_a_root_sandbox_that_cannot_become_nobody_refuses_and_warns_once(monkeypatch, caplog):
    if os.getuid() != 0:
        pytest.skip("only a root-run sandbox switches to nobody")
    # The kernel refuses to switch to (uid_t)-1 (EINVAL), as it does to a uid its user namespace does not map.
    monkeypatch.setattr(sandbox, "NOBODY", 2**32 - 1)
    sandbox.refusal.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="data.sandbox"):
            results = [run("import os\nprint('ran as uid', os.getuid())") for _ in range(2)]
    finally:
        sandbox.refusal.cache_clear()  # its message names the uid patched here
    assert [result.stdout for result in results] == ["", ""]
    assert results[0].error == results[1].error == (
        "Error: the sandbox runs no program as root, and could not switch to the user nobody (uid 4294967295): "
        "[Errno 22] Invalid argument. Run the trainer as a user other than root, or where it may switch to uid "
        "4294967295 (a container whose user namespace maps it).")
    assert [record.getMessage() for record in caplog.records] == [results[0].error]
    # Whether a node may switch to nobody is its own: a rank other than 0 (under grpo.tool_isolation=thread) says it.
    assert console.RankFilter(3, 4).filter(caplog.records[0]).getMessage().startswith("rank 3: Error: the sandbox")


def test_a_tool_worker_killed_mid_program_leaves_no_process_and_no_directory(no_leftovers):
    """`grpo.tool_timeout` kills the worker process running the sandbox: the program and its directory go with it."""
    import glob
    import tempfile

    from tool_runtime import runner as tool_runner

    pattern = os.path.join(tempfile.gettempdir(), "sandbox-*")
    before = set(glob.glob(pattern))
    runner = tool_runner.ToolRunner(timeout=1.0, workers=1, isolation="process", preload=["data.sandbox:python"])
    try:
        job = tool_runner.Job([("python", python, "data.sandbox:python", {"code": "import time\ntime.sleep(60)"})],
                              False, ["python"])
        assert [outcome.kind for outcome in runner.run([job])[0]] == ["timeout"]
        deadline = time.monotonic() + 5
        while set(glob.glob(pattern)) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(glob.glob(pattern)) - before == set()  # and `no_leftovers` checks the processes
    finally:
        runner.close()
