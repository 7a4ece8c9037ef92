"""Mixture-of-Experts router settings and routing figures (issue 39, parts 2 and 3).

Pure tests: the `model.moe_*` keys become megatron-core's router settings (on its real TransformerConfig), their
start-up refusals, and the padding mask the routers get. One 2-process launch (conftest's `joint_launches`) runs tiny-moe SFT
at TP=2 with sequence parallelism, a frozen router and the z-loss, stopped after 2 steps and resumed for a third; the
dense default for a step; and a GRPO step on tiny-moe. It checks the frozen router is bit-identical to the checkpoint's
after 3 steps while every other weight moved, the figures and their plausible ranges, and their absence where no
coefficient or no expert asks for them.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from config.cli import parse_args
from config.errors import UserError
from config.loops import GRPOConfig, SFTConfig
from data.batches import Example, collate
from model import rules
from tests.conftest import launch

EXPERTS, TOP_K = 8, 2  # tiny-moe (model/tiny.py MOE_MODEL_CONFIG): the busiest expert gets at most EXPERTS / TOP_K x the mean


def make(*argv: str, config_class=SFTConfig):
    """A config from command-line style arguments."""
    return parse_args(config_class, list(argv), "test")[0]


# ---------------------------------------------------------------- the keys as megatron-core's router settings


@pytest.mark.parametrize("argv, config_class, expected", [
    ([], SFTConfig, {}),  # the checkpoint provider's values stand
    ([], GRPOConfig, {"moe_aux_loss_coeff": 0.0}),  # RL's default, as verl and NeMo-RL
    (["--model.moe_aux_loss_type=seq_aux_loss", "--model.moe_aux_loss_coeff=0.01"], SFTConfig,
     {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.01}),
    (["--model.moe_aux_loss_type=none"], GRPOConfig, {"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0}),
    (["--model.moe_z_loss_coeff=1e-3", "--model.moe_router_dtype=fp64"], SFTConfig,
     {"moe_z_loss_coeff": 1e-3, "moe_router_dtype": "fp64"}),
    (["--model.moe_z_loss_coeff=0"], SFTConfig, {"moe_z_loss_coeff": None}),  # megatron-core's "off"
    (["--model.moe_freeze_router=true"], SFTConfig, {"moe_router_bias_update_rate": 0.0}),
])
def test_router_keys_reach_megatron_core(argv, config_class, expected):
    from megatron.core.transformer import TransformerConfig

    overrides = rules.moe_router_overrides(make(*argv, config_class=config_class).model)
    assert overrides == expected
    built = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=EXPERTS,
                              moe_router_topk=TOP_K, moe_ffn_hidden_size=32, **overrides)  # megatron-core's validation
    assert {key: getattr(built, key) for key in expected} == expected


@pytest.mark.parametrize("argv, config_class, expected", [
    (["--model.moe_aux_loss_type=aux"], SFTConfig, "`model.moe_aux_loss_type=aux` is not one of default, aux_loss, "
                                                   "seq_aux_loss, global_aux_loss, none. Change `--model.moe_aux_loss_type`."),
    (["--model.moe_router_dtype=bf16"], SFTConfig, "`model.moe_router_dtype=bf16` is not one of default, fp32, fp64."),
    (["--model.moe_aux_loss_coeff=-0.001"], SFTConfig, "`model.moe_aux_loss_coeff` must be 0 (off) or more, got -0.001"),
    (["--model.moe_z_loss_coeff=-1"], GRPOConfig, "`model.moe_z_loss_coeff` must be 0 (off) or more, got -1.0"),
    (["--model.moe_aux_loss_type=none", "--model.moe_aux_loss_coeff=0.001"], SFTConfig,
     "but `model.moe_aux_loss_type=none` computes none, so the coefficient would do nothing"),
    (["--model.moe_aux_loss_type=seq_aux_loss"], GRPOConfig,
     "`model.moe_aux_loss_type=seq_aux_loss` chooses a load-balancing loss, but `model.moe_aux_loss_coeff=0` switches it "
     "off (GRPO's default)"),
])
def test_bad_router_settings_are_refused_at_start_up(argv, config_class, expected):
    with pytest.raises(UserError) as error:
        make("--model.path=tiny-moe", *argv, config_class=config_class).validate(1)
    assert expected in " ".join(str(error.value).split())


def write_hf_config(directory: Path, **extra) -> Path:
    """A config.json (and nothing else) of a small model's shape, with `extra` keys."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2,
                                                       "num_hidden_layers": 2, **extra}))
    return directory


def test_a_dense_model_refuses_router_settings(tmp_path):
    dense = write_hf_config(tmp_path / "dense")
    with pytest.raises(UserError) as error:
        make(f"--model.path={dense}", "--model.moe_freeze_router=true", "--model.moe_router_dtype=fp64").validate(1)
    message = " ".join(str(error.value).split())
    assert message.startswith("`model.moe_router_dtype=fp64`, `model.moe_freeze_router=true` set the router of a "
                              f"Mixture-of-Experts model, and `model.path={dense}` is a dense model"), message
    # GRPO's own default (no load-balancing loss) is no setting of the user's; an MoE checkpoint takes every key.
    make(f"--model.path={dense}", config_class=GRPOConfig).validate(1)
    moe = write_hf_config(tmp_path / "moe", num_experts=EXPERTS)
    make(f"--model.path={moe}", "--model.moe_freeze_router=true", "--model.moe_router_dtype=fp64").validate(1)


def test_batches_mark_padding_for_the_routers():
    batch = collate([Example([5, 6, 7], [0, 1, 1]), Example([8, 9], [0, 1])], seq_len=4, pad_id=0)
    assert batch["padding_mask"].tolist() == [[False, False, True, True], [False, True, True, True]]
    assert batch["padding_mask"].dtype == torch.bool


# ---------------------------------------------------------------- end to end (one launch)

SMALL = ["--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.eval_samples=0", "--data.max_seq_len=64"]


def launches(tmp_path_factory):
    """Per run: its out_dir, metrics rows and log (one 2-process launch, in conftest's `joint_launches`)."""
    root = tmp_path_factory.mktemp("moe-settings")
    frozen = ["--model.path=tiny-moe", "--parallel.tp=2", "--model.moe_freeze_router=true", "--model.moe_z_loss_coeff=1e-3",
              "--train.steps=3", f"--train.out_dir={root / 'frozen'}", *SMALL]
    commands = {
        "frozen": {"module": "trainer.sft", "argv": [*frozen, "--train.exit_interval=2"]},
        "frozen_resumed": {"module": "trainer.sft", "argv": [*frozen, "--resume-from-checkpoint", "latest"]},
        "dense": {"module": "trainer.sft", "argv": ["--train.steps=1", f"--train.out_dir={root / 'dense'}", *SMALL]},
        "grpo": {"module": "trainer.grpo", "argv": [
            "--model.path=tiny-moe", "--train.steps=1", f"--train.out_dir={root / 'grpo'}", "--train.global_batch_size=16",
            "--grpo.n_samples=4", "--train.micro_batch_size=8", "--grpo.max_new_tokens=8", "--train.eval_samples=0"]},
    }
    results = yield launch(list(commands.values()))
    runs = {}
    for name, result in zip(commands, results):
        out_dir = root / ("frozen" if name.startswith("frozen") else name)
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        runs[name] = {"out_dir": out_dir, "rows": rows, "log": result["log"]}
    return runs


@pytest.fixture(scope="module")
def moe_runs(joint_launches) -> dict:
    return joint_launches[__name__]


@pytest.mark.distributed
def test_frozen_router_stays_bit_identical_through_training_and_resume(moe_runs):
    from safetensors.torch import load_file

    from model.tiny import ensure_tiny_checkpoint

    start = load_file(ensure_tiny_checkpoint(name="tiny-moe") / "model.safetensors")
    trained = load_file(moe_runs["frozen_resumed"]["out_dir"] / "hf" / "model.safetensors")
    unchanged = sorted(name for name in start if torch.equal(start[name], trained[name]))
    assert unchanged == [f"model.layers.{layer}.mlp.gate.weight" for layer in range(4)]  # the routers, and only they
    assert [row["step"] for row in moe_runs["frozen_resumed"]["rows"]] == [1, 2, 3]  # 2 steps, then 1 after the resume
    assert "load_balancing=aux_loss aux_loss_coeff=0.001 z_loss_coeff=0.001" in moe_runs["frozen"]["log"]


@pytest.mark.distributed
def test_moe_figures_are_logged_where_asked(moe_runs):
    for row in moe_runs["frozen_resumed"]["rows"]:  # the provider's aux loss (1e-3) and the z-loss set: both logged
        assert 1 < row["moe_load_imbalance"] <= EXPERTS / TOP_K, row
        assert 0.5 < row["moe_aux_loss"] < EXPERTS / TOP_K, row  # 1 when perfectly balanced
        assert 0 < row["moe_z_loss"] < 100 and math.isfinite(row["loss"]), row
    grpo_row = moe_runs["grpo"]["rows"][0]
    assert 1 < grpo_row["moe_load_imbalance"] <= EXPERTS / TOP_K, grpo_row
    assert "moe_aux_loss" not in grpo_row and "moe_z_loss" not in grpo_row  # GRPO's coefficient 0, no z-loss
    assert not [key for row in moe_runs["dense"]["rows"] for key in row if key.startswith("moe_")]


@pytest.mark.distributed
def test_metrics_png_draws_the_moe_panels(moe_runs):
    from PIL import Image

    description = Image.open(moe_runs["frozen_resumed"]["out_dir"] / "metrics.png").info["Description"]
    assert "MoE load imbalance" in description and "MoE router losses" in description
