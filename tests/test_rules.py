"""model/rules.py: the optimizer, DDP and transformer settings rules, checked branch by branch on megatron-core's
real config classes."""

import pytest
import torch

from config import sections
from config.errors import UserError
from config.loops import SFTConfig
from model import rules


def make(dtype="fp32", **changes) -> SFTConfig:
    """A config with model.dtype and dotted changes, e.g. make('bf16', **{'optim.lr': 1e-4})."""
    config = SFTConfig()
    config.model.dtype = dtype
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    return config


@pytest.fixture
def with_transformer_engine(monkeypatch):
    """Precision-aware branches need TE's FusedAdam; the rules only check that TE is importable."""
    monkeypatch.setattr(sections, "have_transformer_engine", lambda: True)


def optimizer_settings(config) -> dict:
    """The optimizer rule's keyword arguments, without constructing OptimizerConfig (which imports TE when precision-aware)."""
    captured = {}

    class Capture:
        def __init__(self, **kwargs):
            captured.update(kwargs)

    import megatron.core.optimizer as megatron_optimizer

    original = megatron_optimizer.OptimizerConfig
    megatron_optimizer.OptimizerConfig = Capture
    try:
        rules.optimizer_config(config)
    finally:
        megatron_optimizer.OptimizerConfig = original
    return captured


def test_fp32_builds_the_real_config_with_every_always_field():
    config = make("fp32", **{"optim.lr": 3e-4, "optim.min_lr": 3e-5, "optim.weight_decay": 0.1, "optim.clip_grad": 0.5,
                             "optim.betas": [0.8, 0.99], "optim.eps": 1e-6})
    built = rules.optimizer_config(config)
    assert (built.bf16, built.fp16, built.params_dtype, built.use_precision_aware_optimizer) == (False, False, torch.float32, False)
    assert (built.optimizer, built.lr, built.min_lr, built.weight_decay, built.clip_grad) == ("adam", 3e-4, 3e-5, 0.1, 0.5)
    assert (built.adam_beta1, built.adam_beta2, built.adam_eps) == (0.8, 0.99, 1e-6)  # never silently dropped
    assert built.use_distributed_optimizer is True


def test_bf16_default_keeps_fp32_state_and_fp32_buckets():
    built = rules.optimizer_config(make("bf16"))
    assert (built.bf16, built.fp16, built.params_dtype) == (True, False, torch.bfloat16)
    assert built.use_precision_aware_optimizer is False
    assert (built.main_grads_dtype, built.exp_avg_dtype, built.exp_avg_sq_dtype) == (torch.float32,) * 3
    assert rules.ddp_config(make("bf16"), built).grad_reduce_in_fp32 is True


@pytest.mark.parametrize("field", ["main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"])
def test_bf16_opt_in_sets_each_dtype_independently(with_transformer_engine, field):
    config = make("bf16", **{"optim.use_precision_aware_optimizer": True, f"optim.{field}": "bf16"})
    settings = optimizer_settings(config)
    assert settings["use_precision_aware_optimizer"] is True
    assert settings["main_params_dtype"] == torch.float32  # master weights stay fp32
    for other in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        assert settings[other] == (torch.bfloat16 if other == field else torch.float32)


def test_fp16_rules(with_transformer_engine):
    settings = optimizer_settings(make("fp16"))
    assert (settings["fp16"], settings["bf16"], settings["params_dtype"]) == (True, False, torch.float16)
    assert (settings["initial_loss_scale"], settings["min_loss_scale"]) == (32768, 1)
    assert settings["use_precision_aware_optimizer"] is True and settings["store_param_remainders"] is False
    assert "exp_avg_dtype" not in settings  # moments stay at megatron-core's fp32 default


def test_override_optimizer_config_wins_last():
    config = make("bf16", **{"optim.lr": 1e-3, "optim.override_optimizer_config": {"lr": 5e-5, "adam_beta2": 0.9}})
    built = rules.optimizer_config(config)
    assert (built.lr, built.adam_beta2) == (5e-5, 0.9)


@pytest.mark.parametrize("changes", [{"optim.clip_grad": 0.0}, {"optim.override_optimizer_config": {"clip_grad": 0}}])
def test_clipping_off_clips_at_infinity_so_the_norm_is_still_computed(changes):
    """megatron-core computes the gradient norm only to clip by it: with clip_grad 0 Megatron-FSDP's optimizer (a single
    DistributedOptimizer, not chained) returned 0.0, and every row said grad_norm 0 (7.159 at DP=2 on the same step).
    Infinity clips nothing and keeps the norm (test_precision_e2e's fsdp_fp32_unclipped run)."""
    assert rules.optimizer_config(make("fp32", **changes)).clip_grad == float("inf")
    assert rules.optimizer_config(make("fp32", **{"optim.clip_grad": 0.5})).clip_grad == 0.5


def test_the_schedule_applies_the_overridden_weight_decay_lr_and_min_lr():
    """megatron-core's OptimizerParamScheduler sets every group's `weight_decay` (start_wd x wd_mult) at each step, so an
    `optim.override_optimizer_config` weight decay the settings table shows was silently replaced by
    `optim.weight_decay` (0.01 where 0.1 was asked). The schedule now takes the resolved OptimizerConfig's values: a
    decayed group at the override, an excluded one (megatron's `wd_mult=0`: biases, 1-D parameters) at 0; the peak
    and floor the override's."""
    from model import build

    config = make("fp32", **{"optim.weight_decay": 0.01, "optim.lr": 1e-3, "train.steps": 10, "optim.warmup_steps": 0,
                             "optim.override_optimizer_config": {"weight_decay": 0.1, "lr": 4e-3, "min_lr": 4e-4}})
    weights, biases = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([{"params": [weights], "wd_mult": 1.0}, {"params": [biases], "wd_mult": 0.0}])
    schedule = build.warmup_cosine_schedule(optimizer, config)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(4e-3)
    schedule.step(increment=10)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(4e-4)


class FakeOptimizer:
    """Stands for a built OptimizerConfig in the DDP rule (only the fields it reads)."""

    def __init__(self, aware: bool, main_grads: torch.dtype, distributed: bool = True):
        self.use_precision_aware_optimizer, self.main_grads_dtype, self.use_distributed_optimizer = aware, main_grads, distributed


@pytest.mark.parametrize("aware, main_grads, expected", [
    (False, torch.float32, True), (True, torch.float32, True), (True, torch.bfloat16, False), (True, torch.float16, False)])
def test_grad_reduce_in_fp32_follows_main_grads(aware, main_grads, expected):
    assert rules.ddp_config(make("bf16"), FakeOptimizer(aware, main_grads)).grad_reduce_in_fp32 is expected


def test_explicit_grad_reduce_in_fp32_override_wins():
    config = make("bf16", **{"ddp.override_ddp_config": {"grad_reduce_in_fp32": True}})
    assert rules.ddp_config(config, FakeOptimizer(True, torch.bfloat16)).grad_reduce_in_fp32 is True


def test_fsdp_defaults_and_their_overrides():
    built = rules.ddp_config(make("fp32", **{"parallel.use_megatron_fsdp": True, "parallel.use_distributed_optimizer": False}))
    assert built.use_megatron_fsdp and built.use_distributed_optimizer and not built.check_for_nan_in_grad
    assert built.data_parallel_sharding_strategy == "optim_grads_params" and built.overlap_grad_reduce
    bf16_fsdp = make("bf16", **{"parallel.use_megatron_fsdp": True})
    assert rules.ddp_config(bf16_fsdp).megatron_fsdp_main_grads_dtype == torch.float32  # not bf16 by default
    assert rules.ddp_config(bf16_fsdp, FakeOptimizer(True, torch.bfloat16)).megatron_fsdp_main_grads_dtype == torch.bfloat16
    assert rules.transformer_overrides(make("fp32", **{"parallel.use_megatron_fsdp": True}))["gradient_accumulation_fusion"] is False
    assert "gradient_accumulation_fusion" not in rules.transformer_overrides(make("fp32"))
    overridden = rules.ddp_config(make("fp32", **{"parallel.use_megatron_fsdp": True, "ddp.override_ddp_config": {
        "data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": False, "check_for_nan_in_grad": True}}))
    assert (overridden.data_parallel_sharding_strategy, overridden.overlap_grad_reduce, overridden.check_for_nan_in_grad) == (
        "optim_grads", False, True)


def test_fsdp_gives_a_precision_aware_optimizer_its_gradients_in_decoupled_grad():
    """megatron-core's optimizer reads a precision-aware optimizer's gradients from `decoupled_grad` under Megatron-FSDP,
    where Megatron-FSDP writes them only when told (Megatron-Bridge's rule); left in `.grad`, bf16 trained nothing
    (grad_norm 0 at every step: test_precision_e2e's precision_aware_bf16_fsdp)."""
    bf16_fsdp = make("bf16", **{"parallel.use_megatron_fsdp": True})
    assert rules.ddp_config(bf16_fsdp, FakeOptimizer(True, torch.float32)).megatron_fsdp_use_decoupled_grad is True
    assert rules.ddp_config(bf16_fsdp).megatron_fsdp_use_decoupled_grad is False  # torch's Adam reads `.grad`


def test_environment_defaults_lose_to_user_overrides():
    gloo = {"gradient_reduce_div_fusion": False}
    assert rules.ddp_config(make(), extra_defaults=gloo).gradient_reduce_div_fusion is False
    config = make(**{"ddp.override_ddp_config": {"gradient_reduce_div_fusion": True}})
    assert rules.ddp_config(config, extra_defaults=gloo).gradient_reduce_div_fusion is True


@pytest.mark.parametrize("changes, expected", [
    ({"optim.main_grads_dtype": "fp8"}, "`optim.main_grads_dtype=fp8` is not one of fp32, bf16, fp16"),
    ({"optim.exp_avg_sq_dtype": "half"}, "`optim.exp_avg_sq_dtype=half`"),
    ({"optim.override_optimizer_config": {"adam_beta3": 0.1}}, "`optim.override_optimizer_config` sets `adam_beta3`"),
    ({"ddp.override_ddp_config": {"bucket_mb": 4}}, "`ddp.override_ddp_config` sets `bucket_mb`"),
    ({"optim.use_precision_aware_optimizer": True, "optim.override_optimizer_config": {"optimizer": "sgd"}}, "needs the adam optimizer"),
    ({"optim.use_precision_aware_optimizer": True, "parallel.use_distributed_optimizer": False}, "`--parallel.use_distributed_optimizer=true`"),
])
def test_validation_errors_name_the_key(with_transformer_engine, changes, expected):
    with pytest.raises(UserError) as error:
        make("bf16", **changes).validate(world_size=1)
    assert expected in str(error.value)


@pytest.mark.parametrize("dtype, changes, expected", [
    ("bf16", {"optim.exp_avg_dtype": "bf16"}, "`optim.exp_avg_dtype=bf16` would do nothing: they set the precision-aware "
                                              "optimizer's state, which this run (`model.dtype=bf16`, "
                                              "`optim.use_precision_aware_optimizer=false`) does not use"),
    ("fp32", {"optim.use_precision_aware_optimizer": True, "optim.main_grads_dtype": "bf16",
              "optim.exp_avg_sq_dtype": "bf16"}, "`optim.main_grads_dtype=bf16`, `optim.exp_avg_sq_dtype=bf16` would do nothing"),
    ("fp16", {"optim.exp_avg_dtype": "bf16"}, "`model.dtype=fp16` keeps its main gradients and Adam moments in fp32"),
    ("fp16", {"parallel.use_megatron_fsdp": True}, "`model.dtype=fp16` with `parallel.use_megatron_fsdp=true` is not supported"),
])
def test_precision_settings_that_would_be_dropped_or_fail_are_refused(with_transformer_engine, dtype, changes, expected):
    """Lower-precision optimizer state outside bf16's precision-aware optimizer was dropped without a word (megatron-core
    itself asserts it away); fp16 under Megatron-FSDP failed at its first step with a traceback."""
    with pytest.raises(UserError) as error:
        make(dtype, **changes).validate(world_size=1)
    assert expected in str(error.value) and "--" in str(error.value)
    make("bf16", **{**changes, "optim.use_precision_aware_optimizer": True}).validate(world_size=1)  # where they act


def test_fp16_main_gradients_which_megatron_core_keeps_in_bf16_are_refused(with_transformer_engine):
    """megatron-core's DDP keeps main gradients in fp32 or the parameters' dtype: `optim.main_grads_dtype=fp16` in bf16
    ran on bf16 gradient buffers (measured with the FusedAdam double: buffers and `decoupled_grad` bf16, the losses and
    grad norms of `main_grads_dtype=bf16` bit for bit)."""
    aware = {"optim.use_precision_aware_optimizer": True}
    with pytest.raises(UserError, match=r"`optim.main_grads_dtype=fp16` is not one megatron-core keeps.*--optim.main_grads_dtype=bf16"):
        make("bf16", **aware, **{"optim.main_grads_dtype": "fp16"}).validate(world_size=1)
    make("bf16", **aware, **{"optim.main_grads_dtype": "bf16"}).validate(world_size=1)


def test_precision_aware_without_transformer_engine_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(sections, "have_transformer_engine", lambda: False)
    for config in (make("bf16", **{"optim.use_precision_aware_optimizer": True}), make("fp16")):
        with pytest.raises(UserError) as error:
            config.validate(world_size=1)
        assert "Transformer Engine is not installed" in str(error.value) and "NGC" in str(error.value)
    make("bf16").validate(world_size=1)  # the default bf16 path needs no TE


def test_settings_table_lists_the_resolved_values():
    optimizer = rules.optimizer_config(make("bf16"))
    table = rules.settings_table(optimizer, rules.ddp_config(make("bf16"), optimizer))
    assert "bf16=True" in table and "betas=(0.9, 0.95)" in table and "grad_reduce_in_fp32=True" in table
