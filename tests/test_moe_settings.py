"""Mixture-of-Experts router settings and routing figures (issue 39, parts 2 and 3).

Pure tests: the `model.moe_*` keys become megatron-core's router settings (on its real TransformerConfig), their
start-up refusals, the padding mask the routers get, and the router losses' gradient (by hand, and the same at TP=2 as
at TP=1). One 2-process launch (conftest's `joint_launches`) runs tiny-moe SFT at TP=2 with sequence parallelism, a
frozen router and the z-loss, stopped after 2 steps and resumed for a third; the dense default for a step; a GRPO step
on tiny-moe; and tiny-moe SFT with its router losses at TP=1 and TP=2. It checks the frozen router is bit-identical to
the checkpoint's after 3 steps while every other weight moved, the figures and their plausible ranges, their absence
where no coefficient or no expert asks for them, and that the router losses train alike at both TP sizes.
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


def test_lora_keeps_the_bases_expert_biases_as_it_keeps_its_weights():
    """Expert biases (DeepSeek-V3's aux-free balancing) are updated outside the optimizer: under LoRA they changed the
    frozen base, and a LoRA checkpoint holds the adapters alone, so a resume dropped the change (reviewer). Their
    update rate is 0 under LoRA, as with `model.moe_freeze_router`; without LoRA the checkpoint's rate stands."""
    assert rules.moe_router_overrides(make().model, lora=True) == {"moe_router_bias_update_rate": 0.0}
    assert rules.moe_router_overrides(make().model) == {}


@pytest.mark.parametrize("written, expected", [(0.02, 0.02), (None, 1e-3)])  # None: transformers' default, 1e-3
def test_an_unset_aux_loss_coefficient_is_the_checkpoints(tmp_path, written, expected):
    """`model.moe_aux_loss_coeff` unset is the checkpoint's (config.json's `router_aux_loss_coef`): Megatron-Bridge 0.6.2's
    Qwen3-MoE bridge wrote 1e-3 over it, so a checkpoint saying 0.02 trained its SFT at 1e-3 without a word."""
    import shutil

    from model import providers
    from model.tiny import ensure_tiny_checkpoint

    model = shutil.copytree(ensure_tiny_checkpoint(name="tiny-moe"), tmp_path / "model")
    hf = json.loads((model / "config.json").read_text())
    hf.pop("router_aux_loss_coef")
    (model / "config.json").write_text(json.dumps({**hf, **({"router_aux_loss_coef": written} if written else {})}))
    provider = providers.configure_provider(providers.auto_bridge(model), dtype="fp32", tp=1, pp=1, vpp=None,
                                            seq_length=64, load_weights=False)
    assert provider.moe_aux_loss_coeff == expected
    overridden = providers.configure_provider(providers.auto_bridge(model), dtype="fp32", tp=1, pp=1, vpp=None,
                                              seq_length=64, load_weights=False,
                                              moe_router=rules.moe_router_overrides(make("--model.moe_aux_loss_coeff=0.005").model))
    assert overridden.moe_aux_loss_coeff == 0.005  # a coefficient set wins


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


# ---------------------------------------------------------------- the router losses' gradient at every TP size


class RankGroup:
    """A process group of `size` ranks for a router run in this one process: its all-reduce (the only collective a
    router's losses use) adds what the test says the other rank holds."""

    def __init__(self, size: int, peer: list | None = None):
        self._size, self.peer, self.seen = size, peer, []

    def size(self) -> int:
        return self._size

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.seen.append(tensor.clone())
        if self.peer is not None:
            tensor += self.peer[len(self.seen) - 1]


# Each router loss on its own: the three load-balancing types, and the z-loss.
ROUTER_LOSSES = pytest.mark.parametrize("settings", [
    {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3},
    {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-3},
    {"moe_router_load_balancing_type": "global_aux_loss", "moe_aux_loss_coeff": 1e-3},
    {"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 1e-3},
], ids=["aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss"])


def router_loss_gradient(router_class, logits, padding, settings, tp: int, peer: list | None = None,
                         loss_weight: float | None = None):
    """d(the router's load-balancing and z losses)/d(logits) ([seq, batch, experts]) from `router_class` on this
    rank's slice of a micro-batch, as megatron-core's schedule scales it (fp32, the main loss's scale 1), and the
    tensors its all-reduce saw. `padding` [seq, batch] is True at padding; `loss_weight`, the router's
    (`moe.weigh_router_losses`), unset: its default."""
    from types import SimpleNamespace
    from unittest import mock

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    group = RankGroup(tp, peer)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_moe_experts=EXPERTS,
                               moe_router_topk=TOP_K, moe_ffn_hidden_size=32, calculate_per_token_loss=True,
                               add_bias_linear=False, sequence_parallel=tp > 1, tensor_model_parallel_size=tp,
                               **settings)
    groups = SimpleNamespace(tp=group, cp=RankGroup(1), tp_cp=group, tp_dp_cp=group)
    with mock.patch("torch.cuda.current_device", lambda: "cpu"):  # the global loss's counters
        router = router_class(config, pg_collection=groups)
    router.set_layer_number(1)
    if loss_weight is not None:
        router.loss_weight = loss_weight
    logits = logits.clone().requires_grad_(True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    # megatron-core's reduce asks whether a process group is up (none is) before it reduces over the one it is given;
    # eagerly, as the runs' tests are (tests/conftest.py's EAGER): its torch.compile'd top-k would ask that process
    # group for its rank.
    with mock.patch("torch.distributed.is_initialized", lambda: True), \
            mock.patch("torch.distributed.all_reduce", lambda tensor, group: group.all_reduce(tensor)), \
            torch._dynamo.config.patch(disable=True):
        probs, _ = router.routing(logits, padding_mask=padding)
    probs.backward(torch.zeros_like(probs))  # no main loss: only the router losses' gradient reaches the logits
    return logits.grad, group.seen


@ROUTER_LOSSES
def test_router_losses_give_each_token_the_same_gradient_at_tp2_as_at_tp1(settings):
    """A micro-batch of right-padded rows routed whole (TP=1), and as two sequence-parallel slices (TP=2: the first half
    of the sequence holds more of the rows' tokens than the second): every token's gradient from the router losses must
    be the same. With megatron-core's own TopKRouter the load-balancing losses' came out twice the TP=1 one (its token
    count read after an in-place all-reduce, model/moe_router.py); the z-loss's was already equal."""
    from model.moe_router import MicroBatchWeightedRouter

    logits = torch.randn(8, 3, EXPERTS, generator=torch.Generator().manual_seed(0))  # [seq, batch, experts]
    padding = torch.arange(8)[:, None] >= torch.tensor([8, 5, 2])[None, :]  # [seq, batch]: rows of 8, 5 and 2 tokens
    whole, _ = router_loss_gradient(MicroBatchWeightedRouter, logits, padding, settings, tp=1)
    halves = (slice(0, 4), slice(4, 8))
    # What each slice contributes to the all-reduce, then each slice with the other's contribution added.
    seen = [router_loss_gradient(MicroBatchWeightedRouter, logits[half], padding[half], settings, tp=2, peer=None)[1]
            for half in halves]
    sliced = torch.cat([router_loss_gradient(MicroBatchWeightedRouter, logits[half], padding[half], settings, tp=2,
                                             peer=seen[1 - rank])[0] for rank, half in enumerate(halves)])
    assert whole.abs().max() > 0
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=0)


def test_the_load_balancing_gradient_is_the_micro_batch_loss_weighted_by_its_tokens():
    """The TP=1 side of the test above, against the definition by hand: the Switch load-balancing loss over the valid
    tokens, coeff * E * sum_i f_i * P_i (f_i: the share of top-k choices that went to expert i, P_i: expert i's mean
    probability), times the micro-batch's valid tokens T (finalize_model_grads then divides by the global batch's loss
    tokens, so the loss weighs as its share of them)."""
    from model.moe_router import MicroBatchWeightedRouter

    logits = torch.randn(8, 3, EXPERTS, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    padding = torch.arange(8)[:, None] >= torch.tensor([8, 5, 2])[None, :]  # [seq, batch]
    settings = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3}
    gradient, _ = router_loss_gradient(MicroBatchWeightedRouter, logits.float(), padding, settings, tp=1)

    by_hand = logits.clone().requires_grad_(True)
    valid = ~padding.reshape(-1)  # [tokens]
    probabilities = torch.softmax(by_hand.reshape(-1, EXPERTS), dim=-1)[valid]  # [valid tokens, experts]
    chosen = torch.zeros_like(probabilities).scatter(1, probabilities.topk(TOP_K).indices, 1.0)  # [valid, experts]
    tokens = valid.sum()
    share = chosen.sum(0) / (tokens * TOP_K)  # f_i
    mean_probability = probabilities.sum(0) / tokens  # P_i
    (1e-3 * EXPERTS * (share * mean_probability).sum() * tokens).backward()
    torch.testing.assert_close(gradient, by_hand.grad.float(), rtol=1e-5, atol=1e-9)


@ROUTER_LOSSES
def test_the_router_losses_scale_by_the_steps_loss_weight_and_log_their_own_figures(settings):
    """A router given the step's loss count per routed token (`loss_weight`, here 0.3: a loss counting 3 of every 10
    routed tokens) passes its losses' gradient scaled by exactly that, and logs the same loss figures as at weight 1;
    the z-loss's coefficient on the shared config is back as set afterwards."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from model.moe_router import MicroBatchWeightedRouter

    logits = torch.randn(8, 3, EXPERTS, generator=torch.Generator().manual_seed(2))  # [seq, batch, experts]
    padding = torch.arange(8)[:, None] >= torch.tensor([8, 5, 2])[None, :]  # [seq, batch]
    gradients, figures = [], []
    for weight in (None, 0.3):
        get_moe_metrics_tracker().clear()
        gradients.append(router_loss_gradient(MicroBatchWeightedRouter, logits, padding, settings, tp=1,
                                              loss_weight=weight)[0])
        figures.append({name: entry.values.clone() for name, entry in get_moe_metrics_tracker().metrics.items()})
    assert gradients[0].abs().max() > 0
    torch.testing.assert_close(gradients[1], 0.3 * gradients[0], rtol=1e-5, atol=1e-6 * float(gradients[0].abs().max()))
    assert figures[0].keys() == figures[1].keys() and figures[0]
    for name in figures[0]:
        torch.testing.assert_close(figures[1][name], figures[0][name], rtol=1e-6, atol=0)


def test_a_steps_router_loss_weight_is_its_loss_count_per_routed_token():
    """`moe.weigh_router_losses`: the loss's count over the step's micro-batches (what finalize_model_grads divides
    by), over their routed tokens (padding left out), set on every router; nothing where no router loss is on. One
    data-parallel rank (the sum over the group is the rank's own)."""
    from types import SimpleNamespace
    from unittest import mock

    from model import moe
    from model.moe_router import MicroBatchWeightedRouter

    class Chunk(torch.nn.Module):
        def __init__(self, **config):
            super().__init__()
            self.config = SimpleNamespace(**{"num_moe_experts": EXPERTS, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None, **config})
            self.router = MicroBatchWeightedRouter.__new__(MicroBatchWeightedRouter)  # the weight is all it holds here
            torch.nn.Module.__init__(self.router)

    padding = [torch.arange(6)[None, :] >= torch.tensor([[6], [3]]), torch.arange(6)[None, :] >= torch.tensor([[1], [0]])]
    batches = [{"padding_mask": mask, "count": torch.tensor(count)} for mask, count in zip(padding, (2.0, 1.0))]
    # routed tokens: 6 + 3 + 1 + 0 = 10; counted: 2 + 1 (or 1 each)
    with mock.patch("model.collectives.data_parallel_sum", lambda values: values):
        balanced = Chunk(moe_aux_loss_coeff=1e-3)
        moe.weigh_router_losses([balanced], batches, lambda batch: batch["count"])
        assert balanced.router.loss_weight == pytest.approx(0.3)
        z_only = Chunk(moe_z_loss_coeff=1e-3)
        moe.weigh_router_losses([z_only], batches, lambda batch: 1)
        assert z_only.router.loss_weight == pytest.approx(0.2)
        off = Chunk()
        moe.weigh_router_losses([off], batches, lambda batch: 1 / 0)  # never asked
        assert off.router.loss_weight == 1.0
        moe.weigh_router_losses([], batches, lambda batch: 1 / 0)  # no chunks (a test's stand-in policy): nothing


# ---------------------------------------------------------------- end to end (one launch)

SMALL = ["--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.eval_samples=0", "--data.max_seq_len=64"]
GRPO_STEP = ["--train.global_batch_size=16", "--grpo.n_samples=4", "--train.micro_batch_size=8", "--grpo.max_new_tokens=8",
             "--train.eval_samples=0"]


def launches(tmp_path_factory):
    """Per run: its out_dir, metrics rows and log (one 2-process launch, in conftest's `joint_launches`)."""
    root = tmp_path_factory.mktemp("moe-settings")
    frozen = ["--model.path=tiny-moe", "--parallel.tp=2", "--model.moe_freeze_router=true", "--model.moe_z_loss_coeff=1e-3",
              "--train.steps=3", f"--train.out_dir={root / 'frozen'}", *SMALL]
    commands = {
        "frozen": {"module": "trainer.sft", "argv": [*frozen, "--train.exit_interval=2"]},
        "frozen_resumed": {"module": "trainer.sft", "argv": [*frozen, "--resume-from-checkpoint", "latest"]},
        "dense": {"module": "trainer.sft", "argv": ["--train.steps=1", f"--train.out_dir={root / 'dense'}", *SMALL]},
        # The checkpoint's load-balancing loss (1e-3) and the z-loss, fp32: TP=1 (DP=2), TP=2 (DP=1, 2 micro-batches).
        **{f"balanced_tp{tp}": {"module": "trainer.sft", "argv": [
            "--model.path=tiny-moe", "--model.dtype=fp32", "--model.moe_z_loss_coeff=1e-3", f"--parallel.tp={tp}",
            "--train.steps=3", "--ckpt.save_interval=0", f"--train.out_dir={root / f'balanced_tp{tp}'}", *SMALL]}
           for tp in (1, 2)},
        "grpo": {"module": "trainer.grpo", "argv": [
            "--model.path=tiny-moe", "--train.steps=1", f"--train.out_dir={root / 'grpo'}", *GRPO_STEP]},
        # The load-balancing loss under GRPO's two means (untrained tiny-moe: every reward 0, so it is the only loss).
        **{f"grpo_{aggregation}": {"module": "trainer.grpo", "argv": [
            "--model.path=tiny-moe", "--model.dtype=fp32", "--model.moe_aux_loss_coeff=1e-3", "--train.steps=1",
            f"--grpo.loss_aggregation={aggregation}", "--ckpt.save_interval=0",
            f"--train.out_dir={root / f'grpo_{aggregation}'}", *GRPO_STEP]}
           for aggregation in ("token_mean", "seq_mean_token_mean")},
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
def test_router_losses_train_alike_at_tp1_and_tp2(moe_runs):
    """The same 3 steps with the load-balancing and z losses on, at TP=1 and TP=2 (sequence parallelism): the same
    losses and gradient norms to float rounding (the test prints the gaps). With megatron-core's own router, whose
    load-balancing gradient is doubled at TP=2 (model/moe_router.py), the gradient norms were apart from step 1."""
    tp1, tp2 = (moe_runs[f"balanced_tp{tp}"]["rows"] for tp in (1, 2))
    assert [row["step"] for row in tp1] == [row["step"] for row in tp2] == [1, 2, 3]
    print("tiny-moe router losses, TP=2 vs TP=1, relative gaps per step:",
          {key: [f"{abs(one[key] - two[key]) / abs(one[key]):.1e}" for one, two in zip(tp1, tp2)]
           for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss")})
    for one, two in zip(tp1, tp2):
        assert "moe_aux_loss" in two and "moe_z_loss" in two, two
        # Not `moe_z_loss`: megatron-core's figure is at TP=2 the mean of each slice's mean over its tokens, not the
        # whole sequence's mean where padding falls unevenly (printed above); the z-loss's gradient is the same.
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert abs(one[key] - two[key]) <= 1e-5 * abs(one[key]), (key, one, two)


@pytest.mark.distributed
def test_the_load_balancing_loss_weighs_alike_whatever_the_grpo_loss_counts(moe_runs):
    """GRPO's first step on untrained tiny-moe, every reward 0: the load-balancing loss is the only gradient, and it
    must not depend on what the policy loss averages over (tokens, or completions). With megatron-core's weighting
    (routed tokens over the loss's count) the completion mean's gradient norm was 16x the token mean's at 16 new tokens
    (0.80 against 0.050 on one process), itself 2.8x pretraining's weighting (0.018): the weight is now the step's loss
    count per routed token (0.0507 under both means here)."""
    rows = {aggregation: moe_runs[f"grpo_{aggregation}"]["rows"][0] for aggregation in ("token_mean", "seq_mean_token_mean")}
    for row in rows.values():
        assert row["reward_mean"] == 0.0 and row["moe_aux_loss"] > 1, row
        assert row["grad_norm"] > 0.01, row
    token, sequence = rows["token_mean"]["grad_norm"], rows["seq_mean_token_mean"]["grad_norm"]
    assert abs(token - sequence) <= 1e-6 * token, rows


@pytest.mark.distributed
def test_metrics_png_draws_the_moe_panels(moe_runs):
    from PIL import Image

    description = Image.open(moe_runs["frozen_resumed"]["out_dir"] / "metrics.png").info["Description"]
    assert "MoE load imbalance" in description and "MoE router losses" in description
