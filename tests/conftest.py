"""Shared test helpers: an isolated model cache, and launching the real entry points under torchrun."""

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.parallel import free_port

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
# metrics.jsonl's wall-clock fields (throughput, the step's and its phases' seconds, peak memory): left out wherever two
# runs' rows are compared.
WALL_CLOCK_SUFFIXES = ("_time_s", "tokens_per_s", "tool_seconds", "peak_memory_gib")


def metrics_rows(out_dir) -> list[dict]:
    """metrics.jsonl's rows, wall-clock fields left out."""
    return [{key: value for key, value in json.loads(line).items() if not key.endswith(WALL_CLOCK_SUFFIXES)}
            for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def write_pairs(directory: Path, seed: int = 3) -> Path:
    """A small preference set of the bundled arithmetic problems, prompt/chosen/rejected as text: the right `#### N`
    answer chosen over, in turn, the same answer in the other form (`The answer is N.`) and a wrong number in the
    right form (train.jsonl, 96 pairs; test.jsonl, 32), in `directory`."""
    from data import arithmetic

    directory.mkdir(parents=True, exist_ok=True)
    for split, count, offset in (("train", 96, 0), ("test", 32, 1)):
        rows = []
        for index, problem in enumerate(arithmetic.generate_problems(count, seed + offset)):
            working, answer = problem["answer"].split("\n")
            right = int(answer.removeprefix("#### "))
            wrong = right + 1 + index % 3
            rejected = (f"{working}\nThe answer is {right}." if index % 2 == 0
                        else f"{working.rsplit('=', 1)[0]}= {wrong}\n#### {wrong}")
            rows.append({"prompt": problem["question"], "chosen": problem["answer"], "rejected": rejected})
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory


def tiny_reward_model(out: Path, seed: int = 0) -> Path:
    """The embedded tiny model as a Hugging Face reward model, as one is downloaded: `Qwen2ForSequenceClassification`
    with one label, its score head drawn by transformers from `seed`; saved with its tokenizer in `out`."""
    import torch
    import transformers

    from model.tiny import ensure_tiny_checkpoint

    source = ensure_tiny_checkpoint()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(source, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)


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



# A file where `torchrun` notes each launch of the session: wall seconds, processes, the test (or fixture) that started
# it, its command (a file, as the test modules import this module again as `tests.conftest`).
LAUNCH_LOG = "TRAINER_TEST_LAUNCH_LOG"


def pytest_sessionstart(session):
    """A fresh launch log for this session."""
    log = Path(session.config._tmp_path_factory.getbasetemp()) / "launches.jsonl"
    log.write_text("")
    os.environ[LAUNCH_LOG] = str(log)


def pytest_terminal_summary(terminalreporter):
    """Where a run with launches spent its time: their count and seconds, and the longest of them (docs/tests.md)."""
    log = Path(os.environ.get(LAUNCH_LOG, "/nonexistent"))
    launches = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    if not launches:
        return
    total = sum(seconds for seconds, *_ in launches)
    terminalreporter.write_sep("=", f"{len(launches)} torchrun launches, {total:.0f} s in all; the longest")
    for seconds, nproc, test, command in sorted(launches, reverse=True)[:30]:
        terminalreporter.write_line(f"{seconds:7.1f} s  {nproc} proc  {test}  {command}")


# megatron-core torch.compile's its fused functions (a bf16 model's cross entropy, a Mixture-of-Experts router's top-k,
# ...): on CPU the first step of such a process then compiles for seconds. A test comparing runs made with the same setting, or asserting what does not depend on
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
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env=torchrun_env(compiled, env))
    if log := os.environ.get(LAUNCH_LOG):
        with open(log, "a") as file:
            file.write(json.dumps([time.perf_counter() - start, nproc, os.environ.get("PYTEST_CURRENT_TEST", "?").split(" (")[0],
                                   " ".join(str(arg) for arg in args if not str(arg).startswith("--"))[:80]]) + "\n")
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def torchrun_commands(commands: list[dict], tmp_path: Path, nproc: int = 2, timeout: int = 900,
                      env: dict | None = None) -> list[dict]:
    """Run several `trainer.*` commands (`{"module": ..., "argv": [...]}`, see tests/distributed/commands_worker.py) in one
    launch, one after another in one process group: torchrun's start-up is paid once. Returns, per command as listed,
    its step-1 row and its log lines."""
    listing, results = tmp_path / f"commands-{len(commands)}-{free_port()}.json", tmp_path / "results.json"
    listing.write_text(json.dumps(commands))
    launched = torchrun(["tests/distributed/commands_worker.py", "--commands", str(listing), "--out", str(results)],
                        nproc=nproc, timeout=timeout, env=env, check=False)
    if launched.returncode != 0:
        tracebacks = "\n".join(f"--- {path.name}: {path.read_text()}" for path in sorted(tmp_path.glob("results.json.error.rank*")))
        pytest.fail(f"the commands' launch exited {launched.returncode}\n{tracebacks}\n--- stdout\n{launched.stdout[-6000:]}\n"
                    f"--- stderr\n{launched.stderr[-6000:]}")
    return json.loads(results.read_text())


def launch(commands: list[dict], *, nproc: int = 2, env: dict | None = None, timeout: int = 900) -> dict:
    """What a module's `launches` generator yields: commands for one launch of `torchrun_commands` (see `joint_launches`,
    which sends back their results, as listed)."""
    return {"commands": commands, "nproc": nproc, "env": env or {}, "timeout": timeout}


def merged_environment(requests: list[dict]) -> dict:
    """One launch's environment for several modules' requests: their PYTHONPATH entries joined; any other variable
    must be the same in each."""
    paths, env = [], {}
    for request in requests:
        for key, value in request["env"].items():
            if key == "PYTHONPATH":
                paths += [path for path in value.split(os.pathsep) if path not in paths]
            elif env.setdefault(key, value) != value:
                raise ValueError(f"two modules' launches set {key} differently: {env[key]!r} and {value!r}")
    return env | ({"PYTHONPATH": os.pathsep.join(paths)} if paths else {})


def uses_megatron_fsdp(command: dict) -> bool:
    """Whether a `trainer.*` command trains under Megatron-FSDP (its config as written)."""
    from config import cli
    from config.loops import GRPOConfig, RMConfig, SFTConfig

    config_class = {"trainer.sft": SFTConfig, "trainer.rm": RMConfig}.get(command["module"], GRPOConfig)
    return cli.parse_args(config_class, command["argv"] + command.get("smoke", []), command["module"])[0].parallel.use_megatron_fsdp


# Megatron-FSDP runs that may end another launch (after its other runs, `megatron_fsdp_last`) rather than have one of
# their own: a launch pays 15-20 s of imports, and a later round has one or two of them.
FSDP_AT_A_LAUNCHS_END = 3


def fsdp_apart(batch: list[tuple]) -> list[list[tuple]]:
    """One round's `(module, index, command)` at one process count, as launches: the Megatron-FSDP runs at the end of
    the others' launch when they are few (each marked `megatron_fsdp_last`: the worker runs them after every other),
    else in one of their own (in one launch after 54 other runs, the ninth FSDP run lost a rank; alone in one launch,
    the nine passed)."""
    flags = [uses_megatron_fsdp(command) for _, _, command in batch]
    fsdp = [(name, index, command | {"megatron_fsdp_last": True})
            for (name, index, command), flag in zip(batch, flags) if flag]
    others = [item for item, flag in zip(batch, flags) if not flag]
    if len(fsdp) <= FSDP_AT_A_LAUNCHS_END:
        return [others + fsdp]
    return [others, fsdp]


class Outcomes(dict):
    """Per module, what its `launches` generator returned; a module whose generator or launch failed gets the failure
    raised to its tests (and only to them)."""

    def __getitem__(self, name: str):
        outcome = super().__getitem__(name)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


@pytest.fixture(scope="session")
def joint_launches(request, tmp_path_factory) -> Outcomes:
    """The `trainer.*` commands of every selected test module that defines a generator `launches(FIXTURES...)`, run in as
    few torchrun launches as their order allows: each generator yields `launch(...)` requests, gets their results
    back, and does what it needs between them (killing a save, copying a checkpoint) as a user's jobs would. Round by
    round, the requests of every module (its first, then its second, ...) run together, one launch per process count,
    the Megatron-FSDP runs last (a process cannot free Megatron-FSDP's groups for the next run), in a launch of their own
    when there are more than a few (`fsdp_apart`).
    A resumed run still gets fresh processes: it is in a later round than the run it resumes. A generator may yield
    `launch([])` to let a round pass, so that its runs share a later round's launch (each launch pays 15-20 s of
    imports): the one-process runs of every module go in the third round. `pytest tests/test_x.py`
    alone runs only that module's commands. Returns, per module name, what its
    generator returned."""
    import inspect

    modules = {item.module.__name__: item.module for item in request.session.items
               if getattr(item, "module", None) and "joint_launches" in getattr(item, "fixturenames", ())}
    generators, outcomes = {}, Outcomes()
    for name, module in modules.items():
        fixtures = {parameter: request.getfixturevalue(parameter)
                    for parameter in inspect.signature(module.launches).parameters}
        generators[name] = module.launches(**fixtures)
    sends = {name: None for name in generators}  # what each generator gets next: a launch's results, or its failure
    for round_index in itertools.count():
        asks = {}
        for name, sent in sends.items():
            generator = generators[name]
            try:
                asks[name] = generator.throw(sent) if isinstance(sent, BaseException) else generator.send(sent)
            except StopIteration as finished:
                outcomes[name] = finished.value
            except (Exception, pytest.fail.Exception) as failure:  # this module's failure, not the others'
                outcomes[name] = failure
        if not asks:
            return outcomes
        sends, results = {}, {}  # results: (module, index of its command) -> result
        for nproc in sorted({ask["nproc"] for ask in asks.values()}):
            for batch in fsdp_apart([(name, index, command) for name, ask in asks.items() if ask["nproc"] == nproc
                                     for index, command in enumerate(ask["commands"])]):
                batch = [(name, index, command) for name, index, command in batch
                         if name not in sends]  # not a module whose other launch failed
                names = sorted({name for name, _, _ in batch})
                if not batch:
                    continue
                try:
                    done = torchrun_commands([command for _, _, command in batch],
                                             tmp_path_factory.mktemp(f"joint-round{round_index}-{nproc}"), nproc=nproc,
                                             timeout=sum(asks[name]["timeout"] for name in names),
                                             env=merged_environment([asks[name] for name in names]))
                except pytest.fail.Exception as failure:
                    sends |= {name: failure for name in names}
                    continue
                results |= {(name, index): result for (name, index, _), result in zip(batch, done)}
        for name, ask in asks.items():
            if name not in sends:
                sends[name] = [results[name, index] for index in range(len(ask["commands"]))]


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

