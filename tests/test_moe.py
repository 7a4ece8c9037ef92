"""Expert parallelism (issue 39, part 1): the bad layouts refused at start-up (plain pytest), and on `tiny-moe` in the
shared launch (tests/distributed/moe_worker.py, 2 CPU processes, fp32): SFT at EP=2 against EP=1, generation whose
rows finish at different times on the expert-parallel ranks, GRPO at EP=2 resumed bit for bit, and the EP=2 export
loaded in transformers.
"""

import json

import pytest

from config.cli import parse_args
from config.errors import UserError
from config.loops import GRPOConfig, SFTConfig
from tests.conftest import launch, metrics_rows, worker_output

# Relative agreement of SFT's per-step losses at EP=2 and EP=1 (both DP=2). Measured: 0 to 3e-7 (see the test).
LOSS_TOLERANCE = 1e-5


def make(*argv: str, config_class=SFTConfig):
    """A config from command-line style arguments."""
    return parse_args(config_class, list(argv), "test")[0]


def write_config(directory, **fields) -> str:
    """A checkpoint directory holding only a config.json (enough for the start-up shape checks)."""
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2,
                                                       "num_hidden_layers": 4, **fields}))
    return str(directory)


# ---------------------------------------------------------------- start-up checks


@pytest.mark.parametrize("argv, world_size, expected", [
    (["--parallel.ep=0"], 2, "`parallel.ep` must be at least 1"),
    (["--parallel.etp=-1"], 2, "`parallel.etp` must be 0 (megatron-core's default: `parallel.tp`) or at least 1"),
    (["--parallel.ep=4"], 2, "`parallel.etp=0` (parallel.tp=1) x `parallel.ep=4` x `parallel.pp=1` = 4 must divide the "
                             "number of processes (2)"),
    # TP=2 with its default ETP=2 and EP=2 needs 4 processes; ETP=1 fits the experts on the two TP ranks.
    (["--parallel.tp=2", "--parallel.ep=2"], 2, "`parallel.etp=0` (parallel.tp=2) x `parallel.ep=2` x `parallel.pp=1` = 4"),
    (["--parallel.ep=2", "--peft.method=lora"], 2, "`peft.method=lora` with expert parallelism (`parallel.ep=2`) is not "
                                                   "supported"),
    (["--model.moe_dispatcher=flex"], 2, "`model.moe_dispatcher=flex` is not one of alltoall, allgather"),
    # The ranks' token counts differ (rollouts, padding): megatron-core's allgather dispatcher needs them equal.
    (["--parallel.ep=2", "--model.moe_dispatcher=allgather"], 2, "`model.moe_dispatcher=allgather` with `parallel.ep=2`: "
                                                                  "megatron-core's allgather dispatcher gathers"),
    (["--parallel.ep=2", "--model.moe_dispatcher=allgather"], 2, "Use the default `--model.moe_dispatcher=alltoall`"),
])
def test_bad_expert_layouts_are_refused_at_start_up(argv, world_size, expected):
    with pytest.raises(UserError) as error:
        make(*argv).validate(world_size)
    assert expected in str(error.value)
    assert "\n" not in str(error.value)  # one paragraph


def test_the_allgather_dispatcher_at_expert_parallelism_is_refused_in_grpo_too():
    with pytest.raises(UserError, match=r"^`model.moe_dispatcher=allgather` with `parallel.ep=2`: "):
        make("--parallel.ep=2", "--model.moe_dispatcher=allgather", config_class=GRPOConfig).validate(2)
    make("--parallel.tp=2", "--model.moe_dispatcher=allgather", config_class=GRPOConfig).validate(2)  # EP=1: equal counts


def test_good_expert_layouts_pass_the_start_up_checks(tmp_path):
    moe = write_config(tmp_path, num_experts=8, moe_intermediate_size=96)
    for argv, world_size in ((["--parallel.ep=2"], 2), (["--parallel.tp=2", "--parallel.etp=1", "--parallel.ep=2"], 2),
                             (["--parallel.ep=8"], 8), (["--parallel.ep=2", "--parallel.etp=2"], 4),
                             (["--parallel.ep=2", "--parallel.use_megatron_fsdp=true"], 2)):
        for config_class in (SFTConfig, GRPOConfig):
            make(f"--model.path={moe}", "--train.micro_batch_size=1", *argv, config_class=config_class).validate(world_size)


@pytest.mark.parametrize("fields, argv, world_size, expected", [
    ({"num_experts": 6, "moe_intermediate_size": 96}, ["--parallel.ep=4"], 8,
     "`parallel.ep=4` must divide the model's 6 experts per layer"),
    ({"num_local_experts": 8, "intermediate_size": 100}, ["--parallel.etp=3"], 12,
     "`parallel.etp=3` (3 ranks per expert) must divide each expert's hidden width, 100"),
    ({"n_routed_experts": 8, "moe_intermediate_size": 96}, ["--parallel.ep=8"], 8, None),
    ({"num_experts": 8, "moe_intermediate_size": 96}, ["--parallel.tp=2", "--parallel.sequence_parallel=false"], 8,
     "`parallel.sequence_parallel=false` with `parallel.tp=2` on a Mixture-of-Experts model"),
    ({}, ["--parallel.ep=2"], 8, "`parallel.ep=2` and `parallel.etp=0` split the experts of a Mixture-of-Experts model, "
                                 "and `model.path="),
    ({}, ["--parallel.etp=2"], 8, "is a dense model"),
    # Bridge's expert adapters split over ETP ranks train another model (config/model_checks.py); whole experts, or a dense
    # model at TP=2, train the TP=1 model.
    ({"num_experts": 8, "moe_intermediate_size": 96}, ["--parallel.tp=2", "--peft.method=lora"], 2,
     "`peft.method=lora` on a Mixture-of-Experts model with each expert split over 2 ranks (`parallel.etp=0`, which "
     "follows parallel.tp=2) is not supported"),
    ({"num_experts": 8, "moe_intermediate_size": 96}, ["--parallel.etp=2", "--peft.method=lora"], 2, "Use `--parallel.etp=1`"),
    ({"num_experts": 8, "moe_intermediate_size": 96}, ["--parallel.tp=2", "--parallel.etp=1", "--peft.method=lora"], 2, None),
    ({}, ["--parallel.tp=2", "--peft.method=lora"], 2, None),
])
def test_expert_parallelism_is_checked_against_the_checkpoint(tmp_path, fields, argv, world_size, expected):
    """Every way config.json names its experts (Qwen3-MoE, Mixtral, DeepSeek)."""
    config = make(f"--model.path={write_config(tmp_path, **fields)}", "--train.micro_batch_size=1", *argv)
    if expected is None:
        config.validate(world_size)
        return
    with pytest.raises(UserError) as error:
        config.validate(world_size)
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("fields, dense", [({"mlp_only_layers": [0]}, [0]), ({"decoder_sparse_step": 2}, [0, 2]),
                                           ({"mlp_only_layers": [3], "decoder_sparse_step": 2}, [0, 2, 3]), ({}, [])])
def test_a_qwen3_moe_checkpoint_with_dense_layers_is_refused_naming_them(tmp_path, fields, dense):
    """Megatron-Bridge 0.6.2 builds every layer of a Qwen3-MoE checkpoint as an MoE layer: with `mlp_only_layers=[0]` it
    only warned that layer 0's router and experts were not in the checkpoint, and megatron-core's logits were NaN (a
    4-expert, 2-layer copy of tests/test_model_families.py's shape; 6e-7 from transformers' without the dense layer).
    The layers named are the ones transformers builds dense."""
    import transformers

    hf = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "hidden_size": 32,
          "intermediate_size": 64, "vocab_size": 64, **fields}
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **hf, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, head_dim=8))
    built_dense = [index for index, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "gate")]
    assert built_dense == dense
    config = make(f"--model.path={write_config(tmp_path, **hf)}", "--train.micro_batch_size=1")
    if not dense:
        config.validate(1)
        return
    with pytest.raises(UserError) as error:
        config.validate(1)
    assert str(error.value).startswith(f"The model's config.json (`model.path`) makes layers {dense} dense") and (
        "Point `--model.path` at a Qwen3-MoE checkpoint whose every layer is sparse" in str(error.value))


# ---------------------------------------------------------------- end to end, in the shared launch


def shared_worker(out) -> list[str]:
    """The EP runs on tiny-moe, in the shared launch (conftest's `shared_launch`)."""
    return ["tests/distributed/moe_worker.py", "--out", str(out)]


def test_routing_figures_count_routed_tokens_without_padding_and_without_host_syncs():
    """A router forward's tokens per expert leave padding out (the hook masks the routing map rather than indexing it,
    which on a GPU read the kept count back: a host sync every MoE layer and micro-batch), and the route mismatch is
    summed where it is computed and read once a step (`take_mismatch`)."""
    from types import SimpleNamespace

    import torch

    from model.moe import RoutingFigures
    from model.routing import Routes

    config = SimpleNamespace(num_moe_experts=3, num_layers=2, mtp_num_layers=None, moe_aux_loss_coeff=0.0,
                             moe_router_load_balancing_type="aux_loss", moe_z_loss_coeff=None)
    figures = RoutingFigures([], config)
    router = SimpleNamespace(training=True, layer_number=2, is_mtp_layer=False)
    routing_map = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.bool)  # [seq 2 x batch 2, experts]
    padding = torch.tensor([[False, False], [False, True]])  # [seq, batch]: the last token is padding
    figures._count(router, (None, padding), {}, (None, routing_map))
    assert figures.tokens.tolist() == [[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]] and figures.forwards.tolist() == [0.0, 1.0]
    routes = Routes([])
    routes.differ, routes.compared = torch.tensor(2), torch.tensor(5)  # as `_measure` leaves them: on the device
    assert routes.take_mismatch() == (2, 5) and (routes.differ, routes.compared) == (0, 0)


@pytest.mark.distributed
def test_sft_at_ep2_matches_ep1_and_its_export_loads_in_transformers(shared_launch):
    """20 SFT steps on tiny-moe, fp32, 2 processes: EP=2 against EP=1 (DP=2). The same tokens meet the same experts,
    but at EP=1 each rank computes every expert's gradient from its own half of the batch and DDP sums the two, while at
    EP=2 each rank computes its four experts' gradients from both halves at once: the same sums in another order, so
    the losses agree to float rounding, not bit for bit."""
    import torch
    import transformers
    from safetensors import safe_open

    from model.tiny import ensure_tiny_checkpoint

    out = worker_output(shared_launch[__name__])
    ep1, ep2 = metrics_rows(out / "sft-ep1"), metrics_rows(out / "sft-ep2")
    assert [row["step"] for row in ep2] == list(range(1, 21)) == [row["step"] for row in ep1]
    relative = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ep1, ep2)]
    print(f"SFT tiny-moe EP=2 vs EP=1: losses {[round(row['loss'], 4) for row in ep2]}; largest relative difference "
          f"{max(relative):.2g} (step {relative.index(max(relative)) + 1}); first step that differs: "
          f"{next((step for step, gap in enumerate(relative, 1) if gap), None)}")
    assert max(relative) < LOSS_TOLERANCE
    assert ep2[-1]["loss"] < ep2[0]["loss"] - 1.0  # it trains
    # The export gathers every expert from both ranks: the same tensors, of the same shapes, as the original checkpoint.
    original = ensure_tiny_checkpoint(name="tiny-moe")
    with safe_open(original / "model.safetensors", "pt") as before, \
            safe_open(out / "sft-ep2" / "hf" / "model.safetensors", "pt") as after:
        assert set(before.keys()) == set(after.keys())
        assert all(before.get_slice(key).get_shape() == after.get_slice(key).get_shape() for key in before.keys())
    models = {ep: transformers.AutoModelForCausalLM.from_pretrained(out / f"sft-ep{ep}" / "hf", dtype=torch.float32).eval()
              for ep in (1, 2)}
    assert models[2].config.num_experts == 8
    tokens = torch.randint(3, models[1].config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (models[2](tokens).logits - models[1](tokens).logits).abs().max().item()
    print(f"EP=2 export vs EP=1 export in transformers: logits within {gap:.2g}")
    assert gap < 1e-3


@pytest.mark.distributed
def test_generation_under_ep_runs_the_same_forwards_on_every_rank(shared_launch):
    """Rank 0's rows all end at their first token, rank 1's run to the budget: rank 0 keeps running forwards (each MoE
    layer's all-to-all needs it) until rank 1 is done, and its completions still end where they ended."""
    results = json.loads((worker_output(shared_launch[__name__]) / "results.json").read_text())["generation"]
    assert results["lengths"] == [[1, 1, 1, 1], [6, 6, 6, 6]]
    assert results["forwards"][0] == results["forwards"][1] == 6  # the prefill and five decode steps


# Megatron-FSDP at EP=2: SFT straight, and stopped at step 2 then resumed, in one process group (as the LoRA worker
# resumes; the GRPO resume above is the fresh-process one). Small batches: only bit-equality is asserted.
FSDP_SFT = ["--model.path=tiny-moe", "--parallel.ep=2", "--parallel.use_megatron_fsdp=true", "--train.steps=4",
            "--train.global_batch_size=16", "--train.micro_batch_size=8", "--train.eval_samples=0",
            "--ckpt.save_interval=1"]


def launches(shared_launch, tmp_path_factory):
    """One launch after the shared one (conftest's `joint_launches`): GRPO's resume in fresh processes, and the Megatron-FSDP SFT runs at EP=2."""
    out = worker_output(shared_launch[__name__])
    root = tmp_path_factory.mktemp("moe-resume")
    grpo_split, grpo_argv = out / "grpo" / "split", json.loads((out / "results.json").read_text())["grpo_argv"]
    fsdp = {run: root / "fsdp" / run for run in ("straight", "split")}
    yield launch([{"module": "trainer.grpo", "argv": [*grpo_argv, f"--train.out_dir={grpo_split}",
                                                          "--resume-from-checkpoint", "latest"]},
                       {"module": "trainer.sft", "argv": [*FSDP_SFT, f"--train.out_dir={fsdp['straight']}"]},
                       {"module": "trainer.sft", "argv": [*FSDP_SFT, f"--train.out_dir={fsdp['split']}",
                                                         "--train.exit_interval=2"]},
                       {"module": "trainer.sft", "argv": [*FSDP_SFT, f"--train.out_dir={fsdp['split']}",
                                                         "--resume-from-checkpoint", "latest"]}])
    return {"grpo": {"straight": out / "grpo" / "straight", "split": grpo_split}, "fsdp": fsdp}


@pytest.fixture(scope="module")
def resumed(joint_launches) -> dict:
    return joint_launches[__name__]


@pytest.mark.distributed
def test_grpo_at_ep2_resumes_bit_for_bit(resumed):
    """GRPO on tiny-moe at EP=2 with the distributed optimizer (expert state sharded over the expert-data-parallel
    group, dense state over the data-parallel group): 2 steps, a resume in a later launch (new processes, as a resumed
    job has), 2 more equal 4 straight, bit for bit: every metrics row (rewards, losses, gradient norms, held-out figures) and the final
    parameters, every expert of both ranks, as the HF export gathers them."""
    straight, split = (resumed["grpo"][run] for run in ("straight", "split"))
    rows = metrics_rows(straight)
    print("GRPO tiny-moe EP=2 straight:", [(row["step"], row.get("loss"), row.get("grad_norm")) for row in rows])
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]  # step 0: the held-out baseline
    assert metrics_rows(split) == rows
    assert all(row["loss"] != 0 and row["grad_norm"] > 0 for row in rows[1:])  # every step trained
    assert (split / "hf" / "model.safetensors").read_bytes() == (straight / "hf" / "model.safetensors").read_bytes()


@pytest.mark.distributed
def test_megatron_fsdp_at_ep2_resumes_bit_for_bit(resumed):
    """Megatron-FSDP's checkpoints key each expert by its global number (`ckpt.state`): with each rank's own numbering,
    both ranks' experts 0-3 shared keys and the resumed run differed from the straight one at its first step."""
    straight, split = (resumed["fsdp"][run] for run in ("straight", "split"))
    assert [row["step"] for row in metrics_rows(straight)] == [1, 2, 3, 4]
    assert metrics_rows(split) == metrics_rows(straight)
    assert (split / "hf" / "model.safetensors").read_bytes() == (straight / "hf" / "model.safetensors").read_bytes()
