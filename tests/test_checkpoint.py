"""Checkpoint resolution, pruning and the errors of `--resume-from-checkpoint`, without launching training."""

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import torch

from ckpt import checkpoint
from ckpt.layout import resume_arguments
from tests.conftest import REPO
from config.errors import UserError
from config.sections import ParallelConfig

DDP_LAYOUT = ParallelConfig()
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


def test_a_resume_that_changes_what_the_checkpoint_holds_is_refused(tmp_path, caplog):
    """A longer `train.steps` or a new `optim.lr` on resume would silently keep the checkpoint's schedule (megatron-core
    restores it, and the optimizer's parameter groups): refused by name with both values; a setting read afresh
    every step (`train.log_interval`) is said and taken; the same values in another form (a tuple read back as a
    list) are no change."""
    from config.cli import parse_args, to_dict
    from config.loops import SFTConfig

    saved = to_dict(parse_args(SFTConfig, ["--train.steps=100"], "trainer.sft")[0])
    path = fake_checkpoint(tmp_path, 20)
    torch.save({"step": 20, "fingerprint": FINGERPRINT, "config": saved}, path / checkpoint.STATE_FILE)
    for argv, key in ((["--train.steps=200"], "train.steps"), (["--train.steps=100", "--optim.lr=1e-5"], "optim.lr"),
                      (["--train.steps=100", "--train.global_batch_size=128"], "train.global_batch_size")):
        current = to_dict(parse_args(SFTConfig, argv, "trainer.sft")[0])
        with pytest.raises(UserError, match=f"was saved with `{key}=.*` and this run has `{key}=.*: a resumed run would "
                                            f"go on with"):
            checkpoint.resolve_resume("latest", tmp_path, FINGERPRINT, current)
    # GRPO's data position counts prompts: train.global_batch_size / grpo.n_samples a step.
    from config.loops import GRPOConfig

    saved_grpo = to_dict(parse_args(GRPOConfig, [], "trainer.grpo")[0])
    torch.save({"step": 20, "fingerprint": FINGERPRINT, "config": saved_grpo}, path / checkpoint.STATE_FILE)
    with pytest.raises(UserError, match="was saved with `grpo.n_samples=8` and this run has `grpo.n_samples=4`, but GRPO.s data position .* would skip or repeat data"):
        checkpoint.resolve_resume("latest", tmp_path, FINGERPRINT,
                                  to_dict(parse_args(GRPOConfig, ["--grpo.n_samples=4"], "trainer.grpo")[0]))
    torch.save({"step": 20, "fingerprint": FINGERPRINT, "config": saved}, path / checkpoint.STATE_FILE)
    current = to_dict(parse_args(SFTConfig, ["--train.steps=100", "--train.log_interval=1", "--optim.betas=[0.9, 0.95]"],
                                 "trainer.sft")[0])
    with caplog.at_level("INFO"):
        assert checkpoint.resolve_resume("latest", tmp_path, FINGERPRINT, current) == (path, 20)
    assert "train.log_interval 20 -> 1" in caplog.text and "optim.betas" not in caplog.text


def test_a_resume_may_change_the_lora_dropout_but_not_the_adapters(tmp_path, caplog):
    """LoRA's dropout holds no state: a resume with another `peft.dropout` goes on, saying so (it was refused, as a
    change of the adapters is); a checkpoint whose fingerprint still records the dropout (saved before) resumes too;
    another rank is refused by name."""
    from config.cli import parse_args, to_dict
    from config.loops import SFTConfig
    from model.tiny import ensure_tiny_checkpoint

    base = ensure_tiny_checkpoint()

    def run(*argv: str):
        config = parse_args(SFTConfig, ["--peft.method=lora", *argv], "trainer.sft")[0]
        return config, checkpoint.model_fingerprint({"model_type": "qwen2"}, DDP_LAYOUT, config.peft, base)

    saved_config, saved = run()
    path = fake_checkpoint(tmp_path, 4)
    for recorded in (saved, {**saved, "lora": {**saved["lora"], "dropout": 0.0}}):  # as saved now, and before
        torch.save({"step": 4, "fingerprint": recorded, "config": to_dict(saved_config)}, path / checkpoint.STATE_FILE)
        config, fingerprint = run("--peft.dropout=0.1")
        with caplog.at_level("INFO"):
            assert checkpoint.resolve_resume("latest", tmp_path, fingerprint, to_dict(config)) == (path, 4)
        assert "peft.dropout 0.0 -> 0.1" in caplog.text
    config, fingerprint = run("--peft.rank=4")
    with pytest.raises(UserError, match="was saved with LoRA rank 8, alpha 16 on .* and this run uses LoRA rank 4, "
                                        "alpha 16 on"):
        checkpoint.resolve_resume("latest", tmp_path, fingerprint, to_dict(config))


def test_a_lora_resume_onto_another_base_of_the_same_shape_is_refused(tmp_path):
    """The adapters were fingerprinted with their base's file names and sizes only, which every training of one
    architecture shares: a LoRA run resumed after its `model.path` was replaced by another training's export (an SFT run
    again into the same `hf/`) loaded its adapters onto the other base without a word (the default SFT on two such
    bases: step 3's loss 4.961 straight, 6.012 resumed). Now a sample of the base's bytes is part of the fingerprint;
    a byte-identical copy elsewhere resumes, and so does a checkpoint saved before the sample was recorded."""
    import shutil

    from safetensors.torch import load_file, save_file

    from config.cli import parse_args
    from config.loops import SFTConfig
    from model.tiny import ensure_tiny_checkpoint

    base, copy, other = ensure_tiny_checkpoint(), tmp_path / "copy", tmp_path / "other"
    shutil.copytree(base, copy)
    shutil.copytree(base, other)
    weights = load_file(base / "model.safetensors")
    save_file({name: tensor + 1e-3 for name, tensor in weights.items()}, other / "model.safetensors", {"format": "pt"})
    assert (other / "model.safetensors").stat().st_size == (base / "model.safetensors").stat().st_size

    peft = parse_args(SFTConfig, ["--peft.method=lora"], "trainer.sft")[0].peft
    saved = checkpoint.model_fingerprint({"model_type": "qwen2"}, DDP_LAYOUT, peft, base)
    path = fake_checkpoint(tmp_path / "checkpoints", 4, fingerprint=saved)
    with pytest.raises(UserError, match=r"over a base of model.safetensors \d+ B \(bytes sampled: \w{12}\) and this "
                                        r"run uses .* over a base of model.safetensors \d+ B \(bytes sampled: \w{12}\)"):
        checkpoint.resolve_resume(str(path), tmp_path, checkpoint.model_fingerprint({"model_type": "qwen2"}, DDP_LAYOUT,
                                                                                    peft, other))
    assert checkpoint.resolve_resume(str(path), tmp_path, checkpoint.model_fingerprint(
        {"model_type": "qwen2"}, DDP_LAYOUT, peft, copy)) == (path, 4)
    older = {**saved, "lora": {key: value for key, value in saved["lora"].items() if key != "base_digest"}}
    path = fake_checkpoint(tmp_path / "older", 4, fingerprint=older)
    assert checkpoint.resolve_resume(str(path), tmp_path, checkpoint.model_fingerprint(
        {"model_type": "qwen2"}, DDP_LAYOUT, peft, other)) == (path, 4)


def test_a_resume_says_which_frozen_model_was_replaced_by_another_of_the_same_shape(tmp_path, caplog):
    """GRPO loads its KL reference (`model.path`), reward model and teacher again at every start, and the checkpoint
    holds none of them: one replaced by another training's export (the SFT run again into the same `hf/`) changed
    the resumed run's KL penalty, scores or distillation without a word. Now each is said by key; an unchanged one is
    not, the run goes on, and SFT (whose checkpoint holds every weight) reads none of them."""
    import shutil

    from safetensors.torch import load_file, save_file

    from config.cli import parse_args, to_dict
    from config.loops import GRPOConfig, SFTConfig
    from model.tiny import ensure_tiny_checkpoint

    base = tmp_path / "sft"  # the SFT export GRPO starts from, and here also its reward model
    shutil.copytree(ensure_tiny_checkpoint(), base)

    def fingerprint(*argv: str) -> dict:
        config = parse_args(GRPOConfig, [f"--grpo.reward_model={base}", *argv], "trainer.grpo")[0]
        return {**FINGERPRINT, "inputs": checkpoint.frozen_inputs(config, base)}, to_dict(config)

    saved, saved_config = fingerprint()
    assert sorted(saved["inputs"]) == ["grpo.reward_model", "model.path"]  # the KL reference (grpo.kl_coef > 0)
    path = fake_checkpoint(tmp_path / "checkpoints", 4, fingerprint=saved)
    torch.save({"step": 4, "fingerprint": saved, "config": saved_config}, path / checkpoint.STATE_FILE)
    with caplog.at_level("INFO"):
        assert checkpoint.resolve_resume("latest", tmp_path / "checkpoints", saved) == (path, 4)
    assert "its weights differ" not in caplog.text
    # Another training's export of the same model put in its place: equal names and sizes, other weights.
    save_file({name: tensor + 1e-3 for name, tensor in load_file(base / "model.safetensors").items()},
              base / "model.safetensors", {"format": "pt"})
    replaced, _ = fingerprint()
    with caplog.at_level("INFO"):
        assert checkpoint.resolve_resume("latest", tmp_path / "checkpoints", replaced) == (path, 4)
    said = [record.getMessage() for record in caplog.records if "its weights differ" in record.getMessage()]
    assert [message.split("`")[1] for message in said] == ["grpo.reward_model", "model.path"]
    assert f"from those checkpoint `{path}` was trained with (bytes sampled: {saved['inputs']['model.path'][:12]}" in said[0]
    assert checkpoint.frozen_inputs(parse_args(GRPOConfig, ["--grpo.kl_coef=0"], "trainer.grpo")[0], base) == {}
    assert checkpoint.frozen_inputs(parse_args(SFTConfig, [], "trainer.sft")[0], base) == {}


def test_a_checkpoint_resumes_only_the_loop_that_saved_it(tmp_path):
    """`trainer.grpo --resume-from-checkpoint <an SFT run's checkpoint>` (a new `train.out_dir`: a branch) was refused
    only for the settings that differ (`optim.lr`, ...) with `Resume with --optim.lr=0.002`; given them, it went on into
    a GRPO run on the SFT's schedule, and with every setting alike it stopped with a FileNotFoundError traceback. Now
    the loop is named at once, with the way to start GRPO from that SFT; checkpoints that predate the record are
    read by their saved config."""
    from config.cli import parse_args, to_dict
    from config.loops import GRPOConfig, RMConfig, SFTConfig

    configs = {"trainer.sft": (SFTConfig, []), "trainer.grpo": (GRPOConfig, []),
               "trainer.rm": (RMConfig, ["--model.path=tiny"])}
    for saved_by, (config_class, argv) in configs.items():
        saved_config = to_dict(parse_args(config_class, argv, saved_by)[0])
        assert checkpoint.loop_of(saved_config) == saved_by
        for age, recorded in (("now", {**FINGERPRINT, "loop": saved_by}), ("before", FINGERPRINT)):
            path = fake_checkpoint(tmp_path / saved_by / age, 4, fingerprint=recorded)
            torch.save({"step": 4, "fingerprint": recorded, "config": saved_config}, path / checkpoint.STATE_FILE)
            for loop in configs:
                resolve = functools.partial(checkpoint.resolve_resume, str(path), tmp_path, {**FINGERPRINT, "loop": loop})
                if loop == saved_by:
                    assert resolve() == (path, 4)
                    continue
                with pytest.raises(UserError) as error:
                    resolve()
                assert str(error.value) == (
                    f"Checkpoint `{path}` was saved by `{saved_by}` and this is `{loop}`: a checkpoint resumes only the "
                    "loop that saved it (its schedule, data position and optimizer are that loop's). To start "
                    f"`{loop}` from that run's model, drop `--resume-from-checkpoint` and set `--model.path` to its "
                    "export (`<its train.out_dir>/hf`).")


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
    checkpoint.prune_checkpoints(tmp_path, keep_last=2, keep=tmp_path / checkpoint.checkpoint_name(40))
    assert sorted(path.name for path in tmp_path.glob("step_*")) == ["step_00000030", "step_00000040"]
    # Resumed from step 10 (an explicit earlier checkpoint), the run writes step 20: the abandoned 30 and 40 neither
    # count nor go, so the run keeps its own two.
    for step in (10, 20):
        fake_checkpoint(tmp_path, step)
    checkpoint.prune_checkpoints(tmp_path, keep_last=2, keep=tmp_path / checkpoint.checkpoint_name(20))
    assert sorted(path.name for path in tmp_path.glob("step_*")) == ["step_00000010", "step_00000020", "step_00000030",
                                                                     "step_00000040"]


@pytest.mark.parametrize("damage, expected", [
    ("missing_path", "does not exist"),
    ("not_a_checkpoint", "`{path}` is not a checkpoint (it has none of trainer_state.pt, model_and_optimizer/.metadata, rng"),
    ("no_metadata", "is incomplete or corrupted: `{path}/model_and_optimizer/.metadata` is missing"),
    ("garbage_state", "cannot be read"),
    ("other_model", "was saved for a different model or parallel layout: the model's `hidden_size` 256 (this run's: "),
    ("other_tp", "was saved for a different model or parallel layout: `parallel.tp=2` (this run: 1)."),
])
def test_unusable_checkpoints_name_the_file(tmp_path, damage, expected):
    other = checkpoint.model_fingerprint({"model_type": "qwen2", "hidden_size": 256}, DDP_LAYOUT)
    if damage == "other_tp":
        other = {**FINGERPRINT, "tp": 2}
    path = fake_checkpoint(tmp_path, 5, fingerprint=other if damage.startswith("other") else FINGERPRINT)
    if damage == "missing_path":
        path = tmp_path / "step_99999999"
    elif damage == "not_a_checkpoint":  # a directory of something else (`--resume-from-checkpoint=/tmp`, say)
        path = tmp_path / "elsewhere"
        (path / "notes").mkdir(parents=True)
    elif damage == "no_metadata":
        (path / checkpoint.SHARDED_DIR / ".metadata").unlink()
    elif damage == "garbage_state":
        (path / checkpoint.STATE_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(UserError) as error:
        checkpoint.resolve_resume(str(path), tmp_path, FINGERPRINT)
    assert expected.format(path=path) in str(error.value)


@pytest.mark.slow
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
                                        ParallelConfig(use_megatron_fsdp=True))
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


MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_experts": 8}


@pytest.mark.parametrize("saved, now, expected", [
    (ParallelConfig(ep=2), ParallelConfig(ep=1), "was saved with `parallel.ep=2` and this run has `parallel.ep=1`: the "
                                                 "experts' weights and optimizer state are saved laid out on the "
                                                 "expert-parallel grid, which this trainer does not reshard. Resume with "
                                                 "`--parallel.ep=2`, or start a new `train.out_dir`."),
    (ParallelConfig(tp=2, etp=1), ParallelConfig(tp=2), "was saved with `parallel.etp=1` and this run has `parallel.etp=2`"),
    (ParallelConfig(), ParallelConfig(use_distributed_optimizer=False),
     "was saved with `parallel.use_distributed_optimizer=true` and this run has `parallel.use_distributed_optimizer=false`"),
    ("fp32", "bf16", "was saved with `model.dtype=fp32` and this run has `model.dtype=bf16`: the optimizer's state is laid "
                     "out by the parameters' dtype"),
    ("bf16", "fp16", "Resume with `--model.dtype=bf16`, or start a new `train.out_dir`."),
])
def test_a_resume_under_another_optimizer_or_expert_layout_names_the_key_and_both_values(tmp_path, saved, now, expected):
    """Before, these changes passed the fingerprint, the load failed, and the user was told the shards were corrupted
    (`model.dtype` fp32 -> bf16 on the default SFT: `KeyError: optimizer.distributed...dtype_(torch.bfloat16,
    torch.float32).bucket_idx_0`, said as corrupted shards after the model was built)."""
    def fingerprint(layout):  # a parallel layout, or a model.dtype
        if isinstance(layout, str):
            return checkpoint.model_fingerprint(MOE, DDP_LAYOUT, dtype=layout)
        return checkpoint.model_fingerprint(MOE, layout)

    path = fake_checkpoint(tmp_path, 5, fingerprint=fingerprint(saved))
    with pytest.raises(UserError) as error:
        checkpoint.resolve_resume(str(path), tmp_path, fingerprint(now))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_frozen_router_is_part_of_an_moe_checkpoint_and_not_of_a_dense_one(tmp_path):
    frozen = fake_checkpoint(tmp_path / "moe", 5, fingerprint=checkpoint.model_fingerprint(MOE, DDP_LAYOUT, freeze_router=True))
    with pytest.raises(UserError, match="saved with `model.moe_freeze_router=true` and this run has `model.moe_freeze_router=false`"):
        checkpoint.resolve_resume(str(frozen), tmp_path, checkpoint.model_fingerprint(MOE, DDP_LAYOUT))
    dense = fake_checkpoint(tmp_path / "dense", 5)
    assert checkpoint.resolve_resume(str(dense), tmp_path, checkpoint.model_fingerprint(
        {"model_type": "qwen2", "hidden_size": 128}, DDP_LAYOUT, freeze_router=True)) == (dense, 5)
    # A checkpoint saved before the optimizer's layout was recorded still resumes.
    older = {key: value for key, value in FINGERPRINT.items() if key not in ("parallel.use_distributed_optimizer", "model.dtype")}
    old = fake_checkpoint(tmp_path / "old", 3, fingerprint=older)
    assert checkpoint.resolve_resume(str(old), tmp_path, FINGERPRINT) == (old, 3)
    # One saved before the dtype was fingerprinted is checked against the dtype of the config saved beside it.
    state = torch.load(old / checkpoint.STATE_FILE, weights_only=False)
    torch.save({**state, "config": {"model": {"dtype": "fp32"}}}, old / checkpoint.STATE_FILE)
    with pytest.raises(UserError, match="saved with `model.dtype=fp32` and this run has `model.dtype=bf16`"):
        checkpoint.resolve_resume(str(old), tmp_path, checkpoint.model_fingerprint(
            {"model_type": "qwen2", "hidden_size": 128}, DDP_LAYOUT, dtype="bf16"))


def test_saving_a_step_again_keeps_latest_naming_a_complete_checkpoint_at_every_instant(tmp_path, monkeypatch):
    """A resumed run re-reaching a saved step replaces it; after every rename and delete `latest` names a checkpoint."""
    fake_checkpoint(tmp_path, 20)
    partial = tmp_path / f"{checkpoint.PARTIAL}{checkpoint.checkpoint_name(20)}"
    fake_checkpoint(tmp_path, 99, point_latest=False).rename(partial)  # the new save of step 20, complete
    (partial / "new").write_text("the new save")
    seen = []

    def checked(operation):
        def run(*args, **kwargs):
            operation(*args, **kwargs)
            named = tmp_path / (tmp_path / checkpoint.LATEST).read_text()
            assert (named / checkpoint.STATE_FILE).is_file(), f"`latest` names {named.name}, which is gone"
            seen.append(named.name)
        return run

    monkeypatch.setattr(checkpoint.os, "replace", checked(checkpoint.os.replace))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", checked(checkpoint.shutil.rmtree))
    checkpoint.publish_checkpoint(tmp_path, partial, tmp_path / checkpoint.checkpoint_name(20))
    assert (tmp_path / "step_00000020" / "new").is_file() and not partial.exists()
    assert (tmp_path / checkpoint.LATEST).read_text() == "step_00000020"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_00000020"]
    assert partial.name in seen  # the pointer named the complete new save while the old one was swapped out


def test_start_up_removes_what_killed_saves_left_but_not_what_latest_names(tmp_path):
    fake_checkpoint(tmp_path, 10)
    for name in (f"{checkpoint.PARTIAL}step_00000020", f"{checkpoint.REPLACED}step_00000010"):
        (tmp_path / name / "rng").mkdir(parents=True)
    (tmp_path / f"{checkpoint.LATEST}.tmp").write_text("step_00000020")
    named_partial = fake_checkpoint(tmp_path, 30, point_latest=False).rename(tmp_path / f"{checkpoint.PARTIAL}step_00000030")
    (tmp_path / checkpoint.LATEST).write_text(named_partial.name)  # killed between the two pointer moves of `publish_checkpoint`
    checkpoint.clean_stale_saves(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [".partial-step_00000030", "latest", "step_00000010"]


def used_output_dir(tmp_path, *argv):
    """An SFT config whose `train.out_dir` holds a finished run's checkpoint and metrics."""
    from config.cli import parse_args
    from config.loops import SFTConfig

    config, resume = parse_args(SFTConfig, [f"--train.out_dir={tmp_path}", *argv], "trainer.sft")
    fake_checkpoint(tmp_path / "checkpoints", 6)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / "tb").mkdir()
    return config, resume


def test_a_fresh_run_into_a_used_output_dir_is_refused_and_touches_nothing(tmp_path):
    config, resume = used_output_dir(tmp_path)
    before = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    with pytest.raises(UserError) as error:
        checkpoint.check_output_dir(config, resume, is_main=True)
    message = str(error.value)
    assert f"`train.out_dir={tmp_path}` holds an earlier run" in message and "step_00000006" in message
    for way_out in ("`--resume-from-checkpoint latest`", "new `--train.out_dir`", "`--train.overwrite_output_dir=true`"):
        assert way_out in message
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == before
    checkpoint.check_output_dir(config, "latest", is_main=True)  # resuming continues it: no error, nothing deleted
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == before


def test_resuming_latest_where_there_is_none_over_a_finished_runs_export_is_refused(tmp_path):
    """`--resume-from-checkpoint latest` (what scripts/run.sh passes) into a finished run whose checkpoints were deleted
    or live in another `ckpt.dir`: there is no `latest`, so the run started from step 0 without a word, cut that run's
    metrics.jsonl to nothing at once and replaced its `hf/` at the end. Refused, nothing touched; a run killed before
    its first save (metrics, no export) still starts again, and the overwrite key replaces the finished one."""
    from config.cli import parse_args
    from config.loops import SFTConfig

    config, _ = parse_args(SFTConfig, [f"--train.out_dir={tmp_path}"], "trainer.sft")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_text("weights")
    before = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    with pytest.raises(UserError) as error:
        checkpoint.check_output_dir(config, "latest", is_main=True)
    message = str(error.value)
    assert f"`train.out_dir={tmp_path}` holds an earlier run (`{tmp_path / 'hf'}`)" in message
    assert f"finds no `latest` checkpoint in `ckpt.dir={tmp_path / 'checkpoints'}`" in message and "\n" not in message
    for way_out in ("`--ckpt.dir`", "new `--train.out_dir`", "`--train.overwrite_output_dir=true`"):
        assert way_out in message
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == before
    # Killed before its first save: its metrics are this run's own, and it starts again as before.
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    checkpoint.check_output_dir(parse_args(SFTConfig, [f"--train.out_dir={killed}"], "trainer.sft")[0], "latest", True)
    overwrite, _ = parse_args(SFTConfig, [f"--train.out_dir={tmp_path}", "--train.overwrite_output_dir=true"], "trainer.sft")
    checkpoint.check_output_dir(overwrite, "latest", is_main=True)
    assert not (tmp_path / "hf").exists()


def test_resuming_latest_with_ckpt_dir_moved_away_from_the_runs_checkpoints_is_refused(tmp_path):
    """A run stopped at step 2 (`train.exit_interval`) with its checkpoints in `<train.out_dir>/checkpoints`, resumed
    with `--resume-from-checkpoint latest --ckpt.dir` elsewhere: there is no `latest` there, so it started from step 0
    with one info line, replaced the run's metrics.jsonl rows and wrote `hf/` (measured: `trainer.sft` wrote steps 1-6
    anew, step_00000002 left unread). Refused, naming the checkpoint and `--ckpt.dir`, nothing touched."""
    from config.cli import parse_args
    from config.loops import SFTConfig

    out_dir = tmp_path / "run"
    fake_checkpoint(out_dir / "checkpoints", 2)
    (out_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n')
    before = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    config, _ = parse_args(SFTConfig, [f"--train.out_dir={out_dir}", f"--ckpt.dir={tmp_path / 'elsewhere'}"], "trainer.sft")
    with pytest.raises(UserError) as error:
        checkpoint.check_output_dir(config, "latest", is_main=True)
    message = str(error.value)
    assert f"holds an earlier run (`{out_dir / 'checkpoints' / 'step_00000002'}`)" in message
    assert f"finds no `latest` checkpoint in `ckpt.dir={tmp_path / 'elsewhere'}`" in message and "`--ckpt.dir`" in message
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == before
    # Its own ckpt.dir (the default) resumes it as before.
    checkpoint.check_output_dir(parse_args(SFTConfig, [f"--train.out_dir={out_dir}"], "trainer.sft")[0], "latest", True)



def test_resuming_latest_without_the_ckpt_dir_the_run_saved_into_is_refused(tmp_path):
    """A run that saved every 2 steps into a `--ckpt.dir` of its own, killed at step 3, resumed with
    `--resume-from-checkpoint latest` and no `--ckpt.dir`: the default `<train.out_dir>/checkpoints` holds no `latest`,
    so it started from step 0 and replaced the run's metrics without a word. Its metrics reach a save and no save was
    begun in the default directory: refused, naming the step and `--ckpt.dir`. Without a save interval reached (or
    with the default directory begun: killed in its first save) it starts again as before."""
    from config.cli import parse_args
    from config.loops import GRPOConfig

    out_dir = tmp_path / "run"
    fake_checkpoint(tmp_path / "big-disk", 2)
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text("".join(f'{{"step": {step}, "loss": 1.0}}\n' for step in range(4)))
    before = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    config, _ = parse_args(GRPOConfig, [f"--train.out_dir={out_dir}", "--ckpt.save_interval=2"], "trainer.grpo")
    with pytest.raises(UserError) as error:
        checkpoint.check_output_dir(config, "latest", is_main=True)
    message = str(error.value)
    assert (f"`train.out_dir={out_dir}` holds an earlier run (`{out_dir / 'metrics.jsonl'}`) (its metrics reach step 3, "
            f"past a save every `ckpt.save_interval=2` steps), and `--resume-from-checkpoint latest` finds no `latest` "
            f"checkpoint in `ckpt.dir={out_dir / 'checkpoints'}`") in message and "\n" not in message
    assert "`--ckpt.dir` (the one it saved into" in message
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == before
    # With the directory it saved into, it resumes; before a save's step, or killed in its first save, it starts again.
    saved_into = [f"--train.out_dir={out_dir}", "--ckpt.save_interval=2", f"--ckpt.dir={tmp_path / 'big-disk'}"]
    checkpoint.check_output_dir(parse_args(GRPOConfig, saved_into, "trainer.grpo")[0], "latest", True)
    # ... which the run's own stop line names ("stopping at step 3 (train.exit_interval); resume with ...").
    assert (resume_arguments(parse_args(GRPOConfig, saved_into, "trainer.grpo")[0])
            == f"--resume-from-checkpoint latest --ckpt.dir {tmp_path / 'big-disk'}")
    assert resume_arguments(config) == "--resume-from-checkpoint latest"
    later, _ = parse_args(GRPOConfig, [f"--train.out_dir={out_dir}", "--ckpt.save_interval=4"], "trainer.grpo")
    checkpoint.check_output_dir(later, "latest", is_main=True)
    (out_dir / "checkpoints" / ".partial-step_00000002").mkdir(parents=True)
    checkpoint.check_output_dir(config, "latest", is_main=True)

def test_overwrite_output_dir_deletes_the_earlier_run_first(tmp_path):
    config, resume = used_output_dir(tmp_path, "--train.overwrite_output_dir=true")
    (tmp_path / "notes.txt").write_text("not the trainer's")
    checkpoint.check_output_dir(config, resume, is_main=False)  # only global rank 0 deletes
    assert (tmp_path / "metrics.jsonl").exists()
    checkpoint.check_output_dir(config, resume, is_main=True)
    assert sorted(path.name for path in tmp_path.rglob("*")) == ["checkpoints", "notes.txt"]


# A run's start-up as far as its output directory (global rank 0), then a forked child (a checkpoint writer, a reward
# worker) that outlives it: both wait.
HOLDS_THE_RUN_DIRECTORY = """
import multiprocessing, sys, time
from ckpt import checkpoint
from config.cli import parse_args
from config.loops import SFTConfig
config, resume = parse_args(SFTConfig, sys.argv[1:], "trainer.sft")
checkpoint.check_output_dir(config, resume, is_main=True)
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,))
child.start()
print(child.pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.slow
def test_a_second_run_into_a_directory_a_running_run_holds_is_refused_and_deletes_nothing(tmp_path):
    """Two runs started into one `train.out_dir` (a job submitted twice): both found no earlier run and wrote the same
    metrics and checkpoints over each other; with `train.overwrite_output_dir=true` the second deleted the first's
    files as it ran. The first now holds the directory's lock (and a separate `ckpt.dir`'s) for its life: the second is
    refused in one paragraph, resumed or overwriting, and nothing is deleted; once the first is killed (its forked
    child still alive, as an orphaned writer or worker can be) a run starts there."""
    from config.cli import parse_args
    from config.loops import SFTConfig

    run, checkpoints = tmp_path / "run", tmp_path / "elsewhere"
    argv = [f"--train.out_dir={run}", f"--ckpt.dir={checkpoints}"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_THE_RUN_DIRECTORY, *argv], cwd=REPO, text=True,
                              stdout=subprocess.PIPE)
    child = None
    try:
        child = psutil.Process(int(holder.stdout.readline()))
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # the running run's first row
        for extra, resume in (([], ""), (["--train.overwrite_output_dir=true"], ""), ([], "latest")):
            config, _ = parse_args(SFTConfig, [*argv, *extra], "trainer.sft")
            with pytest.raises(UserError) as error:
                checkpoint.check_output_dir(config, resume, is_main=True)
            if not extra and not resume:  # the earlier run's metrics, said as ever
                assert "holds an earlier run" in str(error.value)
                continue
            assert str(error.value) == (
                f"`train.out_dir={run}` is in use: another run started into it is still running (a process holds the "
                f"directory's lock; `fuser -v {run}` names it). Two runs there would write the same metrics and "
                "checkpoints over each other. Wait for it to end (then `--resume-from-checkpoint latest` continues it), "
                "or give this run a new `--train.out_dir`.")
            assert (run / "metrics.jsonl").is_file()
        # Another out_dir sharing the running run's `ckpt.dir`: its lock too.
        config, _ = parse_args(SFTConfig, [f"--train.out_dir={tmp_path / 'other'}", f"--ckpt.dir={checkpoints}"],
                               "trainer.sft")
        with pytest.raises(UserError, match=rf"^`ckpt.dir={checkpoints}` is in use: another run"):
            checkpoint.check_output_dir(config, "", is_main=True)
        holder.kill()
        holder.wait()
        assert child.is_running()
        config, _ = parse_args(SFTConfig, [*argv, "--train.overwrite_output_dir=true"], "trainer.sft")
        checkpoint.check_output_dir(config, "", is_main=True)  # the lock ended with the run: it starts, over it
        assert not (run / "metrics.jsonl").exists()
    finally:
        holder.kill()
        if child is not None and child.is_running():
            child.kill()


# A process that waits for a checkpoint writer the way the loop does (megatron-core joins its forked writer, no
# timeout), for a writer that never ends.
WAITS_FOR_A_WRITER = """
import multiprocessing, time
from ckpt import checkpoint
checkpoint.catch_stop_signals()
writer = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,))
writer.start()
print("waiting", flush=True)
writer.join()
"""


@pytest.mark.slow
def test_a_second_stop_signal_stops_at_once_while_a_save_is_waited_for():
    process = subprocess.Popen([sys.executable, "-c", WAITS_FOR_A_WRITER], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    writers = []
    try:
        assert process.stdout.readline() == "waiting\n"
        writers = psutil.Process(process.pid).children()
        # One Ctrl-C, delivered twice (from the terminal, and again through torchrun): finish the step and save.
        process.send_signal(signal.SIGINT)
        process.send_signal(signal.SIGINT)
        time.sleep(checkpoint.REPEAT_AFTER_S + 0.5)
        assert process.poll() is None
        process.send_signal(signal.SIGINT)  # a second Ctrl-C
        process.wait(timeout=10)
    finally:
        process.kill()  # nothing once it has exited
        for writer in writers:  # left behind by the stand-in (a trainer's writers die with it), holding its stderr
            with contextlib.suppress(psutil.NoSuchProcess):
                writer.kill()
    stderr = process.stderr.read()
    assert process.returncode == 128 + signal.SIGINT
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if "second SIGINT" in line]
    assert len(lines) == 1 and stderr.rstrip().endswith(lines[0]), stderr
    assert "the checkpoint save in flight, if any, is abandoned" in lines[0]
    assert "`latest` still names the last complete checkpoint" in lines[0]


def test_the_writer_results_file_has_no_name_and_reaches_the_trainer_from_a_forked_writer():
    """A killed trainer left its named results file in /tmp (a few KB each); the nameless one goes with the process.
    A forked writer (as megatron-core forks it) puts its results where the trainer reads them once."""
    import queue

    before = set(os.listdir(tempfile.gettempdir()))
    results = checkpoint.WriteResults()
    with pytest.raises(queue.Empty):
        results.get_nowait()
    writer = os.fork()
    if writer == 0:  # the writer: put, and leave without the test's exit handlers
        results.put({"shard": [1, 2, 3]})
        os._exit(0)
    assert os.waitpid(writer, 0)[1] == 0
    assert results.get_nowait() == {"shard": [1, 2, 3]}
    with pytest.raises(queue.Empty):  # read once
        results.get_nowait()
    assert not [name for name in set(os.listdir(tempfile.gettempdir())) - before if "write-results" in name]


@pytest.mark.parametrize("users_value", [None, "true"])
def test_start_up_turns_tokenizer_parallelism_off_unless_the_user_set_it(monkeypatch, users_value):
    """A tokenizer used before megatron-core forks a background save's writer warns at every save without it."""
    from config import cli

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", users_value or "")  # so the test's own environment is restored after
    if users_value is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    seen = []
    cli.run_cli(lambda argv: seen.append(os.environ["TOKENIZERS_PARALLELISM"]))
    assert seen == [users_value or "false"]


def test_a_torn_last_row_is_left_out_and_the_checkpoints_row_comes_back(tmp_path, caplog):
    """A metrics.jsonl whose last write was cut short (a kill, a full disk) made every resume fail with a
    JSONDecodeError after the model's build; the torn line is left out with a warning, the kept rows are rewritten at
    once (a kill there emptied the file), and the checkpoint's own row, saved with it, is appended when the file lacks
    it (a run killed in its final export lost its last row for good)."""
    import json

    from ckpt.resume import restore_metrics_row
    from config import outputs
    from trainer.metrics import _continue_file

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval_loss": 2.0}\n{"step": 1, "loss": 1.5}\n{"step": 2, "loss": 1.25}\n{"step": 3, "lo')
    with caplog.at_level("WARNING"):
        assert [row["step"] for row in outputs.read_rows(path)] == [0, 1, 2]
    assert "metrics.jsonl line 4 is not a whole row (a write cut short): left out" in caplog.text
    restore_metrics_row(path, {"step": 2, "loss": 9.0})  # the file has it: unchanged
    restore_metrics_row(path, {"step": 3, "loss": 1.0})
    restore_metrics_row(path, None)  # a checkpoint from before rows were saved
    with _continue_file(path, start_step=3) as stream:
        stream.write(json.dumps({"step": 4, "loss": 0.5}) + "\n")
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 0, "eval_loss": 2.0}, {"step": 1, "loss": 1.5}, {"step": 2, "loss": 1.25}, {"step": 3, "loss": 1.0},
        {"step": 4, "loss": 0.5}]
    assert not list(tmp_path.glob(".*writing"))


def test_exit_interval_stops_after_every_multiple_as_megatron_does():
    """`train.exit_interval=N` stops (saved) after every N-th step, as Megatron-LM's and Megatron-Bridge's `step %
    exit_interval == 0`: a job resumed at step N stops at 2N, so each job of a chain runs N steps. Only step N itself
    stopped a run before, and every job after the first trained to the end. The last step is a finish (exported)."""
    import types

    from config.cli import parse_args
    from config.loops import SFTConfig

    config, _ = parse_args(SFTConfig, ["--train.steps=10", "--train.exit_interval=3"], "trainer.sft")
    checkpointer, written = object.__new__(checkpoint.Checkpointer), []
    checkpointer.config, checkpointer.background, checkpointer.slowest_step_s, checkpointer.last_save_s = config, None, 0.0, 0.0
    checkpointer.preemption = types.SimpleNamespace(agreed=lambda: False, requested_anywhere=False)
    checkpointer.save, checkpointer.wait, checkpointer.export = written.append, lambda: None, lambda: written.append("hf")
    stops = [step for step in range(4, 11) if checkpointer.maybe_save_or_export(step)]  # a job resumed at step 3
    assert stops == [6, 9]
    assert written == [6, 9, 10, "hf"]


def test_a_stop_signal_in_the_last_step_finishes_the_run_and_writes_no_stop_file(tmp_path, monkeypatch, caplog):
    """A stop signal that lands in the last step (a scheduler's warning as the run ends): the run saves and exports,
    as a finish does, but it also logged `stopping at step 10 (signal) ... Resume with --resume-from-checkpoint latest`
    and wrote the stop file, so scripts/slurm/train.sbatch requeued a finished job, which then did nothing. At the
    last step a signal changes nothing: no stop line, no stop file. A step before it still stops and writes one."""
    import types

    from config.cli import parse_args
    from config.loops import SFTConfig

    stop_file = tmp_path / "stopped"
    monkeypatch.setenv(checkpoint.STOP_FILE_VARIABLE, str(stop_file))
    config, _ = parse_args(SFTConfig, ["--train.steps=10"], "trainer.sft")
    checkpointer, written = object.__new__(checkpoint.Checkpointer), []
    checkpointer.config, checkpointer.background, checkpointer.slowest_step_s, checkpointer.last_save_s = config, None, 0.0, 0.0
    checkpointer.preemption = types.SimpleNamespace(agreed=lambda: True, requested_anywhere=True)
    checkpointer.save = lambda step: written.append(step) or tmp_path / checkpoint.checkpoint_name(step)
    checkpointer.wait, checkpointer.export = lambda: None, lambda: written.append("hf")
    with caplog.at_level("INFO"):
        checkpointer.maybe_save_or_export(10)
        assert written == [10, "hf"]
        assert "stopping at step" not in caplog.text and not stop_file.exists()
        assert checkpointer.maybe_save_or_export(9) and written[-1] == 9
    assert "stopping at step 9 (signal)" in caplog.text and stop_file.is_file()


def test_tensorboard_holds_each_step_once_after_a_resume_the_restored_row_included(tmp_path):
    """A resume logs its checkpoint's own step to TensorBoard again, once: the stopped run's events from that step on
    are purged. A run that died after the save of step 3 and before writing its row gets the row back in metrics.jsonl
    from the checkpoint (`restore_metrics_row`); TensorBoard lacked step 3 for good before (steps 1, 2, 4)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ckpt.resume import restore_metrics_row
    from config.cli import parse_args
    from config.loops import SFTConfig
    from trainer.metrics import MetricsWriter

    def run(out_dir, start_step, steps, restored=None):
        config, _ = parse_args(SFTConfig, [f"--train.out_dir={out_dir}", "--log.tensorboard=true", "--train.steps=4"],
                               "trainer.sft")
        if restored:
            restore_metrics_row(out_dir / "metrics.jsonl", restored)
        writer = MetricsWriter(config, True, start_step)
        for step in steps:
            writer.write({"step": step, "loss": 10.0 * step + start_step, "lr": 0.1})
        writer.close(draw=False)

    def tensorboard_losses(out_dir):
        accumulator = EventAccumulator(str(out_dir / "tb"), size_guidance={"scalars": 0})
        accumulator.Reload()
        return [(event.step, event.value) for event in accumulator.Scalars("loss")]

    died = tmp_path / "died-after-the-save"
    run(died, 0, [1, 2])  # step 3 was saved with its row, then the run died before writing it
    run(died, 3, [4], restored={"step": 3, "loss": 30.0, "lr": 0.1})
    assert tensorboard_losses(died) == [(1, 10.0), (2, 20.0), (3, 30.0), (4, 43.0)]
    stopped = tmp_path / "stopped-after-step-4"
    run(stopped, 0, [1, 2, 3, 4])  # resumed from the checkpoint of step 3: step 4 is trained again
    run(stopped, 3, [4])
    assert tensorboard_losses(stopped) == [(1, 10.0), (2, 20.0), (3, 30.0), (4, 43.0)]


def test_tensorboard_holds_each_step_once_after_a_restart_from_step_0(tmp_path):
    """A run killed before its first save, run again with `--resume-from-checkpoint latest` (no `latest`: it starts
    from step 0, the Slurm script's requeue), rewrites metrics.jsonl from scratch; TensorBoard kept the killed run's
    events beside the new ones, each step twice (steps 1, 2, 3, 1, 2 before)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from config.cli import parse_args
    from config.loops import SFTConfig
    from trainer.metrics import MetricsWriter

    config, _ = parse_args(SFTConfig, [f"--train.out_dir={tmp_path}", "--log.tensorboard=true", "--train.steps=4"],
                           "trainer.sft")
    for steps, offset in (([1, 2, 3], 10.0), ([1, 2], 0.0)):  # killed after step 3, then started again
        writer = MetricsWriter(config, True, 0)
        for step in steps:
            writer.write({"step": step, "loss": offset + step, "lr": 0.1})
        writer.close(draw=False)
    accumulator = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("loss")] == [(1, 1.0), (2, 2.0)]
    assert [row["step"] for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == [1, 2]


def test_a_resume_drops_the_stopped_runs_samples_past_its_checkpoint_at_once(tmp_path):
    """samples.jsonl keeps the rows up to the checkpoint's step, as metrics.jsonl does, from the resume's start: it was
    cut only at the resumed run's first logged step, so a resumed GRPO run that stopped (`train.exit_interval`, a kill)
    before one left the dead branch's samples of step 6 after metrics.jsonl's last row, step 4."""
    from config.cli import parse_args
    from config.loops import GRPOConfig
    from trainer.metrics import MetricsWriter

    config, _ = parse_args(GRPOConfig, [f"--train.out_dir={tmp_path}", "--train.steps=8"], "trainer.grpo")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 8)))
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"step": step, "reward": 1.0}) + "\n" for step in (2, 4, 6)))
    writer = MetricsWriter(config, True, 3)  # resumed from step 3's checkpoint, stopped after step 4 (not logged)
    writer.write({"step": 4, "loss": 2.0, "lr": 0.1})
    writer.close(draw=False)
    steps = lambda name: [row["step"] for row in map(json.loads, (tmp_path / name).read_text().splitlines())]  # noqa: E731
    assert steps("metrics.jsonl") == [1, 2, 3, 4]
    assert steps("samples.jsonl") == [2]
