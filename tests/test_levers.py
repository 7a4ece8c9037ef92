"""Sequence parallelism, activation recomputation and communication overlap (issue 15).

Pure rules and start-up checks run in plain pytest (GPUs simulated by `rules.Environment`); the end-to-end
comparisons run in tests/distributed/levers_worker.py, in the shared launch (2 CPU processes, fp32):
- TP=2 with sequence parallelism on vs off: per-step losses of 5 SFT steps and exported HF weights within 1e-6;
- recompute selective and full vs none: bit-identical per-step losses and parameter gradients (recomputation reruns
  the same deterministic fp32 CPU kernels on the same inputs, so backward consumes bitwise-equal activations);
- DP=2 with overlapped gradient reduction and parameter gathering (what GPUs get by default) vs without;
- greedy generation at TP=2 with sequence parallelism token-identical to `transformers.generate`, and GRPO's rollouts
  and updates with it.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from config import sections
from config.cli import parse_args
from config.errors import UserError
from config.loops import GRPOConfig, SFTConfig
from data import batches
from model import output, rules
from tests.conftest import worker_output

LOSS_TOLERANCE = 1e-6
WEIGHT_TOLERANCE = 1e-6


def make(*argv: str, config_class=SFTConfig):
    """A config from command-line style arguments."""
    return parse_args(config_class, list(argv), "test")[0]


# ---------------------------------------------------------------- start-up checks


@pytest.mark.parametrize("argv, world_size, expected", [
    (["--model.recompute=partial"], 1, "`model.recompute=partial` is not one of none, selective, full"),
    (["--model.recompute=full", "--model.recompute_method=every"], 1, "`model.recompute_method=every` is not one of uniform, block"),
    (["--model.recompute=full", "--model.recompute_num_layers=0"], 1, "`model.recompute_num_layers` must be at least 1"),
    (["--model.recompute=selective", "--model.recompute_modules=[attention]"], 1,
     "`model.recompute_modules=['attention']` must name one or more of core_attn, layernorm, mlp"),
    (["--model.recompute=selective", "--model.recompute_modules=[]"], 1, "must name one or more of"),
    (["--parallel.tp=2", "--data.max_seq_len=127"], 2, "`data.max_seq_len=127` must be a multiple of `parallel.tp=2`"),
    # megatron-core's interleaved schedule raised at step 1 (a traceback, after the build) on 24 / 8 = 3 micro-batches.
    (["--parallel.pp=2", "--parallel.vpp=2", "--train.global_batch_size=24", "--train.micro_batch_size=8"], 2,
     "= 3 micro-batches a step, not a multiple of `parallel.pp=2`"),
])
def test_start_up_errors_name_the_key(argv, world_size, expected):
    with pytest.raises(UserError) as error:
        make(*argv).validate(world_size)
    assert expected in str(error.value)


def test_what_each_layer_spec_cannot_recompute(monkeypatch):
    """`layernorm`: megatron-core 0.19.2 recomputes norms through TE's FP8 state (so it needs TE), and TE's own
    spec fuses the norms into the linear layers (so only the sdpa/local specs with TE installed have any)."""
    monkeypatch.setattr(sections, "have_transformer_engine", lambda: False)
    with pytest.raises(UserError) as error:
        make("--model.recompute=selective", "--model.recompute_modules=[core_attn,layernorm]").validate(1)
    assert "Transformer Engine is not installed" in str(error.value) and "`layernorm`" in str(error.value)
    make("--model.recompute=selective", "--model.recompute_modules=[core_attn,mlp]").validate(1)
    monkeypatch.setattr(sections, "have_transformer_engine", lambda: True)
    for attention in ("transformer_engine", "auto"):
        with pytest.raises(UserError) as error:
            make(f"--model.attention={attention}", "--model.recompute=selective", "--model.recompute_modules=[layernorm]").validate(1)
        assert "fuses each norm into the linear layer" in str(error.value) and "`--model.attention=sdpa`" in str(error.value)
    make("--model.attention=sdpa", "--model.recompute=selective", "--model.recompute_modules=[layernorm,mlp]").validate(1)
    make("--model.attention=transformer_engine", "--model.recompute=selective").validate(1)  # core_attn


def test_recompute_layers_are_checked_against_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24}')
    config = make(f"--model.path={tmp_path}", "--parallel.pp=2", "--parallel.vpp=2", "--model.recompute=full",
                  "--model.recompute_num_layers=7")
    with pytest.raises(UserError) as error:
        config.validate(2)
    assert "`model.recompute_num_layers=7` exceeds the 6 layers each model chunk holds" in str(error.value)
    make(f"--model.path={tmp_path}", "--model.recompute=full", "--model.recompute_num_layers=24").validate(1)
    # Selective recomputation ignores the full-only keys.
    make(f"--model.path={tmp_path}", "--model.recompute=selective", "--model.recompute_num_layers=99").validate(1)


def test_grpo_shares_the_keys():
    config = make("--parallel.tp=2", "--model.recompute=full", config_class=GRPOConfig)
    assert config.parallel.uses_sequence_parallel and config.model.recompute == "full"


def test_a_group_is_laid_out_with_its_prompt_once_and_every_token_keeps_its_context():
    """`grpo.share_prompts`: a group's rows share their common prefix in one row of the model's input; each own token
    keeps its position in its own row and sees the prefix and its own earlier tokens only; the loss's layout is
    `collate`'s and each of its positions names the hidden state it reads (the prefix's last for every row's first)."""
    prompt = [11, 12, 13, 14]
    rows = [batches.Example(prompt + completion, [0] * 4 + [1] * len(completion)) for completion in ([5, 6, 7], [5, 8], [9])]
    assert batches.common_prefix(rows) == 4 and batches.shared_length(rows) == 4 + 2 + 1 + 0
    batch = batches.collate_shared([rows], seq_len=8, packed_len=8, pad_id=0)
    assert batch["tokens"].tolist() == [[11, 12, 13, 14, 5, 6, 5, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 4, 0]]
    assert batch["padding_mask"].tolist() == [[False] * 7 + [True]]
    assert batch["hidden_index"][:, :6].tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 0], [0, 1, 2, 3, 0, 0]]
    assert batch["source_index"].tolist() == [[0, 1, 2, 3, 4, 5, 8 + 4, -1]]
    plain = batches.collate(rows, 8, 0)
    assert torch.equal(batch["labels"], plain["labels"]) and torch.equal(batch["loss_mask"], plain["loss_mask"])
    sees = (~batch["attention_mask"][0, 0]).int().tolist()  # [query, key], 1 = attends
    assert sees[5] == [1, 1, 1, 1, 1, 1, 0, 0]  # the first row's second own token: the prompt, its own first
    assert sees[6] == [1, 1, 1, 1, 0, 0, 1, 0]  # the second row's own token: the prompt and itself, not the first row
    assert sees[3] == [1, 1, 1, 1, 0, 0, 0, 0] and sees[7] == [1, 1, 1, 1, 0, 0, 0, 1]  # causal prompt; a pad sees pads
    read = output.ReadPositions.where(batch["loss_mask"], batch["hidden_index"], 8)
    # Every row's first completion token is read at the prompt's last position, 3.
    assert read.hidden_columns.tolist() == [3, 4, 5, 3, 6, 3] and read.hidden_rows.tolist() == [0] * 6
    assert read.rows.tolist() == [0, 0, 0, 1, 1, 2] and read.columns.tolist() == [3, 4, 5, 3, 4, 3]
    # Units: one prompt group (rows // group_size) per unit, split where the shared row would pass the limit.
    examples = rows + rows
    assert batches.prompt_units(examples, list(range(6)), 3, 64) == [[0, 1, 2], [3, 4, 5]]
    assert batches.prompt_units(examples, list(range(6)), 3, 7) == [[0, 1, 2], [3, 4, 5]]
    assert batches.prompt_units(examples, list(range(6)), 3, 6) == [[0, 1], [2], [3, 4], [5]]
    # A token budget groups whole units and lists their rows; halving to the agreed count splits rows.
    units = [[0, 1, 2], [3, 4, 5]]
    assert batches.token_budget_microbatches([7, 7], [[0, 1]], 16, lambda n: 8, lambda count: count, units) == [
        [0, 1, 2, 3, 4, 5]]
    assert batches.token_budget_microbatches([7, 7], [[0, 1]], 16, lambda n: 8, lambda count: 3, units) == [
        [0, 1], [2], [3, 4, 5]]


def test_prompts_are_shared_only_where_the_attention_takes_the_layout():
    """`grpo.share_prompts` is off by itself, with the reason, wherever a group's row would be attended wrongly."""
    from model.shared_prefix import reason_not_shared

    def reason(attention="sdpa", pp=1, share=True, **provider):
        config = SimpleNamespace(grpo=SimpleNamespace(share_prompts=share), parallel=SimpleNamespace(pp=pp),
                                 model=SimpleNamespace(attention=attention))
        settings = {"context_parallel_size": 1, "masked_softmax_fusion": False, "position_embedding_type": "rope",
                    "multi_latent_attention": False, "apply_rope_fusion": False, "window_size": None, **provider}
        return reason_not_shared(config, SimpleNamespace(**settings))

    assert reason() is None and reason("local") is None and reason(position_embedding_type="learned_absolute") is None
    assert reason(share=False) == "grpo.share_prompts=false"
    assert "pipeline stages" in reason(pp=2)
    assert "context parallelism" in reason(context_parallel_size=2)
    assert "--model.attention=sdpa" in reason("transformer_engine") and "--model.attention=sdpa" in reason(
        "local", masked_softmax_fusion=True)
    assert "yarn" in reason(position_embedding_type="yarn") and reason(multi_latent_attention=True)
    assert "fused rotary" in reason(apply_rope_fusion=True) and "sliding-window" in reason(window_size=(4, 0))
    # A Mixture-of-Experts router's losses count tokens: a shared prompt once, not once per completion (PP=2, which
    # shares nothing, trained another model: grad_norm 1.1e-2 apart by step 3 at moe_aux_loss_coeff=1e-3).
    assert reason(num_moe_experts=8, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None) is None  # GRPO's default
    assert "load-balancing or z-loss" in reason(num_moe_experts=8, moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=None)
    assert "load-balancing or z-loss" in reason(num_moe_experts=8, moe_aux_loss_coeff=[0.0, 1e-3])
    assert "load-balancing or z-loss" in reason(num_moe_experts=8, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3)


def test_sequence_length_is_padded_to_the_tensor_parallel_size():
    examples = [batches.Example(list(range(12)), [1] * 12)]  # 11 inputs
    assert batches.padded_length(examples, 128) == 16
    assert batches.padded_length(examples, 128, multiple=16) == 16
    assert batches.padded_length(examples, 128, multiple=3) == 24
    assert batches.padded_length(examples, 12, multiple=4) == 12  # capped by data.max_seq_len (a multiple, checked)
    assert make("--parallel.tp=4").parallel.sequence_multiple == 4
    assert make("--parallel.tp=4", "--parallel.sequence_parallel=false").parallel.sequence_multiple == 1
    assert make().parallel.sequence_multiple == 1  # tp=1: nothing to split


# ---------------------------------------------------------------- the rules, on megatron-core's real classes


@pytest.mark.parametrize("argv, expected", [
    ([], dict(sequence_parallel=False, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)),
    (["--parallel.tp=2"], dict(sequence_parallel=True)),  # on by default with tp > 1, as Megatron-Bridge's recipes
    (["--parallel.tp=2", "--parallel.sequence_parallel=false"], dict(sequence_parallel=False)),
    (["--model.recompute=selective"], dict(recompute_granularity="selective", recompute_modules=["core_attn"],
                                           recompute_method=None, recompute_num_layers=None)),
    (["--model.recompute=selective", "--model.recompute_modules=[layernorm,mlp]"],
     dict(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])),
    (["--model.recompute=full"], dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    (["--model.recompute=full", "--model.recompute_method=block", "--model.recompute_num_layers=3"],
     dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3)),
])
def test_transformer_overrides_are_accepted_by_megatron_core(argv, expected):
    from megatron.core.transformer import TransformerConfig

    config = make(*argv)
    overrides = rules.transformer_overrides(config)
    assert {key: overrides[key] for key in expected} == expected
    built = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=config.parallel.tp,
                              **overrides)  # runs megatron-core's own validation (__post_init__)
    assert {key: getattr(built, key) for key in expected} == expected


H100, B200 = (9, 0), (10, 0)


def gpu(capability=H100, data_parallel_size=2) -> rules.Environment:
    """A simulated CUDA machine."""
    return rules.Environment(cuda=True, compute_capability=capability, data_parallel_size=data_parallel_size)


# (arguments, environment) -> (overlap_grad_reduce, overlap_param_gather, align_param_gather, CUDA_DEVICE_MAX_CONNECTIONS)
OVERLAP_TABLE = [
    ([], rules.Environment(data_parallel_size=2), (False, False, False, None)),  # CPU: gloo has nothing to overlap
    (["--parallel.tp=2"], rules.Environment(data_parallel_size=2), (False, False, False, None)),
    ([], gpu(), (True, True, False, None)),
    ([], gpu(data_parallel_size=1), (True, False, False, None)),  # the buckets of any other size, nothing to gather
    (["--parallel.use_distributed_optimizer=false"], gpu(), (False, False, False, None)),
    (["--parallel.tp=2"], gpu(), (True, True, False, "1")),  # Hopper and older: TP collectives queue in order
    (["--parallel.tp=2"], gpu(data_parallel_size=1), (True, False, False, "1")),
    (["--parallel.pp=2", "--parallel.vpp=2"], gpu(), (True, True, True, None)),  # all stages gather together
    (["--parallel.pp=2"], gpu(), (True, True, False, None)),
    (["--parallel.tp=2"], gpu(B200), (True, True, False, "32")),  # Blackwell: more connections, never 1
    ([], gpu(B200), (True, True, False, "32")),
    (["--parallel.tp=2", "--parallel.use_megatron_fsdp=true"], gpu(), (True, True, False, None)),  # FSDP needs > 1
    (["--parallel.use_megatron_fsdp=true"], rules.Environment(data_parallel_size=2), (True, False, False, None)),
    (["--parallel.tp=2", "--ddp.override_ddp_config={overlap_param_gather: false}"], gpu(), (True, False, False, "1")),
    (["--ddp.override_ddp_config={overlap_grad_reduce: true}"], rules.Environment(data_parallel_size=2),
     (True, False, False, None)),  # the user's override wins, on CPU too
]


@pytest.mark.parametrize("argv, environment, expected", OVERLAP_TABLE)
def test_overlap_and_connection_rules(argv, environment, expected):
    config = make(*argv)
    built = rules.ddp_config(config, environment=environment)
    connections = rules.cuda_device_max_connections(config.parallel, environment)
    assert (built.overlap_grad_reduce, built.overlap_param_gather, built.align_param_gather, connections) == expected


@pytest.mark.parametrize("argv", [[], ["--parallel.tp=2"], ["--parallel.pp=2", "--parallel.vpp=2"]])
def test_gradient_buckets_do_not_follow_the_data_parallel_size_on_gpus(argv):
    """The distributed optimizer's checkpoint is keyed by gradient bucket: megatron-core's own default (one bucket
    without overlap, max(40M, 1M x DP) parameters with it) gave a model over 40M parameters other buckets at DP=1 than
    at DP=2, and at DP=64 than at DP=8, so a GPU run could not resume at another data-parallel size."""
    config = make(*argv)
    layouts = {(rules.ddp_config(config, environment=gpu(data_parallel_size=size)).overlap_grad_reduce,
                rules.ddp_config(config, environment=gpu(data_parallel_size=size)).bucket_size) for size in (1, 2, 8, 64)}
    assert layouts == {(True, rules.BUCKET_SIZE)}
    # Megatron-FSDP's checkpoints are per parameter: its settings are its own.
    assert rules.ddp_config(make("--parallel.use_megatron_fsdp=true"), environment=gpu(data_parallel_size=64)).bucket_size is None


def test_settings_table_shows_every_lever():
    config = make("--parallel.tp=2", "--model.recompute=full", "--model.recompute_num_layers=2")
    optimizer = rules.optimizer_config(config)
    ddp = rules.ddp_config(config, optimizer, environment=gpu())
    transformer = SimpleNamespace(tensor_model_parallel_size=2, **rules.transformer_overrides(config))
    table = rules.settings_table(optimizer, ddp, transformer, cuda_connections="1", cuda=True)
    for expected in ("overlap_grad_reduce=True overlap_param_gather=True align_param_gather=False", "sequence parallel",
                     "True (tp=2)", "full method=uniform num_layers=2", "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert expected in table, table
    cpu_table = rules.settings_table(optimizer, rules.ddp_config(config, optimizer), None)
    assert "not applicable (no CUDA)" in cpu_table and "overlap_grad_reduce=False" in cpu_table


# ---------------------------------------------------------------- end to end (in the shared launch)


def shared_worker(out) -> list[str]:
    """The worker's small data set; it runs in the 2-process shared launch (conftest's `shared_launch`)."""
    from data.arithmetic import generate_problems

    data = out / "data"
    data.mkdir()
    # A small arithmetic set: tokenizing the bundled 11,000 problems costs each run seconds per process.
    for split, count, seed in (("train", 64, 1), ("test", 8, 2)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in generate_problems(count, seed)))
    return ["tests/distributed/levers_worker.py", "--data", str(data), "--out", str(out)]


@pytest.fixture(scope="module")
def results(shared_launch) -> dict:
    """Every comparison's figures, from the worker's run in the shared launch."""
    figures = json.loads((worker_output(shared_launch[__name__]) / "results.json").read_text())
    print("\n" + json.dumps(figures, indent=1))
    return figures


def no_error(result: dict) -> dict:
    """The phase's figures, or a failure showing the worker's traceback."""
    assert "error" not in result, result["error"]
    return result


def largest_difference(first: list[float], second: list[float]) -> float:
    """Largest absolute difference of two equally long series."""
    assert len(first) == len(second) > 0
    return max(abs(a - b) for a, b in zip(first, second))


@pytest.mark.distributed
def test_sequence_parallel_matches_without_it(results):
    off, on = no_error(results["sft_tp2_sp_off"]), no_error(results["sft_tp2_sp_on"])
    assert len(on["losses"]) == 5
    assert largest_difference(off["losses"], on["losses"]) < LOSS_TOLERANCE
    assert largest_difference(off["grad_norms"], on["grad_norms"]) < 1e-5
    assert on["losses"][-1] < on["losses"][0]  # it trains
    export = results["export_tp2_sp_off_vs_tp2_sp_on"]
    assert export["names_equal"] and export["tensors"] > 0
    assert export["max_abs_diff"] < WEIGHT_TOLERANCE


@pytest.mark.distributed
def test_recompute_gives_identical_losses_and_gradients(results):
    reference = no_error(results["sft_tp2_sp_on"])["losses"]
    for name in ("sft_tp2_sp_selective", "sft_tp2_sp_full"):
        assert no_error(results[name])["losses"] == reference, name  # bit-identical, see the module docstring
    gradients = no_error(results["recompute_gradients"])
    assert gradients["none"]["parameters"] > 0
    for name in ("selective", "full"):
        assert gradients[name]["loss"] == gradients["none"]["loss"]
        assert gradients[name]["bit_identical"], gradients[name]


@pytest.mark.distributed
def test_overlapped_communication_on_gloo_matches(results):
    plain, overlapped = no_error(results["sft_dp2"]), no_error(results["sft_dp2_overlap"])
    assert largest_difference(plain["losses"], overlapped["losses"]) < LOSS_TOLERANCE
    # Exported after the last step: the pending parameter gather was completed first (Policy.sync_parameters).
    assert results["export_dp2_vs_dp2_overlap"]["max_abs_diff"] < WEIGHT_TOLERANCE


@pytest.mark.distributed
def test_generation_and_grpo_with_sequence_parallel(results):
    greedy = no_error(results["greedy_sp"])
    assert greedy["sequence_parallel_during_training"] is True
    assert greedy["greedy_equal"] is True and greedy["generated_tokens"] > 0
    assert greedy["sequence_parallel_restored"] is True
    grpo_run = no_error(results["grpo_sp"])  # rollouts with sequence parallelism off, updates with it on
    assert len(grpo_run["loss"]) == 2 and all(length > 0 for length in grpo_run["response_len"])
    assert grpo_run["grad_norm"][0] > 0  # the first update moved the policy...
    assert grpo_run["kl"][1] > 0  # ...away from the frozen reference, which the second step's KL sees
