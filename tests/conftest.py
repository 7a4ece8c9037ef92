"""Shared test helpers: an isolated model cache, and launching the real entry points under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.parallel import free_port

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="session", autouse=True)
def isolated_model_cache(tmp_path_factory):
    """Every test session builds the tiny model into its own cache (subprocesses inherit the variable)."""
    previous = os.environ.get("TRAINER_CACHE_DIR")
    os.environ["TRAINER_CACHE_DIR"] = str(tmp_path_factory.mktemp("model-cache"))
    yield
    if previous is None:
        os.environ.pop("TRAINER_CACHE_DIR", None)
    else:
        os.environ["TRAINER_CACHE_DIR"] = previous



# megatron-core torch.compile's its fused functions (SwiGLU, bias-GELU, ...): on CPU the first step of every process
# then compiles for seconds. A test comparing runs made with the same setting, or asserting what does not depend on
# the last bit, runs eagerly; the runs exactly as users start them (the default SFT and GRPO) keep compiling.
EAGER = {"TORCH_COMPILE_DISABLE": "1"}


def torchrun_env(compiled: bool = False, env: dict | None = None) -> dict:
    """The environment of a test's torchrun launch: eager unless `compiled` (see EAGER), then `env`."""
    return {**os.environ, **({} if compiled else EAGER), **(env or {})}


def torchrun(args: list[str], nproc: int = 2, timeout: int = 600, check: bool = True, cwd: Path = REPO,
             env: dict | None = None, compiled: bool = False) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc ARGS` (from the repository root unless `cwd`; eagerly unless `compiled`);
    on failure show its output."""
    command = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env=torchrun_env(compiled, env))
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def torchrun_commands(commands: list[dict], tmp_path: Path, nproc: int = 2, timeout: int = 900,
                      env: dict | None = None) -> list[dict]:
    """Run several `trainer.*` commands (`{"module": ..., "argv": [...]}`, see tests/distributed/commands_worker.py) in one
    launch, one after another in one process group: torchrun's start-up is paid once. Returns, per command, its step-1
    row and its log lines (SFT commands first, as they run)."""
    listing, results = tmp_path / f"commands-{len(commands)}-{free_port()}.json", tmp_path / "results.json"
    listing.write_text(json.dumps(commands))
    torchrun(["tests/distributed/commands_worker.py", "--commands", str(listing), "--out", str(results)], nproc=nproc,
             timeout=timeout, env=env)
    return json.loads(results.read_text())


SHARED_LAUNCH = "tests/distributed/shared_launch.py"


def worker_listing(workers: list[dict], path: Path) -> list[str]:
    """Writes `workers` (each `{"script", "argv", "out"}`) for tests/distributed/shared_launch.py; returns the
    launch's arguments after torchrun's own."""
    path.write_text(json.dumps(workers))
    return [SHARED_LAUNCH, str(path)]


def worker_output(out: Path) -> Path:
    """A worker's output directory, or a failure showing the traceback the worker left there."""
    errors = sorted(Path(out).glob("error.rank*.txt"))
    if errors:
        pytest.fail("\n".join(f"--- {error.name}\n{error.read_text()}" for error in errors))
    return Path(out)


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory) -> dict[str, Path]:
    """One 2-process torchrun launch for the workers of every test module whose selected tests use this fixture,
    one worker after another (tests/distributed/shared_launch.py): torchrun's start-up and the imports, 10-15 s a
    launch, are paid once. Each such module defines `shared_worker(out)`, which writes the worker's inputs under
    `out` and returns the worker's script and arguments (its results go to `out` too). Returns, per test module
    name, its worker's output directory."""
    modules = {item.module.__name__: item.module for item in request.session.items
               if getattr(item, "module", None) and "shared_launch" in getattr(item, "fixturenames", ())}
    root = tmp_path_factory.mktemp("shared-launch")
    workers = {}
    for name, module in modules.items():
        out = root / name.rpartition(".")[2]
        out.mkdir()
        script, *argv = module.shared_worker(out)
        workers[name] = {"script": script, "argv": argv, "out": str(out)}
    torchrun(worker_listing(list(workers.values()), root / "workers.json"), nproc=2, timeout=2400)
    return {name: Path(worker["out"]) for name, worker in workers.items()}


@pytest.fixture(scope="session")
def default_sft(tmp_path_factory) -> Path:
    """The embedded default SFT exactly as a user starts it (only the output directory moved), run once per session:
    its figures are asserted in test_sft_e2e, and the GRPO tests start from its export, as the default GRPO does."""
    out_dir = tmp_path_factory.mktemp("default-sft")
    torchrun(["-m", "trainer.sft", f"--train.out_dir={out_dir}"], nproc=2, timeout=900, compiled=True)
    return out_dir

