"""Asynchronous checkpoint saves (`ckpt.async_save`, on by default) through the real entry points on 2 processes.

Every save here is written in the background while the next step trains (`ckpt.save_interval=1`), with plain DDP
(`parallel.use_distributed_optimizer=false`; the distributed optimizer's async saves are in test_checkpoint_e2e and
test_grpo_e2e). One launch runs the straight runs (SFT async and sync, GRPO async) and GRPO's first half; a run
killed with -9 while a writer is mid-save is launched alone; one more launch resumes both.
"""

import signal
import subprocess
import time

import psutil
import pytest

from ckpt import checkpoint
from tests.conftest import REPO, TORCHRUN, free_port, launch, metrics_rows, torchrun_env

pytestmark = pytest.mark.distributed

PLAIN_DDP = ["--parallel.use_distributed_optimizer=false", "--ckpt.save_interval=1", "--ckpt.keep_last=2"]
SFT = [*PLAIN_DDP, "--train.steps=8", "--train.global_batch_size=8", "--train.micro_batch_size=2",
       "--train.eval_samples=0", "--optim.warmup_steps=2"]


def writers_of(workers: list) -> list:
    """The checkpoint writers forked from `workers` (their children running the same command line)."""
    found = []
    for worker in workers:
        try:
            found += [child for child in worker.children() if child.cmdline() == worker.cmdline()]
        except psutil.NoSuchProcess:
            pass
    return found


def alive(process) -> bool:
    """Whether `process` still runs (a zombie, or one gone meanwhile, does not)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_mid_save(out_dir) -> dict:
    """Start the SFT run and, once a save after step 2 is being written by a forked writer, kill -9 every worker
    (a node lost, the OOM killer); returns what the checkpoint directory held at that instant."""
    command = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "trainer.sft", *SFT,
               f"--train.out_dir={out_dir}"]
    process = subprocess.Popen(command, cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    directory, seen = out_dir / "checkpoints", {}
    deadline = time.time() + 600
    while time.time() < deadline and process.poll() is None:
        workers = psutil.Process(process.pid).children()
        writers = writers_of(workers) if (directory / checkpoint.LATEST).is_file() else []
        if writers:
            for worker in workers:
                worker.send_signal(signal.SIGKILL)
            seen = {"latest": (directory / checkpoint.LATEST).read_text(),
                    "partial": sorted(path.name for path in directory.glob(f"{checkpoint.PARTIAL}*")),
                    "writers": writers}
            break
        time.sleep(0.005)
    seen["output"] = process.communicate(timeout=600)[0]
    return seen


def launches(default_sft, tmp_path_factory):
    """The runs, in conftest's `joint_launches`: the straight ones and the split GRPO run, then a run killed mid-save,
    then the resumes (fresh processes)."""
    root = tmp_path_factory.mktemp("async-save")
    grpo = [*PLAIN_DDP, f"--model.path={default_sft / 'hf'}", "--train.steps=4", "--train.global_batch_size=32",
            "--train.micro_batch_size=16", "--train.eval_samples=0", "--grpo.kl_coef=0.05"]

    def sft(name, *extra):
        return {"module": "trainer.sft", "argv": [*SFT, f"--train.out_dir={root / name}", *extra]}

    def grpo_run(name, *extra):
        return {"module": "trainer.grpo", "argv": [*grpo, f"--train.out_dir={root / name}", *extra]}

    yield launch([sft("sft-async"), sft("sft-sync", "--ckpt.async_save=false"), grpo_run("grpo-straight"),
                  grpo_run("grpo-split", "--train.exit_interval=2")])
    killed = kill_mid_save(root / "sft-killed")
    time.sleep(2)  # a writer left behind would still be writing now
    killed["writers_alive"] = [writer.pid for writer in killed.pop("writers", []) if alive(writer)]
    resume = ("--resume-from-checkpoint", "latest")
    killed["resumed"] = yield launch([sft("sft-killed", *resume), grpo_run("grpo-split", *resume)])
    return {"root": root, "killed": killed}


@pytest.fixture(scope="module")
def runs(joint_launches) -> dict:
    return joint_launches[__name__]


def test_async_saves_equal_sync_saves_and_resume_exactly_in_sft_and_grpo(runs):
    root = runs["root"]
    # The same training, and the same final weights, whether saves are written in the background or not.
    assert metrics_rows(root / "sft-async") == metrics_rows(root / "sft-sync")
    assert (root / "sft-async" / "hf" / "model.safetensors").read_bytes() == \
           (root / "sft-sync" / "hf" / "model.safetensors").read_bytes()
    for name in ("sft-async", "sft-sync"):
        directory = root / name / "checkpoints"
        assert (directory / "latest").read_text() == "step_00000008"
        assert sorted(path.name for path in directory.iterdir()) == ["latest", "step_00000007", "step_00000008"]
    # GRPO 2 steps, resumed, 2 more: every row (rewards, losses, KL, sampling) equals the straight run's.
    straight = metrics_rows(root / "grpo-straight")
    assert [row["step"] for row in straight] == [1, 2, 3, 4]
    assert metrics_rows(root / "grpo-split") == straight
    assert (root / "grpo-split" / "hf" / "model.safetensors").is_file()


def test_a_run_killed_mid_save_resumes_from_the_previous_checkpoint_exactly(runs):
    root, killed = runs["root"], runs["killed"]
    # Killed while a writer was writing the save after step N: `latest` named step N-1, the save of N was partial.
    assert "latest" in killed, killed["output"][-3000:]
    print("at the kill:", killed["latest"], killed["partial"])
    saved = int(killed["latest"].removeprefix(checkpoint.PREFIX))
    assert killed["partial"] == [f"{checkpoint.PARTIAL}{checkpoint.checkpoint_name(saved + 1)}"]
    assert killed["writers_alive"] == []  # the writers died with their trainers
    # The resume removed the partial save, continued from step N-1, and repeats the uninterrupted run exactly.
    log = killed["resumed"][0]["log"]
    assert f"resumed from {root / 'sft-killed' / 'checkpoints' / killed['latest']} at step {saved}" in log
    assert metrics_rows(root / "sft-killed") == metrics_rows(root / "sft-async")
    assert (root / "sft-killed" / "hf" / "model.safetensors").read_bytes() == \
           (root / "sft-async" / "hf" / "model.safetensors").read_bytes()
    assert not list((root / "sft-killed" / "checkpoints").glob(f"{checkpoint.PARTIAL}*"))
