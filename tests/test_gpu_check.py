"""The GPU check's own guards, on CPU: the versions it refuses, the scripts it starts finding the repository's packages
without the project installed (as on a GPU image whose python3 only gets the carried wheels), and its refusal to
measure where no GPU is visible."""

import ast
from pathlib import Path
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

OUR_PACKAGES = {"ckpt", "config", "data", "model", "trainer"}


def test_the_versions_the_stack_cannot_run_with_are_named(monkeypatch):
    assert gpu_check.version_problems() == []  # the locked environment
    real = metadata.version
    fake = {"torch": "2.7.1+cu128", "transformers": "5.17.0"}
    monkeypatch.setattr(gpu_check.metadata, "version", lambda name: fake.get(name) or real(name))
    problems = gpu_check.version_problems()
    assert problems == ["torch 2.7.1+cu128 is installed; this stack needs >= 2.8.",
                        "transformers 5.17.0 is installed; this stack needs >= 5.8 and <= 5.12.1."]


@pytest.mark.parametrize("script", sorted(str(path.relative_to(REPO)) for path in (REPO / "scripts").rglob("*.py")
                                          if "__main__" in path.read_text()))
def test_each_script_puts_the_repository_on_the_path_before_importing_its_packages(script):
    """scripts/bench/bench_optimizer_memory.py imported `model` first and failed on the H200, where the project is not
    installed (only the venv's editable install had hidden it). The path it puts there is the repository's: the
    parent as many levels up as the script is deep (`scripts/bench/` is two)."""
    text = (REPO / script).read_text()
    assert "sys.path.insert" not in text or f"parents[{len(Path(script).parts) - 1}]" in text, script
    inserted = False
    for node in ast.parse(text).body:
        if isinstance(node, ast.Expr) and "sys.path.insert" in ast.unparse(node):
            inserted = True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
            ours = [module for module in modules if module.split(".")[0] in OUR_PACKAGES]
            assert inserted or not ours, f"{script} imports {ours} before putting the repository on sys.path"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the check would measure")
def test_the_check_refuses_to_measure_without_a_gpu(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--work-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == ("error: no GPU visible: run on a GPU machine, or pass --cpu-smoke "
                                                      "to check the script on CPU")
    assert not list(tmp_path.glob("*.log"))  # nothing was started


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--steps", "sft,grpo,warp"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown step(s) warp: choose from parity, sft, profile, grpo, rollout, moe, memory, sft-local, grpo-rows" in result.stderr
