"""An update megatron-core skips (fp16: the dynamic loss scale found an inf or NaN gradient) in every loop: the
learning-rate schedule stays where it was, as megatron's own training loop keeps it, the metrics row says so
(`grad_norm` null, `skipped_updates`, `loss_scale`), and bf16/fp32 rows carry no loss-scale figures. Plain pytest:
the loops' step functions on a stand-in optimizer and megatron-core's real learning-rate schedule. And one megatron-core
applies (fp32, bf16) whose gradient norm is NaN or infinite: the run stops (`metrics.stop_if_diverged`)."""

import types

import pytest
import torch

from config.loops import GRPOConfig, SFTConfig
from model import build, collectives
from model.policy import Policy
from trainer import grpo_update, metrics, sft


class ScriptedOptimizer:
    """A megatron optimizer's surface the loops touch: `step()` answers (applied, grad norm, zeros) from a script, as
    megatron-core's does under fp16 ((False, None, None) on an overflow), and the loss scale halves on each skip."""

    def __init__(self, applied: list[bool]):
        self.script = list(applied)
        self.param_groups = [{"params": [], "lr": 0.0, "weight_decay": 0.0}]
        self.scale = 32768.0

    def step(self):
        if self.script.pop(0):
            return True, 2.5, None
        self.scale /= 2
        return False, None, None

    def zero_grad(self):
        pass

    def get_loss_scale(self):
        return torch.tensor(self.scale)


def scripted_policy(config, applied: list[bool], fp16: bool = True) -> Policy:
    """A Policy around the scripted optimizer and the loops' real schedule (`build.warmup_cosine_schedule`)."""
    optimizer = ScriptedOptimizer(applied)
    policy = Policy(bridge=None, provider=types.SimpleNamespace(fp16=fp16), chunks=[], optimizer=optimizer,
                    lr_schedule=build.warmup_cosine_schedule(optimizer, config), tokenizer=None, hf_config={})
    # A dense policy's step figures and routes, without model chunks to hook.
    policy.routing_figures = types.SimpleNamespace(start_step=lambda: None, step_figures=lambda: {})
    policy.routes = types.SimpleNamespace(model_has_experts=False)
    return policy


def configured(config_class, **changes):
    """A loop's config of 10 steps, 4 of warmup to lr 1e-3, with dotted `changes`."""
    config = config_class()
    config.train.steps, config.optim.warmup_steps, config.optim.lr = 10, 4, 1e-3
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    return config


def test_a_skipped_sft_step_leaves_the_learning_rate_schedule_where_it_was(monkeypatch):
    """Two overflowing steps then two applied: the applied ones run at warmup's first two rates (0, then 2.5e-4), not
    at its third and fourth, and the skipped rows have no gradient norm (megatron-core reports none), not 0."""
    config = configured(SFTConfig)
    policy = scripted_policy(config, [False, False, True, True])
    monkeypatch.setattr(sft, "run_microbatches", lambda *args, **kwargs: (6.0, 3.0))
    results = [sft.train_step(policy, [], 8, metrics.StepTimer()) for _ in range(4)]
    assert [grad_norm for _, _, grad_norm, _ in results] == [None, None, 2.5, 2.5]
    assert [lr for _, _, _, lr in results] == pytest.approx([0.0, 0.0, 0.0, 2.5e-4])
    assert policy.lr_schedule.num_steps == 2
    # The loss-scale figures of a row: the scale after the step, and whether its update was skipped.
    assert policy.loss_scale_figures(1) == {"loss_scale": 8192.0, "skipped_updates": 1}
    assert scripted_policy(config, [True], fp16=False).loss_scale_figures(0) == {}


def fake_forward_backward(**kwargs):
    """megatron-core's schedule, as `optimizer_steps` reads it: one loss report per micro-batch."""
    report = {"loss": torch.tensor([1.0, 4.0]), "stats": torch.zeros(10), "gap_max": torch.tensor(0.0),
              "ratio_max": torch.tensor(0.0)}
    return [report] * kwargs["num_microbatches"]


@pytest.mark.parametrize("applied, grad_norm, schedule_steps", [
    ([False, True, False, True], 2.5, 1),  # two of four updates applied: the step trained, at its own rate
    ([False, False, False, False], None, 0),  # none applied: nothing trained, the schedule stays
])
def test_a_grpo_step_advances_the_schedule_only_when_one_of_its_updates_was_applied(monkeypatch, applied, grad_norm,
                                                                                    schedule_steps):
    config = configured(GRPOConfig, **{"grpo.mini_batches": 4, "grpo.kl_coef": 0.0})
    policy = scripted_policy(config, applied)
    import megatron.core.pipeline_parallel as pipeline_parallel

    monkeypatch.setattr(pipeline_parallel, "get_forward_backward_func", lambda: fake_forward_backward)
    monkeypatch.setattr(collectives, "last_stage_sum", lambda values: values)
    monkeypatch.setattr(collectives, "data_parallel_sum", lambda values: values)
    monkeypatch.setattr(collectives, "all_reduce_float", lambda value, op, group=None: value)
    microbatches = [{"tokens": torch.zeros(2, 8, dtype=torch.long), "padding_mask": torch.zeros(2, 8, dtype=torch.bool)}
                    for _ in range(4)]
    settings = grpo_update.LossSettings.from_config(config.grpo)
    update = grpo_update.update_policy(policy, microbatches, 8, config, settings, metrics.StepTimer())
    assert update["grad_norm"] == grad_norm and update["grad_norm_max"] == grad_norm
    assert update["skipped_updates"] == applied.count(False)
    assert update["loss_scale"] == 32768.0 / 2 ** applied.count(False)
    assert policy.lr_schedule.num_steps == schedule_steps


class NoCheckpoints:
    """What `metrics.stop_if_diverged` reads of a Checkpointer: its wait, and a directory with no `latest`."""

    def __init__(self, directory):
        self.directory, self.waited = directory, 0

    def wait(self):
        self.waited += 1


@pytest.mark.parametrize("loss, advice", [
    (5.2e4, "Lower `optim.lr`, lengthen `optim.warmup_steps`"),  # the update blew up: the learning rate
    (float("nan"), "Its loss was already not a number, computed from the finite weights"),  # NaN came with the inputs
])
def test_a_non_finite_gradient_norm_stops_every_loop_with_advice_that_fits_its_loss(tmp_path, loss, advice):
    """The row is written and the save in flight waited for before the paragraph; finite norms and fp16's skipped
    updates (None) pass."""
    from config.errors import AgreedStop

    config = configured(SFTConfig)
    config.train.out_dir = str(tmp_path)
    checkpointer = NoCheckpoints(tmp_path / "checkpoints")
    with metrics.MetricsWriter(config, True, 0) as writer:
        for grad_norm in (2.5, None):
            metrics.stop_if_diverged({"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": grad_norm}, writer, checkpointer)
        with pytest.raises(AgreedStop) as stopped:
            metrics.stop_if_diverged({"step": 2, "loss": loss, "lr": 1e-3, "grad_norm": float("inf")}, writer, checkpointer)
    assert str(stopped.value).startswith("Training diverged at step 2: the gradient norm is inf")
    assert advice in str(stopped.value) and "no checkpoint was saved before it" in str(stopped.value)
    assert checkpointer.waited == 1
    assert (tmp_path / "metrics.jsonl").read_text().count('"step": 2') == 1


def test_an_fp16_update_skipped_on_a_loss_that_is_not_a_number_stops_the_run(tmp_path):
    """fp16: a forward that overflowed gives a NaN loss from finite weights; megatron-core then skips the update
    (`grad_norm` None) and lowers the scale, and the run went on through every step (weights unchanged at each, the
    rows NaN), where bf16 stops on the NaN norm and Megatron-LM's loss check stops too. It stops with the loss advice;
    an update skipped on a finite loss (the scale too high) passes."""
    from config.errors import AgreedStop

    config = configured(SFTConfig)
    config.train.out_dir = str(tmp_path)
    checkpointer = NoCheckpoints(tmp_path / "checkpoints")
    with metrics.MetricsWriter(config, True, 0) as writer:
        metrics.stop_if_diverged({"step": 1, "loss": 6.2, "lr": 0.0, "grad_norm": None}, writer, checkpointer)
        with pytest.raises(AgreedStop) as stopped:
            metrics.stop_if_diverged({"step": 2, "loss": float("nan"), "lr": 0.0, "grad_norm": None}, writer, checkpointer)
    assert str(stopped.value).startswith("Training stopped at step 2: its loss is nan")
    assert "Its loss was already not a number, computed from the finite weights" in str(stopped.value)
    assert "`model.dtype=bf16`" in str(stopped.value)
