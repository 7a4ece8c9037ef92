"""Config system: the frozen key set, YAML + dotted overrides, and start-up errors that name the key."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO
from config import cli, sections
from config.cli import flat_keys, parse_args
from config.errors import UserError
from config.loops import GRPOConfig, RMConfig, SFTConfig

SFT_KEYS = {
    "model.path", "model.dtype", "model.attention",
    "model.recompute", "model.recompute_modules", "model.recompute_method", "model.recompute_num_layers",
    "model.moe_aux_loss_coeff", "model.moe_aux_loss_type", "model.moe_z_loss_coeff", "model.moe_router_dtype",
    "model.moe_freeze_router",
    "parallel.tp", "parallel.pp", "parallel.vpp", "parallel.sequence_parallel", "parallel.use_megatron_fsdp",
    "parallel.use_distributed_optimizer", "parallel.timeout_minutes",
    "parallel.ep", "parallel.etp", "model.moe_dispatcher",
    "optim.lr", "optim.min_lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.weight_decay", "optim.clip_grad", "optim.betas", "optim.eps",
    "optim.use_precision_aware_optimizer", "optim.main_grads_dtype", "optim.exp_avg_dtype", "optim.exp_avg_sq_dtype",
    "optim.override_optimizer_config", "ddp.override_ddp_config",
    "data.path", "data.hub_config", "data.eval_path", "data.train_split", "data.eval_split", "data.prompt_field",
    "data.response_field", "data.messages_field",
    "data.max_seq_len", "data.pack", "data.chat_template_kwargs", "data.cache",
    "train.steps", "train.global_batch_size", "train.micro_batch_size", "train.micro_batch_tokens", "train.seed", "train.out_dir", "train.overwrite_output_dir", "train.exit_interval",
    "train.eval_interval", "train.eval_samples", "train.log_interval",
    "ckpt.dir", "ckpt.save_interval", "ckpt.keep_last", "ckpt.async_save",
    "log.tensorboard", "log.wandb", "log.wandb_project", "log.wandb_name",
    "peft.method", "peft.rank", "peft.alpha", "peft.dropout", "peft.target_modules",
}


def test_key_set_is_frozen():
    """Adding or renaming a key must be a deliberate change to this list (and to the README); reward-model training
    has SFT's keys and the preference pairs' two columns."""
    assert set(flat_keys(SFTConfig)) == SFT_KEYS
    assert set(flat_keys(RMConfig)) == SFT_KEYS | {"data.chosen_field", "data.rejected_field"}


def test_every_key_has_help():
    assert all(field.metadata.get("help") for config in (SFTConfig, RMConfig) for field in flat_keys(config).values())


def test_yaml_then_overrides_in_both_spellings(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model:\n  dtype: bf16\ntrain:\n  steps: 7\noptim:\n  override_optimizer_config:\n    adam_eps: 1.0e-6\n")
    config, resume = parse_args(SFTConfig, ["--config", str(yaml_file), "--train.steps=9", "--optim.betas", "[0.8, 0.9]",
                                            "--optim.lr=1", "--resume-from-checkpoint", "latest"], "trainer.sft")
    assert config.model.dtype == "bf16"
    assert config.train.steps == 9  # the command line wins over the file
    assert config.optim.betas == [0.8, 0.9]
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.optim.override_optimizer_config == {"adam_eps": 1e-6}
    assert resume == "latest"


@pytest.mark.parametrize("argv, expected", [
    (["--train.stpes=3"], "Unknown config key `train.stpes`. Did you mean `train.steps`?"),
    (["--grpo.n_samples=4"], "Unknown config key `grpo.n_samples`. This entry point has no `grpo` section (its sections: model,"),
    (["--train=3"], "Unknown config key `train`. `train` is a section: set its keys, `--train.KEY=VALUE`."),
    (["--steps=3"], "Unknown config key `steps`. Keys are `section.name`; did you mean `train.steps`?"),
    (["--path=x"], "Unknown config key `path`. Keys are `section.name`; did you mean `model.path`, `data.path`?"),
    (["--train.steps=many"], "`train.steps` must be an integer, got 'many'"),
    (["--parallel.use_megatron_fsdp=3"], "`parallel.use_megatron_fsdp` must be true or false"),
    (["--optim.betas=0.9"], "`optim.betas` must be a list"),
    (["stray"], "Unexpected argument `stray`"),
    (["--config", "/nonexistent.yaml"], "Config file `/nonexistent.yaml` does not exist"),
])
def test_parse_errors_name_the_key(argv, expected):
    with pytest.raises(UserError, match=None) as error:
        parse_args(SFTConfig, argv, "trainer.sft")
    assert expected in str(error.value)


def make(**sections) -> SFTConfig:
    """A config with some keys changed, e.g. make(parallel={'tp': 2})."""
    config = SFTConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    return config


def test_validate_startup_errors(tmp_path):
    qwen_like = tmp_path / "model"
    qwen_like.mkdir()
    (qwen_like / "config.json").write_text('{"model_type": "qwen2", "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24}')
    cases = [
        (make(model={"dtype": "fp64"}), 1, "`model.dtype=fp64` is not one of fp32, bf16, fp16"),
        (make(model={"attention": "flash"}), 1, "`model.attention=flash` is not one of auto, sdpa, local, transformer_engine"),
        (make(model={"path": str(tmp_path / "missing")}), 1, "is not a Hugging Face checkpoint directory"),
        (make(parallel={"tp": 2}), 3, "`parallel.tp=2` x `parallel.pp=1` must divide the number of processes (3)"),
        (make(model={"path": str(qwen_like)}, parallel={"tp": 4}), 4, "`parallel.tp=4` must divide the model's 14 attention heads"),
        (make(model={"path": str(qwen_like)}, parallel={"pp": 5}), 5, "must divide the model's 24 layers"),
        (make(parallel={"vpp": 2}), 1, "`parallel.vpp` > 1 needs pipeline parallelism"),
        (make(parallel={"timeout_minutes": 0}), 1, "`parallel.timeout_minutes` must be at least 1, got 0."),
        (make(parallel={"timeout_minutes": 10**10}), 1, "`parallel.timeout_minutes` must be at most 10000000"),
        (make(parallel={"pp": 2, "use_megatron_fsdp": True}), 2, "`parallel.use_megatron_fsdp=true` does not work with pipeline"),
        (make(train={"global_batch_size": 6, "micro_batch_size": 4}), 1, "`train.global_batch_size=6` must be a multiple"),
        (make(train={"micro_batch_tokens": 100}), 1, "`train.micro_batch_tokens` must be 0 (off) or at least `data.max_seq_len=128`"),
        (make(model={"path": str(qwen_like)}, train={"micro_batch_tokens": 512}, parallel={"pp": 2}), 2,
         "pipeline stages (`parallel.pp=2`) exchange activations of one shape"),
        (make(train={"micro_batch_tokens": 512}, data={"pack": True}), 1, "Choose one: `--train.micro_batch_tokens=0`"),
        (make(train={"micro_batch_tokens": 512, "global_batch_size": 5}), 2, "must be a multiple of the data-parallel size 2"),
    ]
    for config, world_size, expected in cases:
        with pytest.raises(UserError) as error:
            config.validate(world_size)
        assert expected in str(error.value)
    make(model={"path": str(qwen_like)}, parallel={"tp": 2, "pp": 2}).validate(8)  # a valid layout passes


def test_transformer_engine_attention_needs_transformer_engine(monkeypatch):
    """Asking for TE layers without TE installed is refused at start-up, naming the key."""
    monkeypatch.setattr(sections, "have_transformer_engine", lambda: False)
    with pytest.raises(UserError) as error:
        make(model={"attention": "transformer_engine"}).validate(1)
    assert "`model.attention=transformer_engine` needs Transformer Engine" in str(error.value)
    make(model={"attention": "local"}).validate(1)


def run_module(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer.sft ARGS` as a single process, no torchrun (`env`: variables added to this one's)."""
    return subprocess.run([sys.executable, "-m", "trainer.sft", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_help_without_torchrun():
    result = run_module("--help")
    assert result.returncode == 0
    for key in SFT_KEYS:
        assert f"--{key}=" in result.stdout
    assert "--resume-from-checkpoint" in result.stdout
    assert "[--config FILE.yaml|RECIPE]" in result.stdout and "dapo, dr_grpo, grpo, gspo, rloo" in result.stdout
    # Under torchrun the help is printed once, by global rank 0 (`scripts/run.sh --help` printed it once a process).
    other_rank = run_module("--help", env={"RANK": "1", "WORLD_SIZE": "2"})
    assert other_rank.returncode == 0 and other_rank.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("argv, expected", [
    (["--no.such=1"], "Unknown config key `no.such`"),
    (["--train.steps=x"], "`train.steps` must be an integer"),
    (["--model.path=/does/not/exist"], "`model.path=/does/not/exist` is not a Hugging Face checkpoint directory"),
])
def test_bad_values_exit_nonzero_with_one_paragraph(argv, expected):
    result = run_module(*argv)
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1  # one paragraph, no traceback wall


def test_user_error_is_reported_by_rank_zero_only(monkeypatch, capsys):
    def failing(argv):
        raise UserError("bad `x`")

    monkeypatch.setattr(sys, "argv", ["trainer.sft"])
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        cli.run_cli(failing)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ""


def test_a_start_up_error_on_one_rank_ends_its_peers_waiting_to_join_the_process_group(monkeypatch, capsys):
    """Two nodes, a data file bad on node 1 only: rank 1 stopped before joining the process group, and rank 0 waited in
    `init_process_group` for `parallel.timeout_minutes` (30 by default; measured with static rendezvous, 2 agents: rank 0
    still waiting when killed 4 min later). Through torchrun's store (served by the agent, which a test `TCPStore`
    stands for) rank 0 now stops at once with rank 1's paragraph; ranks that all arrive go on."""
    import threading
    import time

    import torch.distributed as dist

    from config import process
    from tests.conftest import free_port

    def failing(argv):
        raise UserError("`data.path=train.jsonl` has no column `question`")

    def torchrun_rank(rank: int, restart: int):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("WORLD_SIZE", "2"),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["trainer.sft"])
    torchrun_rank(1, restart=0)
    with pytest.raises(SystemExit):
        cli.run_cli(failing)
    torchrun_rank(0, restart=0)
    started = time.monotonic()
    with pytest.raises(UserError) as error:
        process.meet_peers_at_startup(timeout_s=60)
    assert time.monotonic() - started < 5
    assert str(error.value).startswith("rank 1 (on ") and str(error.value).endswith(
        "stopped at start-up: `data.path=train.jsonl` has no column `question`")
    # The next attempt of the launch (torchrun's restart count): both ranks arrive, and both go on.
    torchrun_rank(0, restart=1)
    peer = threading.Thread(target=process.meet_peers_at_startup, args=(60,))
    peer.start()
    process.meet_peers_at_startup(timeout_s=60)
    peer.join(timeout=10)
    assert not peer.is_alive() and agent_store.add(f"{process.STARTUP_KEYS}/1-2/arrived", 0) == 2


def test_nodes_whose_agents_count_restarts_apart_do_not_wait_for_each_other(monkeypatch):
    """`--max-restarts 1`, two agents (c10d, one process each), node 1's worker dying after the group formed: node 1's
    agent counted a restart and node 0's restarted its worker for the new rendezvous without counting one
    (TORCHELASTIC_RESTART_COUNT 1 and 0), so the two met under other prefixes and each waited out the whole meeting
    (90 s of 90 s; 30 min by default) before joining. Several agents that may restart skip the meeting."""
    import time

    import torch.distributed as dist

    from config import process
    from tests.conftest import free_port

    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("WORLD_SIZE", "2"),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True"), ("GROUP_WORLD_SIZE", "2"),
                        ("TORCHELASTIC_MAX_RESTARTS", "1"), ("RANK", "0"), ("TORCHELASTIC_RESTART_COUNT", "0")):
        monkeypatch.setenv(name, value)
    agent_store.add(f"{process.STARTUP_KEYS}/0-2/arrived", 2)  # both arrived in the first attempt
    agent_store.add(f"{process.STARTUP_KEYS}/1-2/arrived", 1)  # node 1's restarted worker, under its own count
    started = time.monotonic()
    process.meet_peers_at_startup(timeout_s=10)  # node 0's restarted worker
    assert time.monotonic() - started < 5


def test_min_lr_follows_lr_unless_set_and_may_not_exceed_it():
    from config.loops import GRPOConfig

    config, _ = parse_args(SFTConfig, ["--optim.lr", "1e-5"], "trainer.sft")
    config.validate(world_size=2)  # the README's SFT learning rate alone: the decay ends at a twentieth of it
    assert config.optim.final_lr == pytest.approx(5e-7)
    assert parse_args(SFTConfig, [], "trainer.sft")[0].optim.final_lr == 1e-4  # the default SFT's, as before
    grpo, _ = parse_args(GRPOConfig, ["--optim.lr=5e-5"], "trainer.grpo")
    assert grpo.optim.final_lr == 5e-5  # GRPO: a constant rate after warmup
    config, _ = parse_args(SFTConfig, ["--optim.lr=1e-4", "--optim.min_lr=1e-3"], "trainer.sft")
    with pytest.raises(UserError) as error:
        config.validate(world_size=2)
    assert "`optim.min_lr=0.001` is above `optim.lr=0.0001`" in str(error.value) and "`--optim.min_lr`" in str(error.value)
    assert parse_args(SFTConfig, ["--optim.min_lr=null", "--optim.lr=1e-3"], "trainer.sft")[0].optim.final_lr == 5e-5


def test_an_override_lr_below_the_schedule_floor_is_refused_at_start_up():
    """`optim.override_optimizer_config` `lr` is the peak the schedule runs (model.build.warmup_cosine_schedule): one
    below the floor (optim.lr x min_lr_ratio, 1e-4 by default) failed megatron-core's scheduler assertion after the
    model was built; refused here naming both keys. With its own `min_lr` under it, it passes."""
    config, _ = parse_args(SFTConfig, ["--optim.override_optimizer_config={lr: 1.0e-5}"], "trainer.sft")
    with pytest.raises(UserError) as error:
        config.validate(world_size=1)
    assert "min_lr=0.0001, above its peak, lr=1e-05" in str(error.value) and "`optim.override_optimizer_config`" in str(error.value)
    config, _ = parse_args(SFTConfig, ["--optim.override_optimizer_config={lr: 1.0e-5, min_lr: 1.0e-6}"], "trainer.sft")
    config.validate(world_size=1)


@pytest.mark.parametrize("dtype, override, names", [
    ("bf16", "{exp_avg_dtype: bf16}", "`--optim.exp_avg_dtype`"),
    ("fp32", "{params_dtype: fp16}", "`--model.dtype`"),
    ("fp16", "{fp16: false}", "`--model.dtype`"),
    ("fp32", "{bf16: true}", "`--model.dtype`"),
    ("bf16", "{use_precision_aware_optimizer: true}", "`--optim.use_precision_aware_optimizer`"),
])
def test_precision_fields_in_the_optimizer_override_are_refused_at_start_up(dtype, override, names):
    """OptimizerConfig's precision fields are set from `model.dtype` and `optim.*`: through the override, a dtype field
    arrived as text (`exp_avg_dtype: bf16` failed megatron-core's assertion after the model was built; `params_dtype:
    fp16` went in as the string 'fp16' without a word), `fp16: false` trained an fp16 model without its loss scale
    (loss_scale 1, no overflow check), and the flags skipped the start-up checks of the keys that set them. Refused,
    naming the key to set; a flag that agrees with the run's is accepted."""
    config, _ = parse_args(SFTConfig, [f"--model.dtype={dtype}", f"--optim.override_optimizer_config={override}"],
                           "trainer.sft")
    with pytest.raises(UserError) as error:
        config.validate(world_size=1)
    assert "`optim.override_optimizer_config`" in str(error.value) and names in str(error.value)
    agreeing, _ = parse_args(SFTConfig, ["--model.dtype=bf16", "--optim.override_optimizer_config={bf16: true, fp16: false}"],
                             "trainer.sft")
    agreeing.validate(world_size=1)


def test_the_config_reference_in_docs_is_current():
    """docs/config.md is generated from both loops' `--help`; a new or changed key must regenerate it."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=repo, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_packing_is_refused_where_the_attention_would_ignore_its_mask(monkeypatch):
    """With Transformer Engine installed, `model.attention=auto` is TE's attention, which runs causal over the whole
    packed row (the block-diagonal mask unused): refused, naming sdpa; SDPA packs."""
    import config.loops

    monkeypatch.setattr(config.loops, "have_transformer_engine", lambda: True)
    config, _ = parse_args(SFTConfig, ["--model.path=tiny", "--data.pack=true"], "trainer.sft")
    with pytest.raises(UserError, match="each sample would attend to the ones packed before it. Set `--model.attention=sdpa`"):
        config.validate(world_size=1)
    config, _ = parse_args(SFTConfig, ["--model.path=tiny", "--data.pack=true", "--model.attention=sdpa"], "trainer.sft")
    config.validate(world_size=1)


def test_packing_one_sample_a_micro_batch_is_said_at_start_up(caplog):
    """Packing fills rows with one micro-batch's samples: at `train.micro_batch_size=1` it packs nothing and pads every
    sample to `data.max_seq_len` (said at start-up); at 2 and more, nothing is said."""
    config, _ = parse_args(SFTConfig, ["--model.path=tiny", "--data.pack=true", "--train.micro_batch_size=1",
                                       "--train.global_batch_size=8"], "trainer.sft")
    with caplog.at_level("WARNING"):
        config.validate(world_size=1)
    assert "nothing is packed, and every sample is padded to 128 tokens" in caplog.text
    caplog.clear()
    config, _ = parse_args(SFTConfig, ["--model.path=tiny", "--data.pack=true", "--train.micro_batch_size=2",
                                       "--train.global_batch_size=8"], "trainer.sft")
    with caplog.at_level("WARNING"):
        config.validate(world_size=1)
    assert "nothing is packed" not in caplog.text


def test_numbers_in_mappings_and_text_keys_read_as_typed():
    """YAML 1.1 reads `1e-5` as a string: inside megatron-core's override mappings it is the number (it reached
    OptimizerConfig as '1e-5'); a text key keeps its text as typed (`0001` was read as the integer 1)."""
    config, _ = parse_args(SFTConfig, ["--optim.override_optimizer_config={lr: 1e-5, adam_eps: 1.0e-6, name: x}",
                                       "--log.wandb_name=0001", "--ddp.override_ddp_config", "{bucket_size: 4e7}"],
                           "trainer.sft")
    assert config.optim.override_optimizer_config == {"lr": 1e-5, "adam_eps": 1e-6, "name": "x"}
    assert config.ddp.override_ddp_config == {"bucket_size": 4e7} and config.log.wandb_name == "0001"


def test_the_same_split_for_training_and_held_out_is_refused():
    config, _ = parse_args(SFTConfig, ["--model.path=tiny", "--data.eval_split=train"], "trainer.sft")
    with pytest.raises(UserError, match="`data.train_split` and `data.eval_split` are both `train`: the held-out figures"):
        config.validate(world_size=1)


@pytest.mark.parametrize("argv, expected", [
    (["--optim.lr=inf"], "`optim.lr` must be a finite number, got inf"),
    (["--grpo.format_bonus=.nan"], "`grpo.format_bonus` must be a finite number, got nan"),
    (["--train.seed=-1"], "`train.seed` must be from 0 to 2**32 - 1"),
])
def test_numbers_outside_what_the_run_can_use_are_refused_by_name(argv, expected):
    with pytest.raises(UserError, match=re.escape(expected)):
        config, _ = parse_args(GRPOConfig, ["--model.path=tiny", *argv], "trainer.grpo")
        config.validate(world_size=1)


def test_output_directories_that_are_files_or_empty_are_refused_before_any_work(tmp_path):
    from ckpt.output_dir import check_output_dir

    (tmp_path / "afile").write_text("x")
    for argv, expected in ((["--train.out_dir="], "`train.out_dir` is empty"),
                           ([f"--train.out_dir={tmp_path / 'afile'}"], "is a file, not a directory"),
                           ([f"--train.out_dir={tmp_path / 'afile' / 'sub'}"], "is a file, not a directory"),
                           ([f"--train.out_dir={tmp_path / 'out'}", f"--ckpt.dir={tmp_path / 'afile'}"],
                            "`ckpt.dir=")):
        config, _ = parse_args(SFTConfig, argv, "trainer.sft")
        with pytest.raises(UserError, match=re.escape(expected)):
            check_output_dir(config, "", True)
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "config.json").write_text("[1, 2]")
    config, _ = parse_args(SFTConfig, [f"--model.path={tmp_path / 'listed'}"], "trainer.sft")
    with pytest.raises(UserError, match="holds a JSON list, not the mapping of settings"):
        config.validate(world_size=1)


def test_a_config_that_is_a_directory_is_said_as_such(tmp_path):
    with pytest.raises(UserError, match="is a directory, not a YAML file"):
        parse_args(SFTConfig, ["--config", str(tmp_path)], "trainer.sft")


def test_a_second_config_is_refused_rather_than_replacing_the_first():
    """`--config tools --config dapo` kept DAPO and dropped the tools without a word (and the other order the reverse)."""
    with pytest.raises(UserError, match=r"`--config` is given twice \(tools and dapo\): the second would replace the first"):
        parse_args(GRPOConfig, ["--config", "tools", "--config=dapo"], "trainer.grpo")
    config, _ = parse_args(GRPOConfig, ["--config", "tools", "--grpo.dynamic_sampling=true"], "trainer.grpo")
    assert config.grpo.tools and config.grpo.dynamic_sampling  # a recipe, and another's keys on the command line


@pytest.mark.parametrize("loop, program", [(SFTConfig, "trainer.sft"), (GRPOConfig, "trainer.grpo"), (RMConfig, "trainer.rm")])
def test_an_empty_data_path_is_refused_rather_than_reading_the_current_directory(loop, program):
    """`--data.path=` was the current directory to the loaders: its JSON files (a tokenizer's, in a run's folder) were
    read as rows, or a hub error about a repository id for a blank one."""
    for value in ("", " "):
        config, _ = parse_args(loop, [f"--data.path={value}", "--model.path=tiny"], program)
        with pytest.raises(UserError, match=r"`data.path` is empty.*Set `--data.path`"):
            config.validate(world_size=1)


@pytest.mark.parametrize("argv, expected", [
    (["--optim.betas=[nonsense, 0.9]"], "`optim.betas` must be a list of finite numbers, got ['nonsense', 0.9]"),
    (["--optim.betas=[.nan, 0.9]"], "`optim.betas` must be a list of finite numbers, got [nan, 0.9]"),
    (["--grpo.tools=[[a, b]]"], "`grpo.tools` must be a list of strings, got [['a', 'b']]"),
])
def test_a_list_key_with_a_bad_item_names_the_list(argv, expected):
    """They said "`optim.betas` must be a number, got 'nonsense'" of a key that is a list."""
    with pytest.raises(UserError) as error:
        parse_args(GRPOConfig, argv, "trainer.grpo")
    assert expected in str(error.value)


def test_an_empty_list_key_is_the_empty_list():
    """`--grpo.tools=` (no tools, over a recipe's) was the list of one empty name, refused as "not of the form
    `module:name`"; a YAML list whose items are all commented out (null) was "must be a list, got None"."""
    config, _ = parse_args(GRPOConfig, ["--config", "tools", "--grpo.tools="], "trainer.grpo")
    assert config.grpo.tools == []
    assert parse_args(GRPOConfig, ["--grpo.tools=null"], "trainer.grpo")[0].grpo.tools == []  # YAML `tools:`, items commented out
    config, _ = parse_args(SFTConfig, ["--model.recompute=selective", "--model.recompute_modules="], "trainer.sft")
    with pytest.raises(UserError, match="must name one or more of"):
        config.validate(world_size=1)


def test_a_yaml_section_that_is_not_a_mapping_is_named_and_an_empty_one_is_empty(tmp_path):
    """`train: 5` was "Unknown config key `train`", and so was a section whose keys are all commented out."""
    (tmp_path / "scalar.yaml").write_text("train: 5\n")
    with pytest.raises(UserError, match=r"`train:` in config file `.*scalar.yaml` must be a section: its keys indented"):
        parse_args(SFTConfig, ["--config", str(tmp_path / "scalar.yaml")], "trainer.sft")
    (tmp_path / "commented.yaml").write_text("train:\n#  steps: 5\nmodel:\n  dtype: bf16\n")
    config, _ = parse_args(SFTConfig, ["--config", str(tmp_path / "commented.yaml")], "trainer.sft")
    assert config.train.steps == SFTConfig().train.steps and config.model.dtype == "bf16"


def test_a_key_given_twice_in_a_yaml_file_is_refused(tmp_path):
    """YAML keeps the last of two equal keys: a second `train:` section dropped the whole first one without a word (its
    `steps: 100` ran as the default). A section's key given twice, or a mapping's on the command line, likewise."""
    (tmp_path / "twice.yaml").write_text("train:\n  steps: 100\noptim:\n  lr: 1e-4\ntrain:\n  global_batch_size: 8\n")
    with pytest.raises(UserError, match=r"`.*twice.yaml` is not valid YAML \(`train` is given twice, on lines 1 and 5: "
                                        r"the second would replace the first without a word\)"):
        parse_args(SFTConfig, ["--config", str(tmp_path / "twice.yaml")], "trainer.sft")
    (tmp_path / "key.yaml").write_text("train:\n  steps: 100\n  steps: 200\n")
    with pytest.raises(UserError, match=r"`steps` is given twice, on lines 2 and 3"):
        parse_args(SFTConfig, ["--config", str(tmp_path / "key.yaml")], "trainer.sft")
    with pytest.raises(UserError, match=r"`--optim.override_optimizer_config=\{lr: 1, lr: 2\}` is not a valid value"):
        parse_args(SFTConfig, ["--optim.override_optimizer_config={lr: 1, lr: 2}"], "trainer.sft")


@pytest.mark.parametrize("loop, program, recipe, owner", [
    (GRPOConfig, "trainer.grpo", "sft_moe", "trainer.sft"), (GRPOConfig, "trainer.grpo", "rm", "trainer.rm"),
    (SFTConfig, "trainer.sft", "dapo", "trainer.grpo"), (RMConfig, "trainer.rm", "sft_tools", "trainer.sft"),
])
def test_a_recipe_of_another_entry_point_is_refused(loop, program, recipe, owner):
    """`trainer.grpo --config sft_moe` trained GRPO from the bare tiny-moe into the MoE SFT's `train.out_dir`, where a
    later GRPO on `outputs/sft-moe/hf` found a finished SFT; `trainer.grpo --config rm` was accepted too."""
    with pytest.raises(UserError, match=rf"`--config {recipe}` is the recipe of `{owner}`, not of `{program}`"):
        parse_args(loop, ["--config", recipe], program)
    for name in sorted(path.stem for path in cli.RECIPES.glob("*.yaml")):  # each recipe parses in its own loop
        owner_class = {"trainer.sft": SFTConfig, "trainer.grpo": GRPOConfig, "trainer.rm": RMConfig}[cli.recipe_program(name)]
        parse_args(owner_class, ["--config", name], cli.recipe_program(name))
    # A script reading a recipe into its loop's config under its own name (scripts/tool_task_figures.py) was refused.
    config, _ = parse_args(GRPOConfig, ["--config", "tools", "--model.path=x"], "tool_task_figures")
    assert config.grpo.max_turns == 2


def test_held_out_data_that_is_the_training_file_is_refused(tmp_path):
    """`--data.eval_path` naming `data.path`'s own file measured the held-out figures on the training rows, silently."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    config, _ = parse_args(SFTConfig, [f"--data.path={rows}", f"--data.eval_path={tmp_path}/./rows.jsonl"], "trainer.sft")
    with pytest.raises(UserError, match="`data.eval_path=.*rows.jsonl` is the file `data.path` trains on"):
        config.validate(world_size=1)


def test_packing_is_refused_where_local_attention_would_replace_its_mask_by_a_sliding_window(tmp_path):
    """megatron-core's local softmax builds its own mask for a sliding window and drops the block-diagonal one: on a tiny
    Mistral (window 16) packed samples' per-token losses came out 0.49-0.57 off transformers', against 5e-7 with SDPA.
    Refused for a windowed Mistral with `model.attention=local`; SDPA, no packing, or no window run."""
    def mistral(window) -> str:
        directory = tmp_path / f"mistral-{window}"
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps({
            "model_type": "mistral", "architectures": ["MistralForCausalLM"], "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "sliding_window": window}))
        return str(directory)

    def validate(path: str, *argv: str) -> None:
        config, _ = parse_args(SFTConfig, [f"--model.path={path}", "--train.micro_batch_size=2", *argv], "trainer.sft")
        config.validate(world_size=1)

    with pytest.raises(UserError, match="whose sliding window of 16 tokens megatron-core's local attention applies in place"):
        validate(mistral(16), "--data.pack=true", "--model.attention=local")
    validate(mistral(16), "--data.pack=true", "--model.attention=sdpa")
    validate(mistral(16), "--model.attention=local")
    validate(mistral(None), "--data.pack=true", "--model.attention=local")


def test_packing_is_refused_with_the_per_sequence_load_balancing_loss():
    """megatron-core's seq_aux_loss balances each row of a micro-batch: packed, several samples are one sequence (on
    tiny-moe with 3 samples the router gradients moved by 4.5 on a scale of 5.6, while aux_loss and global_aux_loss
    matched the unpacked ones to 4e-7). Refused; aux_loss packs."""
    argv = ["--model.path=tiny-moe", "--data.pack=true", "--train.micro_batch_size=2", "--model.moe_aux_loss_coeff=0.001"]
    config, _ = parse_args(SFTConfig, [*argv, "--model.moe_aux_loss_type=seq_aux_loss"], "trainer.sft")
    with pytest.raises(UserError, match="the samples packed into one row would be balanced as one sequence"):
        config.validate(world_size=1)
    config, _ = parse_args(SFTConfig, [*argv, "--model.moe_aux_loss_type=aux_loss"], "trainer.sft")
    config.validate(world_size=1)


@pytest.mark.slow
def test_a_users_modules_in_the_starting_directory_do_not_replace_the_projects(tmp_path):
    """Python puts the directory a run starts in first on the import path. A `model.py` of the user's own there stopped
    `python -m trainer.sft` with `ImportError: cannot import name 'build' from 'model' (/.../model.py)`, and a
    `data/sft/` folder of JSON lines (a data folder laid out by task) became `data.sft`: SFT stopped at its data with
    `AttributeError: module 'data.sft' has no attribute 'cached_examples'`. The project's packages are bound first."""
    (tmp_path / "model.py").write_text("x = 1\n")
    (tmp_path / "config.py").write_text("x = 1\n")
    (tmp_path / "data" / "sft").mkdir(parents=True)
    (tmp_path / "data" / "sft" / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    result = subprocess.run([sys.executable, "-m", "trainer.sft", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    check = "import trainer, data.sft, model.build, config.cli; print(data.sft.__file__, model.build.__file__)"
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == [str(REPO / "data" / "sft.py"), str(REPO / "model" / "build.py")], result.stderr[-2000:]


def test_a_number_with_leading_zeros_is_decimal(tmp_path):
    """YAML 1.1 reads `010` as octal: `--train.steps=010` ran 8 steps and `--train.seed=0042` seeded 34, without a word
    (and `--train.steps=08` was refused as a string); in a config file too."""
    config, _ = parse_args(SFTConfig, ["--train.steps=010", "--train.seed", "0042", "--ckpt.save_interval=08",
                                       "--optim.lr=010"], "trainer.sft")
    assert (config.train.steps, config.train.seed, config.ckpt.save_interval, config.optim.lr) == (10, 42, 8, 10.0)
    (tmp_path / "run.yaml").write_text("train:\n  steps: 0100\n  global_batch_size: 064\n")
    config, _ = parse_args(SFTConfig, ["--config", str(tmp_path / "run.yaml")], "trainer.sft")
    assert (config.train.steps, config.train.global_batch_size) == (100, 64)
    config, _ = parse_args(SFTConfig, ["--train.steps=0x10", "--optim.betas=[0.9, 0.95]"], "trainer.sft")
    assert (config.train.steps, config.optim.betas) == (16, [0.9, 0.95])  # other forms read as before


@pytest.mark.parametrize("argv", [["--log.wandb_name", "--train.steps=100"], ["--data.hub_config", "--train.steps", "100"],
                                  ["--resume-from-checkpoint", "--train.steps=100"], ["--train.steps"]])
def test_a_key_whose_value_is_missing_is_refused(argv):
    """`--log.wandb_name $NAME --train.steps=100` with NAME empty took `--train.steps=100` as the run's name and trained
    the default 600 steps without a word."""
    with pytest.raises(UserError, match=rf"`{argv[0]}` needs a value"):
        parse_args(SFTConfig, argv, "trainer.sft")
    config, _ = parse_args(SFTConfig, ["--optim.lr", "-1e-5", "--optim.betas", "[0.9, 0.95]"], "trainer.sft")
    assert config.optim.lr == -1e-5  # a negative number is a value (validate refuses this one)


def test_a_key_given_nested_and_dotted_in_one_yaml_file_is_refused(tmp_path):
    """`train: {steps: 5}` and `train.steps: 6` in one file: the later spelling won without a word (6 here, 5 with the
    lines swapped); both spellings alone still work."""
    (tmp_path / "mixed.yaml").write_text("train:\n  steps: 5\ntrain.steps: 6\n")
    with pytest.raises(UserError, match=r"`train.steps` is given twice in config file `.*mixed.yaml`, once nested"):
        parse_args(SFTConfig, ["--config", str(tmp_path / "mixed.yaml")], "trainer.sft")
    (tmp_path / "both.yaml").write_text("train:\n  steps: 5\ntrain.global_batch_size: 32\n")
    config, _ = parse_args(SFTConfig, ["--config", str(tmp_path / "both.yaml")], "trainer.sft")
    assert (config.train.steps, config.train.global_batch_size) == (5, 32)


@pytest.mark.parametrize("argv", [["--config="], ["--config", ""], ["--resume-from-checkpoint="],
                                  ["--resume-from-checkpoint", " "]])
def test_an_empty_config_file_or_resume_target_is_refused(argv):
    """`--config=$RECIPE` with RECIPE unset ran the loop's defaults, and `--resume-from-checkpoint=$CHECKPOINT` started
    afresh, both without a word."""
    name = argv[0].split("=")[0]
    with pytest.raises(UserError, match=rf"`{name}` is given an empty value"):
        parse_args(GRPOConfig, argv, "trainer.grpo")
