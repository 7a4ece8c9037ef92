"""Shared test helpers: an isolated model cache, and launching the real entry points under torchrun."""

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



def torchrun(args: list[str], nproc: int = 2, timeout: int = 600, check: bool = True, cwd: Path = REPO,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc ARGS` (from the repository root unless `cwd`); on failure show its output."""
    command = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env=None if env is None else {**os.environ, **env})
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


@pytest.fixture(scope="session")
def default_sft(tmp_path_factory) -> Path:
    """The embedded default SFT exactly as a user starts it (only the output directory moved), run once per session:
    its figures are asserted in test_sft_e2e, and the GRPO tests start from its export, as the default GRPO does."""
    out_dir = tmp_path_factory.mktemp("default-sft")
    torchrun(["-m", "trainer.sft", f"--train.out_dir={out_dir}"], nproc=2, timeout=900)
    return out_dir

