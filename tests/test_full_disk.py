"""A checkpoint directory that runs out of space mid-run: one paragraph naming the directory, the error, the size a
save needs and the checkpoint `latest` still names; no worker traceback; and a resume with room finishes. The same for
an output directory too small for the Hugging Face export after the last step.

The checkpoints go to a 20 MiB tmpfs mounted for the test (root can mount one; this project's CI runs as root): the
tiny model's checkpoint is 13 MB, so the first save fits and the second does not. Its export (3.2 MB) does not fit
into a 1 MiB one.
"""

import subprocess

import pytest

from tests.conftest import torchrun

RUN = ["-m", "trainer.sft", "--train.steps=4", "--ckpt.save_interval=1", "--ckpt.keep_last=2", "--train.eval_samples=0"]


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of 20 MiB, or of the size a test parametrizes it with (`indirect=True`)."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    size = getattr(request, "param", "20m")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.distributed
def test_a_full_disk_is_one_paragraph_and_latest_still_resumes(small_disk, tmp_path):
    checkpoints = small_disk / "checkpoints"
    args = [*RUN, f"--train.out_dir={tmp_path / 'run'}", f"--ckpt.dir={checkpoints}"]
    failed = torchrun(args, check=False)
    assert failed.returncode != 0
    worker_output = failed.stdout + failed.stderr.split("error:")[0]
    assert "Traceback" not in worker_output and "unexpected pos" not in worker_output, failed.stderr[-3000:]
    # The start-up warning: 21 MB free, about 13 MB a checkpoint. Every rank logs it, the console prints it once
    # (config.console: rank 0's; at 8 processes it was 8 lines).
    assert f"`ckpt.dir={checkpoints}` has " in failed.stdout
    assert (failed.stdout + failed.stderr).count("saves may fail for space") == 1, failed.stdout[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, failed.stderr[-3000:]
    message = errors[0]
    print(message)
    assert message.startswith(f"error: Saving the checkpoint of step 2 into `{checkpoints}` failed on rank ")
    assert "No space left on device" in message
    assert "one checkpoint needs about 13." in message and "MB (the size of `step_00000001`)" in message
    assert "`latest` still names `step_00000001`, a complete checkpoint" in message
    assert "--resume-from-checkpoint latest" in message
    assert (checkpoints / "latest").read_text() == "step_00000001"

    # With room, the resume removes the partial save and finishes.
    subprocess.run(["mount", "-o", "remount,size=100m", str(small_disk)], check=True)
    torchrun([*args, "--resume-from-checkpoint", "latest"])
    assert (checkpoints / "latest").read_text() == "step_00000004"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()


@pytest.mark.distributed
@pytest.mark.parametrize("small_disk", ["1m"], indirect=True)
def test_a_full_disk_during_the_export_is_one_paragraph_and_a_resume_writes_the_export(small_disk, tmp_path):
    out_dir, checkpoints = small_disk / "run", tmp_path / "checkpoints"
    earlier = out_dir / "hf"  # an earlier finish's export, which a partial one must not replace
    earlier.mkdir(parents=True)
    (earlier / "model.safetensors").write_text("an earlier export")
    args = ["-m", "trainer.sft", "--train.steps=1", "--train.eval_samples=0", f"--train.out_dir={out_dir}",
            f"--ckpt.dir={checkpoints}"]
    failed = torchrun(args, check=False)
    assert failed.returncode != 0
    worker_output = failed.stdout + failed.stderr.split("error:")[0]
    assert "Traceback" not in worker_output, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, failed.stderr[-3000:]
    message = errors[0]
    print(message)
    assert message.startswith(f"error: Writing the run's export into `{out_dir / '.partial-hf'}` failed on rank 0: ")
    assert "No space left on device" in message and "the export needs about 3.2 MB" in message
    assert "The run's checkpoint `step_00000001`, which `latest`" in message and "is complete and intact" in message
    assert "rerun with `--resume-from-checkpoint latest`, which writes the export" in message
    assert (checkpoints / "latest").read_text() == "step_00000001"
    assert (earlier / "model.safetensors").read_text() == "an earlier export"

    # With room, the resume writes the export in place of the earlier one, without training again.
    subprocess.run(["mount", "-o", "remount,size=20m", str(small_disk)], check=True)
    resumed = torchrun([*args, "--resume-from-checkpoint", "latest"])
    assert "its export hf/ was not written (completely): building the model to write it" in resumed.stdout
    assert "step 1:" not in resumed.stdout
    assert (out_dir / "hf" / "model.safetensors").stat().st_size > 3_000_000
    assert sorted(path.name for path in out_dir.iterdir() if path.name.startswith(".")) == []
