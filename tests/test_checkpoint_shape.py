"""A checkpoint the stack would build as another model than transformers does is refused at start-up: a tokenizer with
ids past the embedding, a vocabulary tensor parallelism cannot split, rope settings megatron-core does not reproduce
(`config.checkpoint_shape`, `ModelChecks.check_layout_divides`)."""

import json
import shutil

import pytest

from config.checkpoint_shape import LLAMA3_FIXED, rope_mismatch
from config.errors import UserError
from config.loops import GRPOConfig, SFTConfig
from model import build

LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, **LLAMA3_FIXED}
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}
YARN_WRITTEN = {"beta_fast": 32, "beta_slow": 1, "truncate": True}  # transformers' defaults, written out


def tiny_copy(tmp_path, **config_changes):
    """The embedded tiny checkpoint copied to `tmp_path/model`, its config.json changed."""
    from model.tiny import ensure_tiny_checkpoint

    model = shutil.copytree(ensure_tiny_checkpoint(), tmp_path / "model")
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, **config_changes}))
    return model


def with_added_tokens(tmp_path):
    """The tiny checkpoint with two chat-template tokens added to its tokenizer and its embedding not resized."""
    import transformers

    model = tiny_copy(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "vocab_size": len(tokenizer)}))  # full, as an official one
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tokenizer.save_pretrained(model)
    return model


def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused_naming_them(tmp_path):
    """It trained at TP=2 with those tokens masked out of the vocab-parallel embedding and loss; at TP=1 an IndexError."""
    model = with_added_tokens(tmp_path)
    with pytest.raises(UserError) as error:
        build.load_tokenizer(model)
    message = str(error.value)
    assert "2 token ids at or past the model's vocab_size 422" in message and "'<tool_call>' (id 422)" in message
    assert "model.resize_token_embeddings(len(tokenizer))" in message and "`--model.path` at DIR" in message
    assert "\n" not in message


def test_a_tokenizer_smaller_than_the_vocabulary_passes(tmp_path):
    """Official checkpoints pad the embedding past the tokenizer (Qwen2.5: vocab_size 151936, 151665 tokens)."""
    tokenizer = build.load_tokenizer(tiny_copy(tmp_path, vocab_size=151936))
    assert max(tokenizer.get_vocab().values()) < 151936


def test_a_reward_model_with_ids_past_its_vocabulary_is_refused_before_any_model(tmp_path):
    """GRPO's reward model loaded its tokenizer after the policy was built; it is checked with the policy's now."""
    from model.tiny import ensure_tiny_checkpoint
    from trainer.grpo import load_tokenizer_and_prompts

    config = GRPOConfig()
    config.grpo.reward_model = str(with_added_tokens(tmp_path))
    with pytest.raises(UserError, match="The tokenizer of `grpo.reward_model=.*` holds 2 token ids"):
        load_tokenizer_and_prompts(config, ensure_tiny_checkpoint(), None, 1)


def test_a_vocabulary_tensor_parallelism_does_not_divide_is_refused():
    """It was `AssertionError: 427 is not divisible by 2` in the build: Bridge's providers do not pad the vocabulary."""
    config = SFTConfig()
    config.parallel.tp = 2
    shape = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    with pytest.raises(UserError, match=r"`parallel.tp=2` must divide the model's vocabulary, 427 tokens .* Change "
                                        r"`--parallel.tp` to a divisor of 427"):
        config.check_layout_divides({**shape, "vocab_size": 427})
    assert config.check_layout_divides({**shape, "vocab_size": 428}) == 2


@pytest.mark.parametrize("model_type, rope, refused", [
    ("llama", LLAMA31_ROPE, None),
    ("llama", {**LLAMA31_ROPE, "factor": 32.0}, None),  # Llama 3.2's
    ("llama", {**LLAMA31_ROPE, "low_freq_factor": 2.0}, "low_freq_factor=2.0, and Megatron-Bridge passes only its `factor`"),
    ("llama", {**LLAMA31_ROPE, "original_max_position_embeddings": 4096}, "original_max_position_embeddings=4096"),
    ("llama", {"rope_type": "linear", "factor": 4.0}, None),
    ("llama", {"type": "dynamic", "factor": 4.0}, "`rope_type` 'dynamic', which Megatron-Bridge does not carry"),
    ("qwen2", {"rope_type": "llama3", "factor": 8.0, **LLAMA3_FIXED}, "'llama3', which .* for a qwen2 checkpoint"),
    ("qwen2", {"rope_type": "linear", "factor": 4.0}, "'linear', which"),
    ("qwen3", {**QWEN_YARN, **YARN_WRITTEN}, None),
    ("qwen3", QWEN_YARN, None),  # Qwen's published snippet: the betas and truncate take transformers' defaults
    ("qwen2", {"rope_type": "yarn", "original_max_position_embeddings": 32768}, "yarn scaling without `factor`"),
    ("qwen3_moe", {**QWEN_YARN, **YARN_WRITTEN, "attention_factor": 1.0}, "with `attention_factor`"),
    ("mistral", {**QWEN_YARN, **YARN_WRITTEN}, "'yarn', which .* for a mistral checkpoint"),
    ("qwen2", {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "'longrope'"),
    ("qwen2", {"rope_type": "default", "rope_theta": 1000000.0}, None),
])
def test_rope_settings_megatron_core_would_not_reproduce_are_refused(model_type, rope, refused):
    """Read from Megatron-Bridge 0.6.2's bridges; `test_the_rope_rule_matches_the_stack` measures it."""
    config = SFTConfig()
    hf = {"model_type": model_type, "rope_parameters": rope}
    if refused is None:
        config.check_layout_divides(hf)
        return
    with pytest.raises(UserError, match=f"The model's config.json \\(`model.path`\\) sets the rope settings .*: .*{refused}"):
        config.check_layout_divides(hf)
    with pytest.raises(UserError, match="sets the rope settings"):  # the older key too
        config.check_layout_divides({"model_type": model_type, "rope_scaling": rope})


def test_refused_rope_settings_are_named_before_any_model_is_built(tmp_path):
    """The reviewer's case: a Llama checkpoint whose llama3 settings are not megatron-core's fixed ones."""
    model = tiny_copy(tmp_path, model_type="llama", architectures=["LlamaForCausalLM"],
                      rope_parameters={**LLAMA31_ROPE, "high_freq_factor": 2.0})
    config = SFTConfig()
    config.model.path = str(model)
    with pytest.raises(UserError, match="high_freq_factor=2.0.*Point `--model.path` at another checkpoint"):
        config.validate(world_size=1)


def test_a_vision_language_checkpoint_is_refused_before_any_model_is_built(tmp_path):
    """Megatron-Bridge has bridges for Qwen2.5-VL and Gemma 3's vision-language checkpoints: a tiny random
    Qwen2_5_VLForConditionalGeneration passed start-up, read its data, built a multimodal model, and the first SFT step
    failed under a traceback (`Qwen25VLModel.forward() got an unexpected keyword argument 'padding_mask'`)."""
    model = tiny_copy(tmp_path, model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"],
                      vision_config={"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2})
    for config, key in ((SFTConfig(), "model.path"), (GRPOConfig(), "grpo.teacher")):
        config.model.path = str(model) if key == "model.path" else str(tiny_copy(tmp_path / "policy"))
        if key == "grpo.teacher":
            config.grpo.teacher = str(model)
        with pytest.raises(UserError, match=f"`--{key}` is a vision-language checkpoint \\(Qwen2_5_VLForConditional"
                                            f"Generation.*Point `--{key}` at a text-only checkpoint"):
            config.validate(world_size=1)


QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "num_hidden_layers": 2}


@pytest.mark.parametrize("hf, max_seq_len, refused", [
    # Measured (tiny random checkpoints, fp32, TP=1): logits 0.72 (Qwen2) and 0.93 (Qwen3) from transformers' over 48
    # tokens, greedy completions different; with the window at 64 (no row reaches it) equal.
    ({"model_type": "qwen2", **QWEN_WINDOW}, 64, r"a sliding window of 16 tokens on layers \[1\].*for a qwen2 checkpoint"),
    ({"model_type": "qwen3", **QWEN_WINDOW}, 64, "for a qwen3 checkpoint.*`--data.max_seq_len=16` or less"),
    ({"model_type": "qwen3_moe", **QWEN_WINDOW, "num_experts": 4}, 64, "sliding window of 16 tokens"),
    ({"model_type": "qwen2", **QWEN_WINDOW}, 16, None),  # no row reaches the window
    ({"model_type": "qwen2", **QWEN_WINDOW, "max_window_layers": 2}, 64, None),  # transformers slides no layer
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 16}, 64, None),  # Qwen2.5's own configs
    ({"model_type": "mistral", "sliding_window": 16}, 64, None),  # carried (tests/test_model_families.py)
    # Qwen3 with attention bias: trained without it, the export failed at the end ("33 tensors ... were not written");
    # Llama with either: `'NoneType' object has no attribute 'megatron_module'` loading the weights.
    ({"model_type": "qwen3", "attention_bias": True}, 64, "`attention_bias: true`, biases .* for a qwen3 checkpoint"),
    ({"model_type": "llama", "attention_bias": True, "mlp_bias": True}, 64, "`attention_bias: true` and `mlp_bias: true`"),
    ({"model_type": "llama", "attention_bias": False, "mlp_bias": False}, 64, None),
])
def test_attention_settings_megatron_bridge_drops_are_refused(hf, max_seq_len, refused):
    """Read from Megatron-Bridge 0.6.2's Qwen2/Qwen3/Llama bridges, which carry no sliding window (Mistral's does)."""
    config = SFTConfig()
    config.data.max_seq_len = max_seq_len
    if refused is None:
        config.check_layout_divides(hf)
        return
    with pytest.raises(UserError, match=f"The model's config.json \\(`model.path`\\) sets .*{refused}"):
        config.check_layout_divides(hf)


FAMILY_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                  "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                  "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
ROPE_CASES = [LLAMA31_ROPE, {**LLAMA31_ROPE, "factor": 32.0}, {**LLAMA31_ROPE, "low_freq_factor": 2.0},
              {**LLAMA31_ROPE, "original_max_position_embeddings": 4096}, {"rope_type": "linear", "factor": 4.0},
              {**QWEN_YARN, **YARN_WRITTEN}, {**QWEN_YARN, **YARN_WRITTEN, "truncate": False},
              {**QWEN_YARN, **YARN_WRITTEN, "mscale": 0.707, "mscale_all_dim": 1.0},
              {**QWEN_YARN, "beta_fast": 32, "beta_slow": 1}, {**QWEN_YARN, **YARN_WRITTEN, "attention_factor": 1.0},
              QWEN_YARN, {**QWEN_YARN, "beta_fast": 16},
              {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
               "original_max_position_embeddings": 4096}]


def rotary_tables(family: str, rope: dict, directory, monkeypatch, positions: int = 4096):
    """(transformers' cos, megatron-core's cos) at `positions` positions for a one-layer `family` checkpoint with `rope`,
    megatron-core's from the provider Megatron-Bridge makes (built as GPTModel builds its rotary embedding); None for
    megatron-core's where Bridge or megatron-core fails."""
    import sys

    import torch
    import transformers
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    from model.providers import auto_bridge, fill_yarn_defaults

    config_class, model_class = FAMILY_CLASSES[family]
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if family == "qwen3_moe" else {}
    config = getattr(transformers, config_class)(
        hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=64, max_position_embeddings=131072, head_dim=64, rope_parameters=dict(rope), **experts)
    config.architectures = [model_class]
    config.save_pretrained(directory)  # the config alone: no weights are read for the provider
    module = sys.modules[getattr(transformers, model_class).__module__]
    rotary = next(getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding"))
    reference, _ = rotary(transformers.AutoConfig.from_pretrained(directory))(
        torch.zeros(1, positions, 64), torch.arange(positions)[None])  # [1, positions, head dim], attention factor in
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the rotary modules move their tables there
    try:
        provider = auto_bridge(directory).to_megatron_provider(load_weights=False)
        fill_yarn_defaults(provider)  # as `configure_provider` does
        common = dict(kv_channels=64, rotary_percent=provider.rotary_percent, rotary_base=provider.rotary_base,
                      seq_len_interpolation_factor=provider.seq_len_interpolation_factor, use_cpu_initialization=True)
        if provider.position_embedding_type == "yarn":
            embedding, scale = YarnRotaryEmbedding(
                **common, scaling_factor=provider.yarn_rotary_scaling_factor, beta_fast=provider.yarn_beta_fast,
                original_max_position_embeddings=provider.yarn_original_max_position_embeddings,
                beta_slow=provider.yarn_beta_slow, mscale=provider.yarn_mscale, mscale_all_dim=provider.yarn_mscale_all_dim,
                correction_range_round_to_int=provider.yarn_correction_range_round_to_int).get_emb(positions)
        else:
            embedding = RotaryEmbedding(**common, rope_scaling=provider.rope_scaling,
                                        rope_scaling_factor=provider.rope_scaling_factor).get_emb(positions)
            scale = 1.0
    except (TypeError, AssertionError):  # Mistral's yarn in Bridge; megatron-core's yarn without betas
        return reference[0], None
    return reference[0], embedding[:, 0, 0, :].cos() * scale  # [positions, head dim]


def test_the_rope_rule_matches_the_stack(tmp_path, monkeypatch):
    """For every verified family, the rope settings `rope_mismatch` accepts give megatron-core (through Megatron-Bridge)
    transformers' rotary tables to 1e-6 at 4096 positions, and those it refuses give other tables or no model."""
    outcomes = {}
    for family in FAMILY_CLASSES:
        for index, rope in enumerate(ROPE_CASES):
            reference, megatron = rotary_tables(family, rope, tmp_path / f"{family}-{index}", monkeypatch)
            same = megatron is not None and (megatron - reference).abs().max().item() < 1e-6
            accepted = rope_mismatch({"model_type": family, "rope_parameters": rope}) is None
            outcomes[family, index] = (accepted, same)
    assert all(accepted == same for accepted, same in outcomes.values()), outcomes
    assert sum(accepted for accepted, _ in outcomes.values()) == 9 + 3 * 6  # Llama 9, Qwen2/3/3-MoE 6 each, Mistral 0
