"""Checkpoint resolution, pruning and the errors of `--resume-from-checkpoint`, without launching training."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ckpt import checkpoint
from tests.conftest import REPO
from config.errors import UserError

DDP_LAYOUT = SimpleNamespace(tp=1, pp=1, vpp=1, use_megatron_fsdp=False)
FINGERPRINT = checkpoint.model_fingerprint({"model_type": "qwen2", "hidden_size": 128}, DDP_LAYOUT)


def fake_checkpoint(root, step: int, fingerprint=FINGERPRINT, point_latest: bool = True):
    """A checkpoint directory with the files resolution checks (contents of the sharded part are not read)."""
    path = root / checkpoint.checkpoint_name(step)
    (path / checkpoint.SHARDED_DIR).mkdir(parents=True)
    (path / checkpoint.SHARDED_DIR / ".metadata").write_text("{}")
    (path / "rng").mkdir()
    torch.save({"step": step, "fingerprint": fingerprint}, path / checkpoint.STATE_FILE)
    if point_latest:
        (root / checkpoint.LATEST).write_text(path.name)
    return path


def test_latest_without_checkpoint_starts_fresh(tmp_path):
    assert checkpoint.resolve_resume("latest", tmp_path / "none", FINGERPRINT) == (None, 0)
    assert checkpoint.resolve_resume("", tmp_path, FINGERPRINT) == (None, 0)


def test_latest_follows_the_pointer_and_ignores_a_killed_save(tmp_path):
    """A save killed with -9 leaves a `.partial-*` directory and maybe `latest.tmp`; `latest` still names the last good one."""
    good = fake_checkpoint(tmp_path, 20)
    (tmp_path / f"{checkpoint.PARTIAL}{checkpoint.checkpoint_name(30)}" / "rng").mkdir(parents=True)
    (tmp_path / f"{checkpoint.LATEST}.tmp").write_text("step_00000030")
    assert checkpoint.resolve_resume("latest", tmp_path, FINGERPRINT) == (good, 20)
    assert checkpoint.resolve_resume(str(tmp_path), tmp_path / "elsewhere", FINGERPRINT) == (good, 20)  # a ckpt.dir as PATH
    assert checkpoint.resolve_resume(str(good), tmp_path / "elsewhere", FINGERPRINT) == (good, 20)


def test_prune_keeps_the_newest_and_never_the_one_just_written(tmp_path):
    for step in (10, 20, 30, 40):
        fake_checkpoint(tmp_path, step)
    checkpoint._prune(tmp_path, keep_last=2, keep=tmp_path / checkpoint.checkpoint_name(40))
    assert sorted(path.name for path in tmp_path.glob("step_*")) == ["step_00000030", "step_00000040"]


@pytest.mark.parametrize("damage, expected", [
    ("missing_path", "does not exist"),
    ("no_metadata", "is incomplete or corrupted: `{path}/model_and_optimizer/.metadata` is missing"),
    ("garbage_state", "cannot be read"),
    ("other_model", "was saved for a different model or parallel layout"),
])
def test_unusable_checkpoints_name_the_file(tmp_path, damage, expected):
    other = checkpoint.model_fingerprint({"model_type": "qwen2", "hidden_size": 256}, DDP_LAYOUT)
    path = fake_checkpoint(tmp_path, 5, fingerprint=other if damage == "other_model" else FINGERPRINT)
    if damage == "missing_path":
        path = tmp_path / "step_99999999"
    elif damage == "no_metadata":
        (path / checkpoint.SHARDED_DIR / ".metadata").unlink()
    elif damage == "garbage_state":
        (path / checkpoint.STATE_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(UserError) as error:
        checkpoint.resolve_resume(str(path), tmp_path, FINGERPRINT)
    assert expected.format(path=path) in str(error.value)


def test_bad_resume_path_exits_before_touching_the_output(tmp_path):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    result = subprocess.run([sys.executable, "-m", "trainer.sft", f"--train.out_dir={out_dir}",
                             f"--resume-from-checkpoint={tmp_path / 'nope'}"], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert (out_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert sorted(path.name for path in out_dir.iterdir()) == ["metrics.jsonl"]


def test_megatron_fsdp_and_ddp_checkpoints_do_not_mix(tmp_path):
    """The two formats differ; resuming one into the other names the key to change, before any model is built."""
    fsdp = checkpoint.model_fingerprint({"model_type": "qwen2", "hidden_size": 128},
                                        SimpleNamespace(tp=1, pp=1, vpp=1, use_megatron_fsdp=True))
    fsdp_checkpoint = fake_checkpoint(tmp_path / "fsdp", 5, fingerprint=fsdp)
    assert checkpoint.resolve_resume(str(fsdp_checkpoint), tmp_path, fsdp) == (fsdp_checkpoint, 5)
    with pytest.raises(UserError) as error:
        checkpoint.resolve_resume(str(fsdp_checkpoint), tmp_path, FINGERPRINT)
    assert "saved by a Megatron-FSDP run and this run uses DDP" in str(error.value)
    assert "`--parallel.use_megatron_fsdp=true`" in str(error.value)
    with pytest.raises(UserError) as error:
        checkpoint.resolve_resume(str(fake_checkpoint(tmp_path / "ddp", 5)), tmp_path, fsdp)
    assert "saved by a DDP run and this run uses Megatron-FSDP" in str(error.value)
    assert "`--parallel.use_megatron_fsdp=false`" in str(error.value)
