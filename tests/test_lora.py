"""LoRA through Megatron-Bridge's PEFT: start-up checks, and SFT at TP=1 and TP=2 end to end (in the shared launch)."""

import json

import pytest

from config.cli import parse_args
from config.errors import UserError
from config.loops import GRPOConfig, SFTConfig
from tests.conftest import metrics_rows, worker_output


@pytest.mark.parametrize("argv, expected", [
    (["--peft.method=qlora"], "`peft.method=qlora` is not one of none, lora"),
    (["--peft.method=lora", "--peft.rank=0"], "`peft.rank` must be at least 1 with `peft.method=lora`, got 0"),
    (["--peft.method=lora", "--peft.target_modules=[linear_qkv,q_proj]"], "unknown: ['q_proj']"),
    (["--peft.method=lora", "--peft.dropout=1"], "`peft.dropout` must be in [0, 1)"),
    (["--peft.method=lora", "--parallel.use_megatron_fsdp=true"], "with `parallel.use_megatron_fsdp=true` is not supported"),
    # Without `peft.method=lora` the adapters' settings trained every weight without a word (and skipped any check).
    (["--peft.rank=16"], "`peft.rank` sets LoRA's adapters, and `peft.method=none` trains every weight without adapters"),
    (["--peft.alpha=32", "--peft.target_modules=[q_proj]"], "`peft.alpha`, `peft.target_modules` set LoRA's adapters"),
])
def test_bad_lora_settings_are_refused_before_any_model_is_built(argv, expected):
    loops = ((SFTConfig, "trainer.sft"), (GRPOConfig, "trainer.grpo"))
    for config_class, program in loops:
        config, _ = parse_args(config_class, argv, program)
        with pytest.raises(UserError) as error:
            config.validate(world_size=2)
        assert expected in str(error.value), str(error.value)


def test_peft_method_none_over_a_lora_config_file_turns_lora_off(tmp_path):
    """`--config lora.yaml --peft.method=none` (full fine-tuning with a LoRA YAML otherwise kept) was refused for the
    file's `peft.rank`, ...: the file's adapter settings go with its LoRA; one given on the command line is refused."""
    (tmp_path / "lora.yaml").write_text("peft:\n  method: lora\n  rank: 16\n  dropout: 0.05\ntrain:\n  steps: 7\n")
    config, _ = parse_args(SFTConfig, ["--config", str(tmp_path / "lora.yaml"), "--peft.method=none"], "trainer.sft")
    config.validate(world_size=2)
    assert (config.peft.method, config.peft.rank, config.peft.dropout, config.train.steps) == ("none", 8, 0.0, 7)
    config, _ = parse_args(SFTConfig, ["--config", str(tmp_path / "lora.yaml")], "trainer.sft")
    assert (config.peft.method, config.peft.rank) == ("lora", 16)
    config, _ = parse_args(SFTConfig, ["--config", str(tmp_path / "lora.yaml"), "--peft.method=none", "--peft.rank=4"],
                           "trainer.sft")
    with pytest.raises(UserError, match="`peft.rank` sets LoRA's adapters"):
        config.validate(world_size=2)


def test_sft_held_out_loss_is_computed_with_dropout_off(monkeypatch):
    """LoRA's `peft.dropout` is on while training only: the held-out loss runs every chunk in eval mode (it ran in
    train mode, and two evaluations of one trained LoRA model with dropout 0.5 gave 5.6803 and 5.6799 against 5.6670
    without dropout), and the chunks train again after."""
    import types

    import torch

    from trainer import sft

    seen = []

    def run_microbatches(chunks, microbatches, seq_len, forward_only):
        seen.append([chunk.training for chunk in chunks])
        return 1.0, 1.0

    monkeypatch.setattr(sft, "collate_microbatches", lambda group, rows, *args: ([{}], 8))
    monkeypatch.setattr(sft, "run_microbatches", run_microbatches)
    monkeypatch.setattr(sft.evaluation, "held_out_metrics", lambda *args, **kwargs: {})
    chunks = [torch.nn.Dropout(0.5).train(), torch.nn.Dropout(0.5).train()]  # two chunks: virtual pipeline stages
    policy = types.SimpleNamespace(chunks=chunks, tokenizer=types.SimpleNamespace(pad_token_id=0))
    data = types.SimpleNamespace(eval=[0, 1, 2, 3], eval_prompts=[])
    config = types.SimpleNamespace(train=types.SimpleNamespace(micro_batch_size=1, micro_batch_tokens=0),
                                   parallel=types.SimpleNamespace(pp=1), data=types.SimpleNamespace(max_seq_len=64))
    runtime = types.SimpleNamespace(dp_rank=0, dp_size=1, device="cpu")
    assert sft.evaluate(policy, data, config, runtime) == {"eval_loss": 1.0}
    assert seen and all(modes == [False, False] for modes in seen), seen
    assert all(chunk.training for chunk in chunks)


@pytest.mark.parametrize("argv, recomputed", [
    ([], False),
    (["--peft.method=lora"], False),
    (["--peft.method=lora", "--peft.dropout=0.1"], True),  # the training forward is a dropout draw: pi_old is not it
    (["--grpo.mini_batches=2", "--train.global_batch_size=64", "--train.micro_batch_size=16"], True),
])
def test_grpo_pi_old_is_recomputed_without_dropout_when_lora_dropout_is_on(argv, recomputed):
    from trainer.grpo_update import recomputes_pi_old

    config, _ = parse_args(GRPOConfig, argv, "trainer.grpo")
    assert recomputes_pi_old(config) is recomputed


def losses(out_dir) -> dict[int, float]:
    """step -> training loss."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def shared_worker(out) -> list[str]:
    """Both layouts' runs, in the shared launch (conftest's `shared_launch`)."""
    return ["tests/distributed/lora_worker.py", "--out", str(out)]


@pytest.mark.distributed
def test_lora_sft_trains_only_adapters_resumes_exactly_and_exports_for_transformers_and_peft(shared_launch):
    out = worker_output(shared_launch[__name__])
    results = json.loads((out / "results.json").read_text())
    import peft
    import torch
    import transformers

    from model.tiny import ensure_tiny_checkpoint

    for layout in ("tp1", "tp2", "pp2"):
        result, straight, split = results[layout], out / layout / "straight", out / layout / "split"
        trainer = torch.load(straight / "trainer_logits.pt")
        merged = transformers.AutoModelForCausalLM.from_pretrained(straight / "hf", dtype=torch.float32).eval()
        base = transformers.AutoModelForCausalLM.from_pretrained(ensure_tiny_checkpoint(), dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(base, straight / "hf_adapter").eval()
        with torch.no_grad():
            result["hf_max_abs_diff"] = (merged(trainer["tokens"]).logits - trainer["logits"]).abs().max().item()
            result["peft_max_abs_diff"] = (adapted(trainer["tokens"]).logits - trainer["logits"]).abs().max().item()
        print(f"LoRA SFT {layout}: losses {losses(straight)}; |hf/ - ours| {result['hf_max_abs_diff']:.2g}, "
              f"|base + hf_adapter/ in peft - ours| {result['peft_max_abs_diff']:.2g}")
        assert result["trainable"] == ["linear_in.weight", "linear_out.weight"]  # the adapters' two matrices only
        assert result["base_names_equal"] and result["base_bit_identical"]
        assert result["adapters_off_equals_base"] and result["adapters_change_logits"]
        assert result["hf_max_abs_diff"] < 1e-5 and result["peft_max_abs_diff"] < 1e-5
        assert sorted(path.name for path in (straight / "hf_adapter").iterdir()) == ["adapter_config.json",
                                                                                     "adapter_model.safetensors"]
        trained = losses(straight)
        assert sorted(trained) == list(range(1, 7)) and trained[6] < trained[1] - 0.3
        assert metrics_rows(split) == metrics_rows(straight)  # 3 + resume + 3 = 6 straight, held-out figures included
    # A checkpoint holds the adapters and their optimizer state (main weights and two Adam moments): on the tiny model,
    # whose rank-8 adapters are 8% of its weights, measured 1.2 MB against 3.2 MB for the weights alone.
    last = out / "tp1" / "straight" / "checkpoints" / "step_00000006"
    adapter_bytes = sum(path.stat().st_size for path in last.rglob("*.distcp"))
    model_bytes = (out / "tp1" / "straight" / "hf" / "model.safetensors").stat().st_size
    assert adapter_bytes < 0.5 * model_bytes, (adapter_bytes, model_bytes)


@pytest.mark.distributed
def test_lora_adapters_in_recomputed_mlps_train_as_without_recomputation(shared_launch):
    """`model.recompute=selective` with `mlp` and `peft.target_modules=[linear_fc1,linear_fc2]`: every recomputed MLP's
    input came through frozen layers only, so megatron-core's checkpoint never ran its backward and no adapter trained
    (grad_norm 0 at both steps, the eval loss unchanged). Now the run is the one without recomputation, bit for bit."""
    out = worker_output(shared_launch[__name__])
    plain, recomputed = metrics_rows(out / "mlp_only"), metrics_rows(out / "mlp_only_recomputed")
    print("LoRA on the MLPs, recomputed:", [(row["step"], row.get("loss"), row.get("grad_norm")) for row in recomputed])
    assert [row["step"] for row in recomputed] == [0, 1, 2]
    assert all(row["grad_norm"] > 0 for row in recomputed if "grad_norm" in row)
    assert recomputed == plain


def test_adapters_load_into_a_bf16_or_fp16_model():
    """In bf16 and fp16 a chunk's model is megatron-core's Float16Module, whose load_state_dict returns None: every LoRA
    resume there failed with "cannot be loaded into this run ... ('NoneType' object has no attribute 'missing_keys')"
    (measured: fp16 LoRA on the tiny model, 2 processes, saved at step 6). The adapters load, the base stays, and a
    stray key is still refused."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from ckpt import state as checkpoint_state

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.adapter = torch.nn.Linear(2, 2), torch.nn.Module()
            self.adapter.linear_in = torch.nn.Linear(2, 1, bias=False)

    for dtype in ("bf16", "fp16"):
        config = TransformerConfig(num_layers=1, hidden_size=2, num_attention_heads=1, **{dtype: True})
        model = Float16Module(config, torch.nn.Sequential(Layer()))
        base = model.module[0].base.weight.detach().clone()
        checkpoint_state._load_adapters(model, {"0.adapter.linear_in.weight": torch.full((1, 2), 0.5)})
        assert torch.equal(model.module[0].adapter.linear_in.weight.float(), torch.full((1, 2), 0.5))
        assert torch.equal(model.module[0].base.weight, base)
        with pytest.raises(RuntimeError, match="do not match"):
            checkpoint_state._load_adapters(model, {"0.adapter.linear_out.weight": torch.zeros(2, 1)})
