"""Exact resume through the real entry point on 2 processes: exit_interval, SIGTERM, killed saves, DP change, Megatron-FSDP.

Saves are asynchronous (the default `ckpt.async_save=true`) except under Megatron-FSDP, which saves synchronously.

The two tests' runs share launches (the module fixture `runs`), as a test pays torchrun's start-up per launch: the
first legs of every scenario run in one 2-process launch, the resumes in another (fresh processes, as a resumed job
is), the DP=1 continuations in one 1-process launch. The SIGTERM run and the corrupt-shard run, whose processes'
exits are what they test, are launched alone.
"""

import json
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO, TORCHRUN, free_port, launch, metrics_rows, torchrun, torchrun_env

pytestmark = pytest.mark.distributed

RUN = ["-m", "trainer.sft", "--train.steps=40", "--train.global_batch_size=8", "--train.micro_batch_size=2",
       "--train.eval_samples=0", "--optim.warmup_steps=2", "--ckpt.save_interval=10", "--ckpt.keep_last=2"]


def losses(out_dir) -> dict[int, float]:
    """step -> training loss, from metrics.jsonl."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def checkpoints(out_dir) -> list[str]:
    """Names of the complete checkpoints."""
    return sorted(path.name for path in (out_dir / "checkpoints").glob("step_*"))


def run_until_sigterm(args: list[str], out_dir, after_step: int) -> subprocess.CompletedProcess:
    """Start a 2-process run and SIGTERM its workers once `after_step` is logged, as a cluster scheduler does.

    (Signalling only the torchrun agent also works, but the agent then exits 1 itself after forwarding.)
    """
    command = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), *args]
    # The environment of the `torchrun` runs it is compared with: compiled and eager fused functions differ in the last bit.
    process = subprocess.Popen(command, cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    metrics = out_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and any(json.loads(line)["step"] >= after_step for line in metrics.read_text().splitlines()):
            for worker in psutil.Process(process.pid).children():
                worker.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    output, _ = process.communicate(timeout=600)
    return subprocess.CompletedProcess(command, process.returncode, output, "")


# Held-out evaluation on (8 prompts every 4 steps): under Megatron-FSDP its greedy generation gathers parameters in
# every forward, so both ranks must run the same forwards.
FSDP_RUN = ["-m", "trainer.sft", "--parallel.use_megatron_fsdp=true", "--train.steps=12", "--train.global_batch_size=8",
            "--train.micro_batch_size=2", "--train.eval_samples=8", "--train.eval_interval=4", "--optim.warmup_steps=2",
            "--ckpt.save_interval=4"]


def command(run: list[str], out_dir, *extra: str) -> dict:
    """One `trainer.sft` command of a shared launch (tests/distributed/commands_worker.py)."""
    return {"module": "trainer.sft", "argv": [*run[2:], f"--train.out_dir={out_dir}", *extra]}


def launches(tmp_path_factory):
    """Both tests' runs, in the order a user's jobs would make them (conftest's `joint_launches`); returns what was seen
    between the launches."""
    root = tmp_path_factory.mktemp("resume")
    ddp, fsdp, seen = root / "ddp", root / "fsdp", {"root": root}
    # 1. Straight runs, and Megatron's convention: save and exit 0 at train.exit_interval.
    yield launch([command(RUN, ddp / "straight"), command(RUN, ddp / "resumed", "--train.exit_interval=15"),
                  command(FSDP_RUN, fsdp / "straight"), command(FSDP_RUN, fsdp / "resumed", "--train.exit_interval=6")])
    for layout in (ddp, fsdp):
        seen[layout.name, "stopped"] = checkpoints(layout / "resumed"), max(losses(layout / "resumed"))
        shutil.copytree(layout / "resumed" / "checkpoints", layout / "dp1" / "checkpoints")  # for the DP change
    for name in ("buckets", "gpu_buckets"):  # for another bucket layout, and for the one GPUs get at DP=1
        shutil.copytree(ddp / "resumed" / "checkpoints", ddp / name / "checkpoints")

    # 2. A save killed with -9 leaves a partial directory and a stray pointer file; `latest` is untouched.
    partial = ddp / "resumed" / "checkpoints" / ".partial-step_00000020"
    shutil.copytree(ddp / "resumed" / "checkpoints" / "step_00000015" / "rng", partial / "rng")
    (ddp / "resumed" / "checkpoints" / "latest.tmp").write_text("step_00000020")

    # 3. Resume from latest, then SIGTERM mid-run: the step finishes, a checkpoint is saved, exit 0. This run saves
    # every step, so the signal finds the previous step's save being written in the background: the run waits for it.
    seen["sigterm"] = run_until_sigterm([*RUN, f"--train.out_dir={ddp / 'resumed'}", "--resume-from-checkpoint", "latest",
                                         "--ckpt.save_interval=1"], ddp / "resumed", 18)
    seen["sigterm_losses"] = losses(ddp / "resumed")
    seen["sigterm_latest"] = (ddp / "resumed" / "checkpoints" / "latest").read_text()
    seen["sigterm_checkpoints"] = checkpoints(ddp / "resumed")

    # 4. Resume again (fresh processes) to the end; then the finished run once more.
    resume = ("--resume-from-checkpoint", "latest")
    seen["resumes"] = yield launch([command(RUN, ddp / "resumed", *resume), command(RUN, ddp / "resumed", *resume),
                                    command(FSDP_RUN, fsdp / "resumed", *resume)])

    # 6. DP=2 -> DP=1 (the optimizer format reshards over data parallelism), and an overwritten earlier run, on one
    # process; a resume whose distributed optimizer cuts its gradient buffer into other buckets is refused.
    shutil.copytree(ddp / "straight", ddp / "overwritten")
    buckets = "--ddp.override_ddp_config={overlap_grad_reduce: true, bucket_size: 100000}"
    seen["dp1"] = yield launch([command(RUN, ddp / "overwritten", "--train.steps=2", "--train.overwrite_output_dir=true"),
                                command(RUN, ddp / "dp1", *resume, "--train.exit_interval=18"),
                                {**command(RUN, ddp / "buckets", *resume, buckets), "expect_error": True},
                                command(RUN, ddp / "branch", "--resume-from-checkpoint",
                                        str(ddp / "dp1" / "checkpoints" / "step_00000015"), "--train.exit_interval=16"),
                                command(FSDP_RUN, fsdp / "dp1", *resume, "--train.exit_interval=8"),
                                command(RUN, ddp / "gpu_buckets", *resume, "--train.exit_interval=18",
                                        "--ddp.override_ddp_config={overlap_grad_reduce: true, bucket_size: 40000000}")],
                               nproc=1)
    return seen


@pytest.fixture(scope="module")
def runs(joint_launches) -> dict:
    return joint_launches[__name__]


def test_exact_resume_after_exit_interval_sigterm_and_a_killed_save(runs):
    root = runs["root"]
    straight, resumed, dp1 = root / "ddp" / "straight", root / "ddp" / "resumed", root / "ddp" / "dp1"
    assert checkpoints(straight) == ["step_00000030", "step_00000040"]  # keep_last=2
    assert (straight / "checkpoints" / "latest").read_text() == "step_00000040"

    # 1. Saved and stopped at train.exit_interval=15.
    assert runs["ddp", "stopped"] == (["step_00000010", "step_00000015"], 15)

    # 3. The SIGTERM run resumed from latest (past the killed save's leftovers), finished its step, saved and exited 0.
    result = runs["sigterm"]
    assert result.returncode == 0, result.stdout[-4000:]
    assert "resumed from" in result.stdout and "stopping at step" in result.stdout
    interrupted_at = max(runs["sigterm_losses"])
    assert 18 <= interrupted_at < 40
    assert runs["sigterm_latest"] == f"step_{interrupted_at:08d}"
    # The save in flight when the signal came was finished and published, then the signal's own.
    assert runs["sigterm_checkpoints"] == [f"step_{interrupted_at - 1:08d}", f"step_{interrupted_at:08d}"]

    # 4. Resumed again to the end: every step's loss equals the uninterrupted run's, bit for bit.
    reference, got = losses(straight), losses(resumed)
    assert sorted(got) == list(range(1, 41))
    assert got == reference
    assert not (resumed / "checkpoints" / ".partial-step_00000020").exists()  # the rerun's save of that step replaced the killed one's leftovers
    assert checkpoints(resumed) == ["step_00000030", "step_00000040"]

    # 5. A finished run says so and exits 0 without training.
    assert "already finished all 40 steps" in runs["resumes"][1]["log"]
    assert "already finished" not in runs["resumes"][0]["log"]

    # 5b. The same command again without --resume-from-checkpoint (a typo, a re-submitted job) is refused before any
    # work, and leaves the first run byte for byte; with the overwrite key it runs.
    snapshot = {path: path.read_bytes() for path in straight.rglob("*") if path.is_file()}
    again = subprocess.run([sys.executable, *RUN, f"--train.out_dir={straight}"], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"error: `train.out_dir={straight}` holds an earlier run" in again.stderr
    assert "--resume-from-checkpoint latest" in again.stderr and "--train.overwrite_output_dir=true" in again.stderr
    assert {path: path.read_bytes() for path in straight.rglob("*") if path.is_file()} == snapshot
    overwritten = root / "ddp" / "overwritten"
    assert sorted(losses(overwritten)) == [1, 2] and checkpoints(overwritten) == ["step_00000002"]

    # 6. DP=2 -> DP=1 (the optimizer format reshards over data parallelism): the loss continues.
    continued = losses(dp1)
    for step in (16, 17, 18):
        print(f"DP=1 after DP=2 checkpoint, step {step}: {continued[step]:.6f} vs {reference[step]:.6f}")
        assert abs(continued[step] - reference[step]) < 1e-4 * reference[step]

    # The settings a GPU gets at DP=1 (`model.rules.overlap_settings`: overlapped reduce-scatters over one rank, in
    # buckets of 40M parameters, here one as in the DP=2 save): the DP=2 checkpoint loads, and the run continues alike.
    assert losses(root / "ddp" / "gpu_buckets") == continued

    # 6b. A sound checkpoint resumed with other gradient buckets: said as such, not as corrupted shards (it was, and the
    # user was sent to an earlier checkpoint, which fails alike).
    refused = runs["dp1"][2]["error"]
    assert refused.startswith("Checkpoint `") and "step_00000015` cannot be loaded into this run: its shards are all " \
        "there, as long as its index says, but this run lays out its model or optimizer state otherwise " \
        "(CheckpointingException: Global shape mismatch" in refused
    assert "corrupted" not in refused and "`ddp.override_ddp_config`" in refused
    assert "ddp.override_ddp_config {} -> {'overlap_grad_reduce': True, 'bucket_size': 100000}" in runs["dp1"][2]["log"]

    # 6c. Another run's checkpoint branched into a new `train.out_dir` (a directory not made yet): it stopped with a
    # FileNotFoundError traceback, restoring the checkpoint's own metrics row into the missing directory. Now the
    # branch has that row, then its own, which continue the run it branched from.
    branch = metrics_rows(root / "ddp" / "branch")
    assert [row["step"] for row in branch] == [15, 16] and runs["dp1"][3]["error"] is None
    assert branch[0]["loss"] == reference[15]  # the row the checkpoint holds
    assert abs(branch[1]["loss"] - reference[16]) < 1e-4 * reference[16]

    # 7. A truncated model/optimizer shard is a one-paragraph error naming the checkpoint, on every rank, exit 2.
    broken = root / "ddp" / "broken"
    shutil.copytree(straight / "checkpoints", broken / "checkpoints")
    shard = next((broken / "checkpoints" / "step_00000030" / "model_and_optimizer").glob("*.distcp"))
    with open(shard, "r+b") as file:
        file.truncate(shard.stat().st_size // 2)
    failed = torchrun([*RUN, f"--train.out_dir={broken}", "--resume-from-checkpoint",
                       str(broken / "checkpoints" / "step_00000030")], check=False)
    assert failed.returncode != 0
    assert "error: Checkpoint `" in failed.stderr and "step_00000030` cannot be loaded" in failed.stderr
    message = next(line for line in failed.stderr.splitlines() if line.startswith("error: Checkpoint"))
    assert f"its shard `{shard}` is truncated ({shard.stat().st_size} of " in message  # the file, by name
    assert "Traceback" not in failed.stderr.split("error:")[0] and "bytes) (EOFError). Resume" in message  # the underlying error, one line


def test_megatron_fsdp_exact_resume(runs):
    """Megatron-FSDP checkpoints through its DTensor path: the resumed run's losses equal the straight run's, bit for bit.

    Step 7's loss is the first forward after the load: it also shows the loaded weights are live at once
    (stale compute weights would give the untrained model's loss there).
    """
    straight, resumed, dp1 = (runs["root"] / "fsdp" / name for name in ("straight", "resumed", "dp1"))
    assert checkpoints(straight) == ["step_00000008", "step_00000012"]
    assert (straight / "hf" / "model.safetensors").is_file()  # the export gathers the uneven DTensor shards
    assert runs["fsdp", "stopped"] == (["step_00000004", "step_00000006"], 6)

    assert "resumed from" in runs["resumes"][2]["log"]
    assert "ckpt.async_save: Megatron-FSDP saves synchronously" in runs["resumes"][2]["log"]
    reference, got = losses(straight), losses(resumed)
    assert sorted(got) == list(range(1, 13))
    assert got == reference
    assert metrics_rows(resumed) == metrics_rows(straight)  # held-out loss and greedy accuracy at steps 0, 4, 8, 12 too
    assert [row["step"] for row in metrics_rows(straight) if "eval_accuracy" in row] == [0, 4, 8, 12]

    # DP=2 -> DP=1: the DTensors reshard over data parallelism; the loss continues.
    continued = losses(dp1)
    for step in (7, 8):
        print(f"Megatron-FSDP DP=1 after DP=2 checkpoint, step {step}: {continued[step]:.6f} vs {reference[step]:.6f}")
        assert abs(continued[step] - reference[step]) < 1e-4 * reference[step]
