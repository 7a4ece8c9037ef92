"""Bad input a user can give gets a one-paragraph error naming the key or file, before a model is built (issue 13)."""

import json
import logging
import re
import subprocess
import sys
import types

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
    ({"optim.weight_decay": 1000.0}, "`optim.weight_decay=1000.0` x `optim.lr=0.002` is 2: the decoupled weight decay"),
    ({"data.max_seq_len": 0}, "`data.max_seq_len` must be at least 2 (one input and one label token), got 0"),
    ({"train.log_interval": 0}, "`train.log_interval` must be at least 1"),
    ({"ckpt.keep_last": 0}, "`ckpt.keep_last` must be at least 1"),
    # Trained on (and for GRPO, rewarded against) the prompt's own text.
    ({"data.prompt_field": "answer"}, "`data.prompt_field` and `data.response_field` are both `answer`: every prompt would hold its own answer"),
    # Every file's name starts with "": a folder's training split read its test.jsonl too, and the held-out split its
    # train.jsonl (train rows ['test', 'train'], or held-out rows ['test', 'train'], without a word).
    ({"data.train_split": ""}, "`data.train_split` is empty: a folder's every file (its held-out ones too) would be read as it"),
    ({"data.eval_split": " "}, "`data.eval_split` is empty (' '): a folder's every file"),
])
def test_settings_are_checked_before_anything_runs(changes, expected):
    with pytest.raises(UserError) as error:
        make(**changes).validate(world_size=1)
    assert expected in str(error.value)


def test_precision_aware_optimizer_with_fp32_is_said_once(caplog):
    with caplog.at_level(logging.WARNING):
        make(**{"optim.use_precision_aware_optimizer": True}).validate(world_size=1)
    assert "`optim.use_precision_aware_optimizer=true` has no effect with `model.dtype=fp32`" in caplog.text


def test_rows_longer_than_the_models_positions_are_said(caplog):
    # The embedded tiny model was built with max_position_embeddings 512: 1024-token rows pass it, 512 do not.
    from model.tiny import ensure_tiny_checkpoint

    with caplog.at_level(logging.WARNING):
        make(**{"model.path": str(ensure_tiny_checkpoint()), "data.max_seq_len": 512}).validate(world_size=1)
        assert "max_position_embeddings" not in caplog.text
        config = make(**{"model.path": str(ensure_tiny_checkpoint()), "data.max_seq_len": 1024})
        config.validate(world_size=1)
        config.validate_model_shape(ensure_tiny_checkpoint())  # again as the model is built: said once a process
    assert caplog.text.count("`data.max_seq_len=1024` is longer than `model.path=") == 1
    assert "(config.json's max_position_embeddings, 512)" in caplog.text and "`--data.max_seq_len` to 512" in caplog.text


def test_a_non_utf8_data_file_names_the_file(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps({"question": "caf\u00e9?", "answer": "#### 1"}, ensure_ascii=False).encode("latin-1") + b"\n")
    with pytest.raises(UserError) as error:
        conversation_data.load_rows(str(bad))
    assert f"data.path '{bad}' is not UTF-8 text" in str(error.value) and "iconv" in str(error.value)
    # In a folder, the file and its line (it said only the folder, and a byte position within a read buffer).
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    (tmp_path / "rows" / "b.jsonl").write_bytes(b'{"question": "1", "answer": "2"}\n' + bad.read_bytes())
    with pytest.raises(UserError, match=r"is not UTF-8 text \(b.jsonl, line 2: 'utf-8' codec can't decode byte 0xe9 in "
                                        r"position 17"):
        conversation_data.load_rows(str(tmp_path / "rows"))


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


@pytest.mark.slow
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


def test_a_column_the_data_lacks_is_said_before_the_default_sft_runs(tmp_path, monkeypatch):
    """From the default start, a `data.*_field` naming no column of GRPO's or `trainer.rm`'s own data (local, or the
    bundled arithmetic) is said at once; it was said after the default SFT's 600 steps."""
    from config.cli import parse_args
    from config.loops import GRPOConfig, RMConfig
    from trainer import default_start

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}) + "\n")
    for config_class, program, argv, expected in (
            (GRPOConfig, "trainer.grpo", ["--data.path=rows.jsonl", "--data.prompt_field=prompt"],
             "data.prompt_field is 'prompt', but `rows.jsonl` (train) has no such column"),
            (GRPOConfig, "trainer.grpo", ["--data.response_field=solution"],
             "data.response_field is 'solution', but `arithmetic` (train) has no such column"),
            (RMConfig, "trainer.rm", ["--data.path=pairs.jsonl", "--data.chosen_field=better"],
             "`data.chosen_field` is 'better', but `pairs.jsonl` (train) has no such column")):
        config, _ = parse_args(config_class, argv, program)
        assert config.starts_from_default_sft()
        with pytest.raises(UserError) as error:
            default_start.validate(2, config.model.path, config.data, program)
        assert expected in str(error.value)
    config, _ = parse_args(RMConfig, ["--data.path=pairs.jsonl"], "trainer.rm")
    default_start.validate(2, config.model.path, config.data, "trainer.rm")
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


def test_a_tokenizer_transformers_cannot_load_is_named_by_its_key(tmp_path):
    """A damaged tokenizer.json (a merge naming a token its vocabulary lacks) is a paragraph naming the key that points
    at it, not the tokenizers library's traceback on every rank."""
    import shutil

    from model.tiny import ensure_tiny_checkpoint

    shutil.copytree(ensure_tiny_checkpoint(), tmp_path / "m")
    files = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    files["model"]["vocab"].pop("assistant")
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(files))
    with pytest.raises(UserError, match=r"The tokenizer of `grpo.reward_model=.*/m` cannot be loaded by transformers "
                                        r"\(Exception: Error while initializing BPE: Token `assistant` out of vocabulary\)"):
        build.load_tokenizer(tmp_path / "m", "grpo.reward_model")


def test_an_output_or_cache_directory_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """`train.out_dir` where nothing can be made (under `/proc`), and `$TRAINER_CACHE_DIR` under a file: a paragraph
    each before any work (they were tracebacks: the metrics writer's mkdir after the model was built, the tiny
    model's build)."""
    from ckpt.output_dir import check_output_dir
    from config import process

    with pytest.raises(UserError, match=r"`train.out_dir=/proc/run`: the run cannot write in `/proc` \("):
        check_output_dir(make(**{"train.out_dir": "/proc/run"}), "", True)
    check_output_dir(make(**{"train.out_dir": str(tmp_path / "a" / "b")}), "", True)
    # The check leaves nothing behind but the run's directory (made to be locked, `hold_run_directories`), empty.
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == ["a", "a/b"]
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(UserError, match="cache directory .* cannot be made: `.*file` is a file. Set \\$TRAINER_CACHE_DIR"):
        process.cache_dir()


@pytest.mark.parametrize("change, expected", [
    ({"model_type": "qwen9"}, "names `model_type` 'qwen9', which this transformers does not know"),
    ({"num_attention_heads": 0}, "gives `num_attention_heads` as 0, not a positive whole number"),
    ({"num_hidden_layers": "2"}, "gives `num_hidden_layers` as '2', not a positive whole number"),
])
def test_a_damaged_model_config_is_named_before_the_build(tmp_path, change, expected):
    """A config.json with an unknown architecture or a shape that is not a positive number: a paragraph (they were a
    ZeroDivisionError in the build, or transformers' four retries "due to network issues")."""
    import shutil

    from model.tiny import ensure_tiny_checkpoint

    model = shutil.copytree(ensure_tiny_checkpoint(), tmp_path / "model")
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(UserError, match=expected):
        make(**{"model.path": str(model)}).validate_model_shape(model)


def test_a_data_file_that_is_not_json_names_its_line_and_a_blank_one_is_empty(tmp_path):
    """A JSON lines file with one broken line names the line (it said only "An error occurred while generating the
    dataset"); a .json file of whitespace is empty (it said "Instruction 'train' corresponds to no data")."""
    (tmp_path / "bad.jsonl").write_text('{"question": "a", "answer": "b"}\n\n{"question": "a" "answer": "b"}\n')
    with pytest.raises(UserError, match=r"\(bad.jsonl, line 3, is not JSON: Expecting ',' delimiter"):
        conversation_data.load_rows(str(tmp_path / "bad.jsonl"))
    (tmp_path / "blank.json").write_text("  \n\n")
    with pytest.raises(UserError, match="blank.json is empty"):
        conversation_data.load_rows(str(tmp_path / "blank.json"))
    (tmp_path / "bad.json").write_text('[{"question": "a", "answer": "b"},]')
    with pytest.raises(UserError, match="could not be read as a table \\((?!An error occurred)"):
        conversation_data.load_rows(str(tmp_path / "bad.json"))


def test_a_folder_of_shards_names_the_shard_that_breaks_it(tmp_path):
    """A damaged or empty Parquet shard, shards with other columns, and a JSON lines line that is not an object are
    named with the file (they said "Parquet magic bytes not found", "BatchSize must be greater than 0", "column names
    don't match" with the columns of one side, "Trailing data at position 32")."""
    import pyarrow
    import pyarrow.parquet

    def shards(name: str, *tables) -> str:
        (tmp_path / name).mkdir()
        for number, table in enumerate(tables):
            pyarrow.parquet.write_table(table, tmp_path / name / f"part-{number}.parquet")
        return str(tmp_path / name)

    pair = pyarrow.Table.from_pylist([{"question": "1 + 1?", "answer": "2"}])
    damaged = shards("damaged", pair, pair)
    (tmp_path / "damaged" / "part-1.parquet").write_bytes(b"PAR1 cut short")
    checks = {damaged: "part-1.parquet is not a readable Parquet file: ",
              shards("empty", pair, pair.slice(0, 0)): "part-1.parquet holds no rows",
              shards("mixed", pair, pyarrow.Table.from_pylist([{"prompt": "1 + 1?", "response": "2"}])):
                  r"its files' columns differ: part-0.parquet has \['answer', 'question'\], part-1.parquet has \['prompt', 'response'\]"}
    (tmp_path / "list.jsonl").write_text('{"question": "a", "answer": "b"}\n[1, 2]\n')
    checks[str(tmp_path / "list.jsonl")] = r"list.jsonl, line 2, is a JSON list, not an object"
    for path, expected in checks.items():
        with pytest.raises(UserError, match=f"could not be read as a table \\({expected}"):
            conversation_data.load_rows(path)


@pytest.mark.parametrize("override, expected", [
    ({"adam_beta1": "high"}, "sets `adam_beta1` to 'high', and megatron-core's OptimizerConfig.adam_beta1 takes a number"),
    ({"use_distributed_optimizer": 1}, "OptimizerConfig.use_distributed_optimizer takes true or false"),
    ({"optimizer": "lion"}, "sets `optimizer` to 'lion'; without the emerging_optimizers package megatron-core builds adam and sgd only"),
    # torch's AdamW raised these ("Invalid beta parameter at index 0") once the model was built.
    ({"adam_beta1": 5.0}, "sets `adam_beta1` to 5.0, and megatron-core's OptimizerConfig.adam_beta1 must be a number in [0, 1)"),
    ({"lr": -1.0}, "sets `lr` to -1.0, and megatron-core's OptimizerConfig.lr must be a number, 0 or more"),
    ({"lr": "fast"}, "sets `lr` to 'fast', and megatron-core's OptimizerConfig.lr must be a number, 0 or more"),
])
def test_an_optimizer_override_of_the_wrong_kind_is_named(override, expected):
    """They were a TypeError inside megatron-core's optimizer build, or its "lion optimizer requires ..."."""
    with pytest.raises(UserError, match=re.escape(expected)):
        make(**{"optim.override_optimizer_config": override}).validate(world_size=1)
    make(**{"optim.override_optimizer_config": {"adam_beta1": 0.8, "clip_grad": 2, "lr": 1e-5, "min_lr": 1e-6}}).validate(world_size=1)


def test_a_project_name_wandb_refuses_is_said_before_the_model_is_built(monkeypatch):
    """W&B checks the project name in `wandb.init`, which the metrics writer calls after the model is built; the
    message then said to log in."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    with pytest.raises(UserError, match=r"`log.wandb_project` is not a project name W&B takes: Invalid project name 'team/run'"):
        make(**{"log.wandb": True, "log.wandb_project": "team/run"}).validate(world_size=1)
    monkeypatch.setenv("WANDB_PROJECT", "a:b")
    with pytest.raises(UserError, match=r"\$WANDB_PROJECT \(`log.wandb_project` unset\) is not a project name"):
        make(**{"log.wandb": True}).validate(world_size=1)
    make(**{"log.wandb": True, "log.wandb_project": "team-run"}).validate(world_size=1)


def test_a_checkpoint_directory_inside_an_export_is_refused(tmp_path):
    """`--ckpt.dir=<train.out_dir>/hf`: the final export replaced the directory whole and every checkpoint went with
    it, in a run that ended with status 0."""
    from ckpt.output_dir import check_output_dir

    out_dir = tmp_path / "run"
    for ckpt_dir in (out_dir / "hf", out_dir / "hf" / "saves", out_dir / "hf_adapter"):
        with pytest.raises(UserError, match=rf"`ckpt.dir={re.escape(str(ckpt_dir))}` lies inside .* every checkpoint would be deleted"):
            check_output_dir(make(**{"train.out_dir": str(out_dir), "ckpt.dir": str(ckpt_dir)}), "", True)
    check_output_dir(make(**{"train.out_dir": str(out_dir), "ckpt.dir": str(out_dir)}), "", True)


def test_an_earlier_run_in_a_shared_checkpoint_directory_names_ckpt_dir(tmp_path):
    """Two fresh runs, `--train.out_dir runs/a --ckpt.dir cks` then `--train.out_dir runs/b --ckpt.dir cks`: the second
    is refused (its saves would rotate the first run's checkpoints out), but the paragraph said `train.out_dir=runs/b`
    holds an earlier run and to write this run to a new `--train.out_dir`, which is refused the same way."""
    from ckpt.output_dir import check_output_dir

    checkpoints = tmp_path / "cks"
    (checkpoints / "step_00000002").mkdir(parents=True)
    (checkpoints / "latest").write_text("step_00000002")
    with pytest.raises(UserError) as error:
        check_output_dir(make(**{"train.out_dir": str(tmp_path / "b"), "ckpt.dir": str(checkpoints)}), "", True)
    assert f"`ckpt.dir={checkpoints}` holds an earlier run" in str(error.value)
    assert "a new `--ckpt.dir`" in str(error.value) and "new `--train.out_dir`" not in str(error.value)
    (tmp_path / "c" / "cks").mkdir(parents=True)  # the default ckpt.dir, inside train.out_dir: named by train.out_dir
    (tmp_path / "c" / "cks" / "latest").write_text("step_00000002")
    (tmp_path / "c" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match=r"`train.out_dir=.*/c` holds an earlier run .* new `--train.out_dir`"):
        check_output_dir(make(**{"train.out_dir": str(tmp_path / "c")}), "", True)


@pytest.mark.parametrize("argv, expected", [
    (["--grpo.reward_timeout=1e30"], "`grpo.reward_timeout` must be 0 (no limit, in the trainer's process) or more, at most 1e+09 s"),
    (["--grpo.tool_timeout=1e12"], "`grpo.tool_timeout` must be positive, at most 1e+09 s"),
])
def test_a_timeout_beyond_what_python_can_wait_is_refused(argv, expected):
    """A module:function reward at `grpo.reward_timeout=1e30` raised OverflowError ("timestamp out of range for platform
    time_t") at the first rollout's scoring, after the model was built; an environment's reward() from 1e12 s."""
    from config.cli import parse_args
    from config.loops import GRPOConfig

    config, _ = parse_args(GRPOConfig, ["--model.path=tiny", *argv], "trainer.grpo")
    with pytest.raises(UserError) as error:
        config.validate(world_size=1)
    assert expected in str(error.value)


@pytest.mark.parametrize("argv, world_size, expected", [
    (["--parallel.tp=0", "--grpo.rollout_processes=1"], 2, "`parallel.tp` must be at least 1, got 0"),
    (["--parallel.pp=0", "--grpo.rollout_processes=1"], 2, "`parallel.pp` must be at least 1, got 0"),
    (["--parallel.vpp=0", "--grpo.teacher=TEACHER"], 1, "`parallel.vpp` must be at least 1, got 0"),
])
def test_a_zero_parallel_degree_is_named_before_grpo_divides_by_it(argv, world_size, expected, tmp_path):
    """GRPO's rules for rollout processes and frozen models ran before the degrees' own check: a ZeroDivisionError."""
    from config.cli import parse_args
    from config.loops import GRPOConfig

    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 4}')
    argv = [argument.replace("TEACHER", str(tmp_path)) for argument in argv]
    config, _ = parse_args(GRPOConfig, ["--model.path=tiny", *argv], "trainer.grpo")
    with pytest.raises(UserError) as error:
        config.validate(world_size)
    assert expected in str(error.value)


def test_a_run_writing_where_its_default_sft_writes_is_refused(tmp_path, monkeypatch):
    """GRPO (or `trainer.rm`) from the default start with `train.out_dir` or `ckpt.dir` at the default SFT's passed every
    check (nothing was there yet), then after that SFT ran wrote over it: its metrics added to the SFT's, the SFT's
    checkpoints pruned as its own, the SFT's `hf/` (its own start) replaced by its export."""
    from config.cli import parse_args
    from config.loops import GRPOConfig, RMConfig
    from trainer import default_start

    monkeypatch.chdir(tmp_path)
    for config_class, program, argv, expected in (
            (GRPOConfig, "GRPO", ["--train.out_dir=./outputs/sft/"], "`train.out_dir=outputs/sft` is where the default SFT"),
            (RMConfig, "trainer.rm", ["--ckpt.dir=outputs/sft/checkpoints"], "`ckpt.dir=outputs/sft/checkpoints` is where")):
        config, _ = parse_args(config_class, argv, "trainer.grpo" if program == "GRPO" else program)
        sft = default_start.validate(2, config.model.path, program=program)
        with pytest.raises(UserError, match=re.escape(expected)):
            default_start.check_outputs_apart(config, sft, program)
    config, _ = parse_args(GRPOConfig, ["--train.out_dir=outputs/sft/grpo"], "trainer.grpo")
    default_start.check_outputs_apart(config, default_start.validate(2, config.model.path), "GRPO")


def test_a_default_start_trained_by_another_sft_is_said(tmp_path, monkeypatch, caplog):
    """GRPO from `outputs/sft/hf` that exists uses it as it is: one written by an SFT at seed 1234 and 600 steps,
    with `$TRAINER_DEFAULT_SFT_ARGS` now asking for seed 5 and 50 steps (which a fresh start would train), said only
    `loading outputs/sft/hf`. The settings it was trained with are now named; the same settings say nothing."""
    import torch

    from config.cli import parse_args, to_dict
    from trainer import default_start

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(default_start.ARGS_VARIABLE, raising=False)
    earlier, _ = parse_args(SFTConfig, [], "trainer.sft")  # what the earlier, default SFT recorded in its checkpoint
    step = tmp_path / "outputs" / "sft" / "checkpoints" / "step_00000600"
    step.mkdir(parents=True)
    torch.save({"step": 600, "config": to_dict(earlier)}, step / "trainer_state.pt")
    (step.parent / "latest").write_text("step_00000600")
    (tmp_path / "outputs" / "sft" / "hf").mkdir()
    (tmp_path / "outputs" / "sft" / "hf" / "config.json").write_text("{}")
    with caplog.at_level("INFO"):
        default_start.say_earlier_start("outputs/sft/hf")
        assert caplog.text == ""
        monkeypatch.setenv(default_start.ARGS_VARIABLE, "--train.seed=5 --train.steps=50")
        default_start.say_earlier_start("outputs/sft/hf")
    assert [record.levelname for record in caplog.records] == ["WARNING"]
    assert ("GRPO starts from outputs/sft/hf as an earlier SFT wrote it, with settings other than the default SFT's "
            "now (its recipe and $TRAINER_DEFAULT_SFT_ARGS='--train.seed=5 --train.steps=50'): train.steps=600 "
            "(now 50), train.seed=1234 (now 5). Delete outputs/sft" in caplog.text), caplog.text


def test_outputs_inside_a_data_folder_are_refused(tmp_path):
    """A data folder's loader reads every json/jsonl/parquet file under it: a `train.out_dir` there made the run's
    metrics.jsonl (and its export's JSON files) rows of the next start, a resume included."""
    from ckpt.output_dir import check_output_dir

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    with pytest.raises(UserError, match=r"`train.out_dir=.*/data/run` lies inside `data.path=.*/data`, a data folder"):
        check_output_dir(make(**{"data.path": str(tmp_path / "data"), "train.out_dir": str(tmp_path / "data" / "run")}), "", True)
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "test.jsonl").write_text(json.dumps({"question": "2 + 2?", "answer": "#### 4"}) + "\n")
    with pytest.raises(UserError, match=r"`ckpt.dir=.*/held/test-saves` lies inside `data.eval_path=.*/held`"):
        check_output_dir(make(**{"data.eval_path": str(tmp_path / "held"), "train.out_dir": str(tmp_path / "run"),
                                 "ckpt.dir": str(tmp_path / "held" / "test-saves")}), "", True)
    # Its test split is test.jsonl alone: checkpoints in a folder not named after a split are never read.
    check_output_dir(make(**{"data.eval_path": str(tmp_path / "held"), "train.out_dir": str(tmp_path / "run"),
                             "ckpt.dir": str(tmp_path / "held" / "saves")}), "", True)
    beside_a_file = {"data.path": str(tmp_path / "data" / "rows.jsonl"), "train.out_dir": str(tmp_path / "data" / "run")}
    check_output_dir(make(**beside_a_file), "", True)  # a data file: nothing else is read from its folder
    hidden = {"data.path": str(tmp_path / "data"), "train.out_dir": str(tmp_path / "data" / ".runs" / "sft")}
    check_output_dir(make(**hidden), "", True)  # the loader skips hidden folders
    # A folder of train.jsonl and test.jsonl: each split reads its own file, never the run's (unless named after it).
    (tmp_path / "split").mkdir()
    for name in ("train", "test"):
        (tmp_path / "split" / f"{name}.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    check_output_dir(make(**{"data.path": str(tmp_path / "split"), "train.out_dir": str(tmp_path / "split" / "runs")}), "", True)
    with pytest.raises(UserError, match=r"`train.out_dir=.*/split/training-runs` lies inside `data.path=.*/split`"):
        check_output_dir(make(**{"data.path": str(tmp_path / "split"),
                                 "train.out_dir": str(tmp_path / "split" / "training-runs")}), "", True)


def test_outputs_in_a_folder_named_like_a_bundled_set_or_model_are_kept(tmp_path, monkeypatch):
    """`data.path=arithmetic` (the default) is the bundled generator even where a folder `arithmetic/` exists: a
    `train.out_dir=arithmetic` passed its first start and was refused as "inside a data folder" on its resume; an
    overwrite of it (or of `tiny/`) was refused as destroying the run's own input."""
    from ckpt.output_dir import check_output_dir

    monkeypatch.chdir(tmp_path)
    for name in ("arithmetic", "tiny"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "metrics.jsonl").write_text("{}\n")
        check_output_dir(make(**{"train.out_dir": name}), "latest", True)
        check_output_dir(make(**{"train.out_dir": name, "train.overwrite_output_dir": True}), "", True)
    check_output_dir(make(**{"data.path": "calculator", "data.messages_field": "messages",
                             "train.out_dir": "calculator/run"}), "", True)


def test_overwrite_with_a_resume_that_continues_says_it_deletes_nothing(tmp_path, caplog):
    """`--train.overwrite_output_dir=true` beside `--resume-from-checkpoint latest` (scripts/run.sh and the Slurm script
    always pass the resume) continued the run without a word: a user restarting it got a resume, or nothing when it
    had finished. The resume still wins (a requeued job passing both must not delete its progress), and says so."""
    from ckpt.output_dir import check_output_dir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000002")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with caplog.at_level(logging.WARNING):
        check_output_dir(make(**{"train.out_dir": str(run)}), "latest", True)
    assert "deletes nothing" not in caplog.text
    with caplog.at_level(logging.WARNING):
        check_output_dir(make(**{"train.out_dir": str(run), "train.overwrite_output_dir": True}), "latest", True)
    assert ("train.overwrite_output_dir=true deletes nothing here: `--resume-from-checkpoint latest` continues the run "
            f"in {run / 'checkpoints'}. To start afresh, drop `--resume-from-checkpoint`") in caplog.text
    assert (run / "checkpoints" / "step_00000002").is_dir() and (run / "metrics.jsonl").is_file()


def test_recomputing_expert_layers_of_a_dense_model_is_refused(tmp_path):
    """`model.recompute_modules=[moe]` on a dense checkpoint recomputed nothing and saved no memory, without a word."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 4}')
    config = make(**{"model.path": str(tmp_path), "model.recompute": "selective", "model.recompute_modules": ["moe", "mlp"]})
    with pytest.raises(UserError, match="`model.recompute_modules` names `moe`, the layers of a Mixture-of-Experts model"):
        config.validate_model_shape(tmp_path)
    make(**{"model.path": str(tmp_path), "model.recompute_modules": ["moe"]}).validate_model_shape(tmp_path)  # not selective: unread


AGREED_RANK = """
import json, sys
import torch.distributed as dist
from config.errors import UserError
from config.hf import read_hf_config
from model import collectives

rank, port, node_dirs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    collectives.agreed(read_hf_config, node_dirs[rank], "model.path")
    print(json.dumps("went on"))
except UserError as error:
    print(json.dumps(str(error)))
"""


@pytest.mark.slow
def test_a_user_error_on_one_rank_after_the_process_group_formed_stops_every_rank(tmp_path):
    """GRPO and trainer.rm load the model path, the checkpoint to resume and the data after the process group formed.
    A data file bad on node 1 only (two torchrun agents, GRPO): rank 1 exited with its paragraph and rank 0, gone on
    into the model build, failed with gloo's `Connection reset by peer` traceback (NCCL would have waited out
    `parallel.timeout_minutes`). `collectives.agreed` raises rank 1's paragraph on every rank."""
    from tests.conftest import free_port

    good, empty = tmp_path / "node0-model", tmp_path / "node1-model"
    good.mkdir(), empty.mkdir()
    (good / "config.json").write_text("{}")
    command = [sys.executable, "-c", AGREED_RANK, "RANK", str(free_port()), str(good), str(empty)]
    ranks = [subprocess.Popen([*command[:3], str(rank), *command[4:]], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    said = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    own = f"`model.path={empty}` is not a Hugging Face checkpoint directory (no config.json there)"
    assert said[1].startswith(own)
    assert re.fullmatch(r"rank 1 \(on .+\) stopped: (.*)", said[0]).group(1) == said[1]


FAULTY_RANK = """
import json, sys
import torch.distributed as dist
from config.errors import UserError
from model import collectives

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

def read_shard(rank):
    if rank == 1:
        raise PermissionError("[Errno 13] Permission denied: 'train.jsonl'")
    return "rows"

try:
    print(json.dumps(collectives.agreed(read_shard, rank)))
except UserError as error:
    print(json.dumps(str(error)))
except PermissionError as error:
    print(json.dumps(f"own {error}"))
"""


@pytest.mark.slow
def test_a_fault_other_than_a_user_error_on_one_rank_stops_every_rank_with_its_paragraph(tmp_path):
    """A phase failing on one rank with an exception that is not a UserError (a file unreadable on its node) left
    `agreed` before the gather its peers waited in: gloo's peers failed with `Connection closed by peer`, NCCL's would
    have waited out `parallel.timeout_minutes`. That rank raises its own exception; the others, its paragraph."""
    from tests.conftest import free_port

    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", FAULTY_RANK, str(rank), port], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    said = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    assert said[1] == "own [Errno 13] Permission denied: 'train.jsonl'"
    assert re.fullmatch(r"rank 1 \(on .+\) stopped: PermissionError: \[Errno 13\] Permission denied: 'train.jsonl' "
                        r"\(its traceback is in that node's log\)", said[0])


SAME_EVERYWHERE_RANK = """
import json, sys
import numpy
import torch.distributed as dist
from config.errors import UserError
from config.loops import SFTConfig
from data.sft import TokenizedExamples
from model import collectives

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

def examples(last_token):
    return TokenizedExamples(numpy.array([5, 6, 7, last_token], numpy.int32), numpy.array([0, 1, 1, 1], numpy.int8),
                             numpy.array([0, 2, 4]))

said = []
for name, lr, last_token, weights in (("same", 1e-4, 9, "ab"), ("data", 1e-4, 9 + rank, "ab"),
                                      ("settings", 1e-4 * (1 + rank), 9, "ab"), ("model", 1e-4, 9, "ab"[rank])):
    config = SFTConfig()
    config.optim.lr = lr
    try:  # a frozen model as GRPO gives it: the sampled digest of its weight files
        collectives.check_same_everywhere(config, {"data.path": examples(last_token), "model.path": weights})
        said.append("went on")
    except UserError as error:
        said.append(str(error))
print(json.dumps(said))
"""


@pytest.mark.slow
def test_a_node_started_with_other_settings_or_other_data_is_refused(tmp_path):
    """Each rank parses its own command line and `--config` file and reads its own `data.path` and GRPO's frozen models:
    a node whose copy differed (node-local, stale) trained on other rows without a word (two agents, node 1's
    `train.jsonl` with other rows: exit 0; GRPO with node 1's `model.path` perturbed, its KL reference: exit 0). Every
    rank now refuses, naming the rank and what differs; the same settings and inputs go on."""
    from tests.conftest import free_port

    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", SAME_EVERYWHERE_RANK, str(rank), port], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    said = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    assert said[0] == said[1]
    same, data, settings, model = said[0]
    assert same == "went on"
    assert re.fullmatch(r"Every rank must train on what global rank 0 reads, but rank 1 on .+ read other contents from "
                        r"`data.path=arithmetic` than rank 0 did \(its node's own copy differs\).*", data)
    assert re.search(r"but rank 1 on .+ read other contents from `model.path=tiny` than rank 0 did", model)
    assert re.fullmatch(r"Every rank must run global rank 0's settings, but rank 1 on .+ was started with "
                        r"`optim.lr=0.0002` \(rank 0: 0.0001\)\. Start every node with the same command.*", settings)


def test_a_json_file_of_no_rows_or_other_values_names_what_it_holds(tmp_path):
    """A .json file's array element that is not an object, a file of one number, an empty array, lines of empty objects
    and a JSON lines line giving a key twice name what is wrong (they said "Column() changed from object to string in
    row 0", "DataFrame constructor not properly called!", "Instruction \"train\" corresponds to no data!", "Trailing
    data at position 57")."""
    rows = [{"question": "1 + 1?", "answer": "2"}]
    checks = {"element.json": (json.dumps(rows + [5]), "element.json, element 2, is a JSON int, not an object"),
              "number.json": ("5", "number.json is a JSON int, not an object or a list of objects"),
              "array.json": ("[]", "array.json holds no rows"),
              "objects.jsonl": ("{}\n{}\n", "objects.jsonl holds no rows"),
              "twice.jsonl": (json.dumps(rows[0]) + '\n{"question": "a", "answer": "b", "answer": "c"}\n',
                              "twice.jsonl, line 2, gives the key 'answer' twice")}
    for name, (text, expected) in checks.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError, match=f"could not be read as a table \\({re.escape(expected)}\\)"):
            conversation_data.load_rows(str(tmp_path / name))


def test_a_save_to_disk_folder_is_refused_with_how_to_write_rows(tmp_path):
    """A `datasets` save_to_disk folder (Arrow shards beside dataset_info.json and state.json) is named as such: its
    metadata .json files were read as data ("Couldn't cast _data_files: list<item: struct<filename: string>> ...")."""
    import datasets

    datasets.Dataset.from_list([{"question": "1 + 1?", "answer": "2"}]).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(UserError, match=r"is a folder written by `datasets`' save_to_disk.*to_parquet"):
        conversation_data.load_rows(str(tmp_path / "saved"))


def test_json_rows_come_back_as_written_when_a_column_mixes_types(tmp_path):
    """One row's number in a column of text made `datasets` keep the column as JSON text, and its reading back turned
    every other row's text that parses as JSON into that value: "2" became 2, "007" 7, "null" None, "true" True, "[1]"
    [1], so those rows were dropped as "'answer' not a string (int)" (all 5 here) though the file gives strings."""
    answers = ["2", "007", "null", "true", "[1]", 5]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps({"question": "q", "answer": answer}) + "\n" for answer in answers))
    (tmp_path / "mixed.json").write_text(json.dumps([{"question": "q", "answer": answer} for answer in answers]))
    for name in ("mixed.jsonl", "mixed.json"):
        rows = conversation_data.load_rows(str(tmp_path / name))
        assert [row["answer"] for row in rows] == answers
        _, report = conversation_data.to_conversations(rows)
        assert (report.used, dict(report.dropped_by_reason)) == (5, {"'answer' not a string (int)": 1})


def test_a_json_lines_file_holding_one_array_of_rows_is_read(tmp_path):
    """A .jsonl file of one JSON array (over several lines) is read as the .json form, as the hub's loader reads it."""
    (tmp_path / "rows.jsonl").write_text('[{"question": "1 + 1?", "answer": "2"},\n {"question": "2 + 2?", "answer": "4"}]\n')
    assert [row["answer"] for row in conversation_data.load_rows(str(tmp_path / "rows.jsonl"))] == ["2", "4"]


def test_a_folder_named_like_a_data_file_is_read_as_the_folder_of_its_parts(tmp_path):
    """Spark writes `train.parquet/` as a folder of part files: the folder was taken for a file of the split, and
    reading it said "train.parquet is not a readable Parquet file: [Errno 21] Is a directory" (a JSON lines folder so
    named said the same, a Parquet reason for a JSON file)."""
    import pyarrow
    import pyarrow.parquet

    (tmp_path / "spark" / "train.parquet").mkdir(parents=True)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"question": "1 + 1?", "answer": "2"}]),
                                tmp_path / "spark" / "train.parquet" / "part-00000.parquet")
    (tmp_path / "lines" / "train.jsonl").mkdir(parents=True)
    (tmp_path / "lines" / "train.jsonl" / "part-0.jsonl").write_text(json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n")
    assert [row["answer"] for row in conversation_data.load_rows(str(tmp_path / "spark"))] == ["2"]
    assert [row["answer"] for row in conversation_data.load_rows(str(tmp_path / "lines"))] == ["4"]


def test_a_folder_of_held_out_files_alone_has_no_training_split(tmp_path):
    """A folder holding only test.jsonl trained on it, and its test split evaluated on the same rows, without a word
    (train and held-out rows both ['held']); the hub's loader has no train split there either."""
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "test.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "held"}) + "\n")
    with pytest.raises(UserError, match=r"has no train split: its files are all named after held-out splits \(test.jsonl\)"):
        conversation_data.load_rows(str(tmp_path / "rows"))
    assert [row["answer"] for row in conversation_data.load_rows(str(tmp_path / "rows"), split="test")] == ["held"]


def test_a_symlinked_folder_in_a_data_folder_is_read(tmp_path):
    """A split folder that is a symlink (data/train -> the rows elsewhere) was not entered: the training split read
    only the folder's other files (['extra'] here), unsaid. A link back up the tree is not walked again."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "part-0.jsonl").write_text(json.dumps({"question": "1 + 1?", "answer": "linked"}) + "\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "data" / "extra.jsonl").write_text(json.dumps({"question": "2 + 2?", "answer": "extra"}) + "\n")
    (tmp_path / "data" / "up").symlink_to(tmp_path)
    assert [row["answer"] for row in conversation_data.load_rows(str(tmp_path / "data"))] == ["linked"]
    (tmp_path / "data" / "train" / "gone.jsonl").symlink_to(tmp_path / "absent.jsonl")
    with pytest.raises(UserError, match=r"train/gone.jsonl is a symlink to nothing \(.*absent.jsonl\)"):
        conversation_data.load_rows(str(tmp_path / "data"))


def test_a_broken_held_out_file_of_the_data_folder_is_refused_not_skipped(tmp_path, caplog):
    """A folder's test.jsonl with a line that is not JSON only skipped evaluation with a warning ("no held-out split
    found, so evaluation is skipped"), and the run trained on: the file is there, it is broken. A folder without
    test* files still skips evaluation."""
    from data.prompts import held_out_split

    row = json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n"
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "train.jsonl").write_text(row)
    data = types.SimpleNamespace(path=str(tmp_path / "rows"), eval_path="", eval_split="test", train_split="train")
    load = lambda path, split: conversation_data.load_rows(path, split=split)  # noqa: E731
    with caplog.at_level(logging.WARNING):
        assert held_out_split(data, load) is None
    assert "evaluation is skipped" in caplog.text
    (tmp_path / "rows" / "test.jsonl").write_text(row + "{broken\n")
    with pytest.raises(UserError, match=r"test.jsonl, line 2, is not JSON"):
        held_out_split(data, load)


def test_json_files_of_one_name_in_two_folders_are_both_read(tmp_path):
    """Files are told apart by their path in the folder, not their name (part-0.jsonl in two shard folders)."""
    for shard, answer in (("a", "2"), ("b", "4")):
        (tmp_path / "rows" / "train" / shard).mkdir(parents=True)
        (tmp_path / "rows" / "train" / shard / "part-0.jsonl").write_text(json.dumps({"question": "q", "answer": answer}) + "\n")
    assert [row["answer"] for row in conversation_data.load_rows(str(tmp_path / "rows"))] == ["2", "4"]
    (tmp_path / "rows" / "train" / "b" / "part-0.jsonl").write_text(json.dumps({"prompt": "q", "answer": "4"}) + "\n")
    with pytest.raises(UserError, match=r"its files' columns differ: train/a/part-0.jsonl has \['answer', 'question'\], "
                                        r"train/b/part-0.jsonl has \['answer', 'prompt'\]"):
        conversation_data.load_rows(str(tmp_path / "rows"))
