"""Model families through the real model path on CPU (fp32, no Transformer Engine), on tiny random checkpoints.

For each family: HF -> Megatron logits, greedy generation against `transformers.generate` and the export round trip
at TP=2, then 6 SFT steps through the SFT entry point; families this trainer cannot build are refused at start-up.
One worker covers every family (tests/distributed/family_worker.py, in the shared launch); the figures are in README.md.
"""

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from config.errors import UserError
from tests.conftest import REPO, worker_output

WORKER = "tests/distributed/family_worker.py"
LOGIT_TOLERANCE = 1e-5
PROMPTS, NEW_TOKENS = 3, 16

# Shared by every family: 2 layers, GQA (4 query heads over 2 KV heads), the tiny model's 512-token vocabulary.
# A wider weight init than transformers' 0.02 sharpens attention, so rope scaling and windows move the logits
# by far more than the tolerance (Llama-3 rope scaling: 4.7e-5 at 0.02, 1.7e-3 at 0.05).
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=256, initializer_range=0.05)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# family -> (transformers config class, model class, settings beyond SHAPE)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE, max_position_embeddings=131072)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=16)),
    # A window shorter than the parity sequence (48) and the prompts, so windowed attention is exercised.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(tie_word_embeddings=False, head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, norm_topk_prob=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16)),
}
SUPPORTED = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"]
# Megatron-Bridge builds these from their own Transformer Engine layer specs (see model/providers.py).
REFUSED = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def build_family_checkpoint(family: str, directory, tokenizer_dir) -> None:
    """A seeded random checkpoint of `family` with the tiny model's tokenizer files beside it."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config_class, model_class, settings = FAMILIES[family]
    config = getattr(transformers, config_class)(
        **{**SHAPE, **settings}, vocab_size=512, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    assert len(tokenizer) <= config.vocab_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(config).float()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)


def shared_worker(out) -> list[str]:
    """Every family's tiny checkpoint and a small SFT set; the worker runs in the shared launch (conftest's
    `shared_launch`)."""
    from model.tiny import ensure_tiny_checkpoint

    from data.arithmetic import generate_problems

    tokenizer_dir = ensure_tiny_checkpoint()
    checkpoints, sft_data = out / "checkpoints", out / "sft-data"
    for family in FAMILIES:
        build_family_checkpoint(family, checkpoints / family, tokenizer_dir)
    # A small arithmetic set: tokenizing the bundled 11,000 problems would cost each family 7 s per process.
    sft_data.mkdir()
    for split, count, seed in (("train", 64, 1), ("test", 8, 2)):
        (sft_data / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in generate_problems(count, seed)))
    return [WORKER, "--out", str(out), "--sft-data", str(sft_data),
            *(f"--model={family}={checkpoints / family}" for family in FAMILIES)]


@pytest.fixture(scope="module")
def family_results(shared_launch) -> dict[str, dict]:
    """Every family's per-rank results and SFT metrics, from the worker's run in the shared launch."""
    out = worker_output(shared_launch[__name__])
    results = {}
    for family in FAMILIES:
        ranks = {int(path.stem.removeprefix("rank")): json.loads(path.read_text())
                 for path in (out / family).glob("rank*.json")}
        metrics = out / family / "sft" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        results[family] = {"ranks": ranks, "train_losses": [row["loss"] for row in rows if "loss" in row],
                           "eval_losses": [row["eval_loss"] for row in rows if "eval_loss" in row]}
    print_figures(results)
    return results


def print_figures(results: dict[str, dict]) -> None:
    """The README table's figures (shown with `pytest -s`)."""
    print("\nfamily: max |logit diff| over TP ranks, greedy equal, round trip bit-identical (tensors), SFT loss first -> last")
    for family in SUPPORTED:
        ranks, losses = results[family]["ranks"], results[family]["train_losses"]
        if sorted(ranks) != [0, 1] or len(losses) < 2 or any("conversion_error" in rank for rank in ranks.values()):
            print(f"{family}: incomplete (see the assertions)")
            continue
        print(f"{family}: {max(rank['max_abs_logit_diff'] for rank in ranks.values()):.2g}, {ranks[0]['greedy_equal']}, "
              f"{ranks[0]['round_trip_bit_identical']} ({ranks[0]['round_trip_tensors']}), {losses[0]:.3f} -> {losses[-1]:.3f}")


def no_crash(ranks: dict[int, dict]) -> None:
    """Fail with the worker's traceback when a step crashed instead of measuring."""
    for rank in ranks.values():
        for key in ("conversion_error", "sft_error"):
            assert key not in rank, f"{rank['family']} rank: {key}\n{rank[key]}"


@pytest.mark.distributed
@pytest.mark.parametrize("family", SUPPORTED)
def test_family_matches_transformers_round_trips_and_trains(family, family_results):
    ranks, losses = family_results[family]["ranks"], family_results[family]["train_losses"]
    assert sorted(ranks) == [0, 1]
    no_crash(ranks)
    for rank in ranks.values():
        assert rank["max_abs_logit_diff"] < LOGIT_TOLERANCE
        assert rank["greedy_equal"] is True, "greedy generation must match transformers.generate token for token"
        assert 0 < rank["generated_tokens"] <= PROMPTS * NEW_TOKENS
    main = ranks[0]
    assert main["round_trip_mismatched_names"] == []
    assert main["round_trip_tensors"] > 0 and main["round_trip_bit_identical"] is True
    if family == "llama":
        # Without its rope scaling the model's logits move 100x the tolerance: parity does check the scaling.
        assert main["rope_scaling_effect"] > 100 * LOGIT_TOLERANCE
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 0.1, f"SFT loss did not fall: {losses}"
    before, after = family_results[family]["eval_losses"]  # held-out, at step 0 and step 6
    assert after < before - 0.1


@pytest.mark.distributed
@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_without_a_cpu_path_is_refused_at_start_up(family, family_results):
    ranks = family_results[family]["ranks"]
    assert sorted(ranks) == [0, 1]
    no_crash(ranks)
    for rank in ranks.values():
        for key in ("conversion_refused", "sft_refused"):
            assert "`model.path=" in rank[key] and REFUSED[family] in rank[key], rank[key]
    assert family_results[family]["train_losses"] == []


def test_the_fused_router_is_off_where_routes_are_recorded_and_replayed():
    """Transformer Engine's fused top-k bypasses megatron-core's RouterReplay (read in 0.19.2's moe_utils): with it, the
    first rollout of an MoE GRPO recorded nothing and raised."""
    from model import providers

    moe = SimpleNamespace(moe_enable_routing_replay=True, moe_router_fusion=True)
    providers.keep_routes_visible(moe)
    assert moe.moe_router_fusion is False
    without_replay = SimpleNamespace(moe_enable_routing_replay=False, moe_router_fusion=True)
    providers.keep_routes_visible(without_replay)
    assert without_replay.moe_router_fusion is True


def test_transformer_engine_fusions_are_off_without_it_and_untouched_with_it(monkeypatch):
    from model import providers

    def provider():
        return SimpleNamespace(apply_rope_fusion=True, persist_layer_norm=True, moe_permute_fusion=True,
                               moe_router_fusion=False, bias_activation_fusion=True, bias_dropout_fusion=True,
                               cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")

    monkeypatch.setattr(providers, "HAVE_TRANSFORMER_ENGINE", False)
    without = provider()
    providers.disable_fusions_needing_transformer_engine(without)
    assert vars(without) == {**vars(provider()), "apply_rope_fusion": False, "persist_layer_norm": False,
                             "moe_permute_fusion": False, "cross_entropy_fusion_impl": "native"}
    monkeypatch.setattr(providers, "HAVE_TRANSFORMER_ENGINE", True)
    with_te = provider()
    providers.disable_fusions_needing_transformer_engine(with_te)
    assert vars(with_te) == vars(provider())


@pytest.mark.slow
def test_only_the_checkpoints_family_bridge_is_imported_and_the_rest_on_first_use(tmp_path):
    """`model.providers.auto_bridge` imports the Qwen2 family's bridge alone (Megatron-Bridge's package `__init__`, which
    imports every family's, runs only when a name it defines is used). A later call in the same process brings its own
    family (Llama), one outside the table brings every bridge (Gemma 2, refused later by the layer-spec check), and a
    name of the package's `__init__` then finds what `import megatron.bridge` gives."""
    from model import tiny

    tokenizer_dir = tiny.ensure_tiny_checkpoint(name="tiny")
    for family in ("llama", "gemma2"):
        (tmp_path / family).mkdir()
        build_family_checkpoint(family, tmp_path / family, tokenizer_dir)
    script = f"""
import sys
from model import providers, tiny
def loaded(name):
    return "megatron.bridge.models." + name in sys.modules
bridge = providers.auto_bridge(tiny.ensure_tiny_checkpoint(name="tiny"))
print("RESULT", type(bridge._model_bridge).__name__, loaded("bailing"), loaded("llama"))
print("RESULT", type(providers.auto_bridge("{tmp_path / 'llama'}")._model_bridge).__name__, loaded("bailing"))
print("RESULT", type(providers.auto_bridge("{tmp_path / 'gemma2'}")._model_bridge).__name__, loaded("bailing"))
from megatron.bridge import AutoBridge
from megatron.bridge.models import GPTModelProvider
print("RESULT", AutoBridge is type(bridge))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    # (Bridge's own loggers print to stdout too: only the script's lines are read.)
    assert [line for line in result.stdout.splitlines() if line.startswith("RESULT ")] == [
        "RESULT Qwen2Bridge False False", "RESULT LlamaBridge False", "RESULT Gemma2Bridge True", "RESULT True"]


@pytest.mark.parametrize("config_class, architecture", [("Phi3Config", "Phi3ForCausalLM"),
                                                        ("MixtralConfig", "MixtralForCausalLM")])
def test_an_architecture_without_a_bridge_is_refused_in_one_paragraph(tmp_path, config_class, architecture):
    """It was Megatron-Bridge's ValueError under a traceback on every rank (a 60-line list of its architectures and how
    to write a bridge), after the data was read: now a `UserError` naming the setting, before any weight is read."""
    import transformers

    from model import providers

    config = getattr(transformers, config_class)(**SHAPE, vocab_size=512)
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)  # the config alone: Bridge decides from it
    with pytest.raises(UserError, match=f"`grpo.teacher={tmp_path}` is a {architecture} checkpoint, an architecture "
                                        "Megatron-Bridge 0.6.2 has no bridge for.*Point `--grpo.teacher` at a Llama"):
        providers.auto_bridge(tmp_path, f"grpo.teacher={tmp_path}")


def test_gemma_without_transformer_engine_is_refused_in_one_paragraph(tmp_path):
    """Gemma (1)'s norms scale by 1 + weight: the build raised `ValueError: layernorm_zero_centered_gamma is not
    supported by torch's LayerNorm/RMSNorm` under a traceback, after the data was read."""
    import transformers

    from model import providers

    if providers.HAVE_TRANSFORMER_ENGINE:
        pytest.skip("Transformer Engine's norms compute 1 + weight")
    config = transformers.GemmaConfig(**SHAPE, head_dim=16, vocab_size=512)
    config.architectures = ["GemmaForCausalLM"]
    config.save_pretrained(tmp_path)
    bridge = providers.auto_bridge(tmp_path)
    with pytest.raises(UserError, match=f"`model.path={tmp_path}` is a GemmaForCausalLM checkpoint, whose norms scale "
                                        r"by 1 \+ weight .*Point `--model.path` at a Llama"):
        providers.configure_provider(bridge, dtype="fp32", tp=1, pp=1, vpp=None, seq_length=64, load_weights=False)
