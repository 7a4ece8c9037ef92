"""Bad input a user can give gets a one-paragraph error naming the key or file, before a model is built (issue 13)."""

import json
import logging
import subprocess
import sys

import pytest

from config.errors import UserError
from config.loops import SFTConfig
from data import conversations as conversation_data
from model import build
from tests.conftest import REPO


def make(**changes) -> SFTConfig:
    """The SFT defaults with dotted changes, e.g. make(**{'optim.betas': [0.9]})."""
    config = SFTConfig()
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    return config


@pytest.mark.parametrize("changes, expected", [
    ({"optim.betas": [1.5, 0.9]}, "`optim.betas` must be two numbers in [0, 1), [beta1, beta2], got [1.5, 0.9]"),
    ({"optim.betas": [0.9]}, "`optim.betas` must be two numbers in [0, 1), [beta1, beta2], got [0.9]"),
    ({"optim.betas": [0.9, 0.95, 0.99]}, "got [0.9, 0.95, 0.99]. Change `--optim.betas`"),
    ({"optim.eps": 0.0}, "`optim.eps` must be positive, got 0.0"),
    ({"optim.lr": -1.0}, "`optim.lr` must be 0 or more"),
    ({"data.max_seq_len": 0}, "`data.max_seq_len` must be at least 2 (one input and one label token), got 0"),
    ({"train.log_interval": 0}, "`train.log_interval` must be at least 1"),
    ({"ckpt.keep_last": 0}, "`ckpt.keep_last` must be at least 1"),
])
def test_settings_are_checked_before_anything_runs(changes, expected):
    with pytest.raises(UserError) as error:
        make(**changes).validate(world_size=1)
    assert expected in str(error.value)


def test_precision_aware_optimizer_with_fp32_is_said_once(caplog):
    with caplog.at_level(logging.WARNING):
        make(**{"optim.use_precision_aware_optimizer": True}).validate(world_size=1)
    assert "`optim.use_precision_aware_optimizer=true` has no effect with `model.dtype=fp32`" in caplog.text


def test_a_non_utf8_data_file_names_the_file(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps({"question": "caf\u00e9?", "answer": "#### 1"}, ensure_ascii=False).encode("latin-1") + b"\n")
    with pytest.raises(UserError) as error:
        conversation_data.load_rows(str(bad))
    assert f"data.path '{bad}' is not UTF-8 text" in str(error.value) and "iconv" in str(error.value)


def test_an_empty_data_file_says_it_is_empty(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError) as error:
        conversation_data.load_rows(str(tmp_path / "empty.jsonl"))
    assert "empty.jsonl is empty" in str(error.value)


def test_a_truncated_safetensors_file_is_named_before_the_build(tmp_path):
    import shutil

    from model.tiny import ensure_tiny_checkpoint

    model = shutil.copytree(ensure_tiny_checkpoint(), tmp_path / "model")
    weights = model / "model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    with pytest.raises(UserError) as error:
        build.resolve_model_path(make(**{"model.path": str(model)}))
    assert f"`{weights}` is truncated or corrupted" in str(error.value) and "`--model.path`" in str(error.value)


@pytest.mark.parametrize("argv, expected", [
    (["--optim.betas=[1.5,0.9]"], "`optim.betas` must be two numbers in [0, 1)"),
    (["--optim.betas=[0.9"], "`--optim.betas=[0.9` is not a valid value"),
])
def test_the_entry_point_prints_one_paragraph(argv, expected):
    result = subprocess.run([sys.executable, "-m", "trainer.sft", *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and expected in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_a_bad_data_file_is_said_before_the_default_sft_runs(tmp_path, monkeypatch):
    """From the default start (no outputs/sft/hf yet), GRPO and `trainer.rm` read their own local data once before
    the default SFT's 600 steps: an empty file is said at once (it was said after that SFT's run)."""
    from config.cli import parse_args
    from config.loops import GRPOConfig, RMConfig
    from trainer import default_start

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    for config_class, program in ((GRPOConfig, "trainer.grpo"), (RMConfig, "trainer.rm")):
        config, _ = parse_args(config_class, ["--data.path=empty.jsonl"], program)
        assert config.starts_from_default_sft()
        with pytest.raises(UserError, match="empty.jsonl.*is empty"):
            default_start.validate(2, config.model.path, config.data, program)
    assert not (tmp_path / "outputs").exists()


def test_a_checkpoint_without_weight_files_is_named(tmp_path):
    """A config.json without its safetensors (a partial copy, or .bin weights) is a paragraph, not Bridge's
    FileNotFoundError after the process group is up."""
    import shutil

    from model import build
    from model.tiny import ensure_tiny_checkpoint

    shutil.copytree(ensure_tiny_checkpoint(), tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(UserError, match="holds no `\\*.safetensors` weight files"):
        build.check_weight_files(tmp_path / "m")
