"""What a checkpoint's own files must say for megatron-core to build the model transformers builds from them: its shape
as positive whole numbers, rope settings Megatron-Bridge carries over, and a tokenizer whose ids its embedding holds.
Each check reads a config.json (as a dict) and raises a `UserError` naming the setting or file to change."""

from config.errors import UserError

SHAPE_SETTINGS = ("num_attention_heads", "num_key_value_heads", "num_hidden_layers", "hidden_size", "intermediate_size",
                  "vocab_size", "head_dim")


def check_shape_settings(hf: dict, name: str) -> None:
    """A checkpoint's config.json (`hf`, of the `name` model) names an architecture transformers knows, and gives its
    shape as positive whole numbers (a damaged or hand-edited file raised deep in the build: a division by zero, or
    transformers' retries "due to network issues")."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = hf.get("model_type")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UserError(f"The {name}'s config.json names `model_type` {model_type!r}, which this transformers does not "
                        "know (it knows llama, mistral, qwen2, qwen3, qwen3_moe, ...). Fix its config.json, or point at "
                        "a checkpoint of a family in docs/models.md.")
    for setting in SHAPE_SETTINGS:
        value = hf.get(setting)
        if not (value is None or (type(value) is int and value > 0)):
            raise UserError(f"The {name}'s config.json gives `{setting}` as {value!r}, not a positive whole number. "
                            "Fix its config.json (a damaged copy, or a hand edit), or point at another checkpoint.")


# ---------------------------------------------------------------- rope settings

# The rope types Megatron-Bridge 0.6.2 carries into megatron-core 0.19 for each verified family (read in its
# MegatronModelBridge.hf_config_to_provider_kwargs, LlamaBridge.provider_bridge and MistralBridge.provider_bridge). Any
# other type is dropped (megatron-core then rotates without scaling) or, Mistral's yarn, fails in Bridge. Model types not
# listed are not checked here: docs/models.md names the verified families.
ROPE_TYPES_CARRIED = {"llama": ("default", "llama3", "linear", "yarn"), "qwen2": ("default", "yarn"),
                      "qwen3": ("default", "yarn"), "qwen3_moe": ("default", "yarn"), "mistral": ("default",)}
# LlamaBridge passes only a llama3 scaling's `factor`; megatron-core's RotaryEmbedding._apply_scaling hard-codes the rest
# (Llama 3.1's and 3.2's own values).
LLAMA3_FIXED = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}


def rope_settings(hf: dict) -> dict:
    """A config.json's rope settings: `rope_parameters` (transformers 5), else the older `rope_scaling` ({} if none)."""
    settings = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return settings if isinstance(settings, dict) else {}


def rope_mismatch(hf: dict) -> str | None:
    """Why megatron-core, built through Megatron-Bridge, would rotate with other frequencies than transformers does for
    this config.json, as a clause; None where it rotates the same (tests/test_checkpoint_shape.py compares the tables)."""
    carried = ROPE_TYPES_CARRIED.get(hf.get("model_type"))
    settings = rope_settings(hf)
    rope_type = settings.get("rope_type") or settings.get("type") or "default"
    if carried is None or rope_type == "default":
        return None
    if rope_type not in carried:
        return (f"`rope_type` {rope_type!r}, which Megatron-Bridge does not carry into megatron-core for a "
                f"{hf['model_type']} checkpoint (it carries {', '.join(carried)})")
    if rope_type == "llama3":
        other = {key: settings.get(key) for key, value in LLAMA3_FIXED.items() if settings.get(key) != value}
        if other:
            return (f"llama3 scaling with {', '.join(f'{key}={value}' for key, value in other.items())}, and "
                    "Megatron-Bridge passes only its `factor`: megatron-core fixes "
                    f"{', '.join(f'{key}={value}' for key, value in LLAMA3_FIXED.items())} (Llama 3.1's and 3.2's)")
    if rope_type == "yarn":
        if settings.get("attention_factor") is not None:
            return ("yarn scaling with `attention_factor`, which Megatron-Bridge does not pass: megatron-core "
                    "computes its own from `factor`, `mscale` and `mscale_all_dim`")
        if settings.get("factor") is None:  # the betas and truncate take transformers' defaults (`fill_yarn_defaults`)
            return "yarn scaling without `factor`, which transformers and megatron-core both need"
    return None


def check_rope_scaling(hf: dict, name: str, key: str) -> None:
    """Refuse rope settings (config.json `hf` of the `name` model at `key`) that megatron-core would not reproduce."""
    mismatch = rope_mismatch(hf)
    if mismatch:
        raise UserError(
            f"The {name}'s config.json (`{key}`) sets the rope settings {rope_settings(hf)}: {mismatch}. Trained here, the "
            "model would rotate its queries and keys with other frequencies than its config says (and than "
            f"transformers uses), and its export would disagree with what was trained. Point `--{key}` at another "
            "checkpoint, or correct the rope settings in its config.json. Reproduced: no scaling; yarn (every family "
            "but Mistral) with its factor; for Llama also linear, and llama3 "
            "with low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192 (docs/models.md).")


# ---------------------------------------------------------------- attention settings Bridge drops

# Megatron-Bridge 0.6.2 carries a sliding window only for Mistral (MistralBridge.provider_bridge, every layer); its Qwen2,
# Qwen3 and Qwen3-MoE bridges leave it out, and Qwen3's sets no attention bias (`add_qkv_bias = False`), while Llama's
# maps `attention_bias` and `mlp_bias` to biases its weight mappings do not load.
WINDOWS_CARRIED = ("mistral",)
NO_BIAS_CARRIED = ("llama", "qwen3", "qwen3_moe")


def carried_window(hf: dict) -> int | None:
    """The sliding window (tokens) megatron-core attends within for a checkpoint's config.json `hf`, as Megatron-Bridge
    carries it (Mistral's `sliding_window`); None where megatron-core gets none."""
    return hf.get("sliding_window") if hf.get("model_type") in WINDOWS_CARRIED else None


def dropped_attention_settings(hf: dict, positions: int) -> str | None:
    """What of a verified family's config.json (`hf`) megatron-core, built through Megatron-Bridge, would not compute as
    transformers does on rows of up to `positions` tokens, as a clause; None where nothing is dropped."""
    import transformers

    model_type = hf.get("model_type")
    if model_type not in ROPE_TYPES_CARRIED:
        return None
    biases = [name for name in ("attention_bias", "mlp_bias") if model_type in NO_BIAS_CARRIED and hf.get(name)]
    if biases:
        return (f"{' and '.join(f'`{name}: true`' for name in biases)}, biases Megatron-Bridge does not carry for a "
                f"{model_type} checkpoint (it would train without them, or fail loading them)")
    if model_type in WINDOWS_CARRIED:
        return None
    settings = {key: value for key, value in hf.items() if key != "model_type"}
    config = transformers.AutoConfig.for_model(model_type, **settings)  # transformers' own reading of the window
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers  # Qwen3-MoE: all
    sliding = [index for index, kind in enumerate(kinds) if kind == "sliding_attention"]
    if sliding and window and positions > window:
        return (f"a sliding window of {window} tokens on layers {sliding} (`use_sliding_window`, `sliding_window`, "
                f"`max_window_layers`), which Megatron-Bridge does not carry for a {model_type} checkpoint: megatron-core "
                f"would attend over whole rows of up to {positions} tokens where transformers attends over the window "
                f"(a window no row reaches changes nothing: `--data.max_seq_len={window}` or less also does)")
    return None


def check_attention_settings(hf: dict, name: str, key: str, positions: int) -> None:
    """Refuse attention settings (config.json `hf` of the `name` model at `key`) that megatron-core would drop on rows of
    up to `positions` tokens (`data.max_seq_len`)."""
    dropped = dropped_attention_settings(hf, positions)
    if dropped:
        raise UserError(
            f"The {name}'s config.json (`{key}`) sets {dropped}. Trained here, the model would compute another function "
            "than its config says (and than transformers computes), and its export would disagree with what was "
            f"trained. Point `--{key}` at another checkpoint (docs/models.md: Model families verified).")


# ---------------------------------------------------------------- dense layers among the experts

def check_every_layer_sparse(hf: dict, name: str, key: str) -> None:
    """Refuse a Qwen3-MoE config.json (`hf`, of the `name` model at `key`) that makes some layers dense: Megatron-Bridge
    0.6.2's Qwen3-MoE bridge builds every layer as a Mixture-of-Experts layer, finds no router or experts in the
    checkpoint for a dense one (only a warning) and leaves them uninitialised: NaN logits, trained without an error."""
    if hf.get("model_type") != "qwen3_moe":
        return
    layers, step = hf.get("num_hidden_layers") or 0, hf.get("decoder_sparse_step") or 1
    # transformers' Qwen3MoeDecoderLayer: sparse where not in mlp_only_layers and (index + 1) % decoder_sparse_step == 0.
    dense = sorted({*(hf.get("mlp_only_layers") or []), *(index for index in range(layers) if (index + 1) % step)})
    if dense:
        raise UserError(
            f"The {name}'s config.json (`{key}`) makes layers {dense} dense (`mlp_only_layers` "
            f"{hf.get('mlp_only_layers') or []}, `decoder_sparse_step` {step}), and Megatron-Bridge 0.6.2 builds every "
            "layer of a Qwen3-MoE checkpoint as a Mixture-of-Experts layer: those layers' MLP weights would go unread "
            "and their router and experts stay uninitialised (NaN logits), trained without an error. Point "
            f"`--{key}` at a Qwen3-MoE checkpoint whose every layer is sparse (`mlp_only_layers` empty and "
            "`decoder_sparse_step` 1, as Qwen3-30B-A3B's and Qwen3-235B-A22B's).")


# ---------------------------------------------------------------- the tokenizer against the embedding

def check_tokenizer_fits(tokenizer, hf: dict, path, key: str) -> None:
    """Refuse a tokenizer (of the checkpoint `path` at `key`, config.json `hf`) holding ids at or past the model's
    `vocab_size`: the embedding has no row for them."""
    vocab_size = hf.get("vocab_size")
    if not vocab_size:
        return
    beyond = sorted((index, token) for token, index in tokenizer.get_vocab().items() if index >= vocab_size)
    if not beyond:
        return
    named = ", ".join(f"{token!r} (id {index})" for index, token in beyond[:4]) + (", ..." if len(beyond) > 4 else "")
    raise UserError(
        f"The tokenizer of `{key}={path}` holds {len(beyond)} token id{'s' if len(beyond) > 1 else ''} at or past the "
        f"model's vocab_size {vocab_size} (its config.json): {named}. The embedding has no row for them: with tensor "
        "parallelism megatron-core trains with those tokens silently masked out (a zero embedding, a constant logit), "
        "without it the first forward fails. Tokens added to a tokenizer (chat-template special tokens, say) need the "
        "model resized too: load both with transformers, call `model.resize_token_embeddings(len(tokenizer))`, save "
        f"both with `save_pretrained(DIR)`, and point `--{key}` at DIR.")
