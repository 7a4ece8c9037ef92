"""Megatron-Bridge's provider for an HF checkpoint, set up as this trainer builds: AutoBridge loaded once (and the
imported objects frozen out of the collector's sight), the layer spec chosen (`model.attention`), precision, parallel
sizes, Mixture-of-Experts routing and the fusions a machine without Transformer Engine cannot run.
"""

import collections
import contextlib
import functools
import gc
import importlib
import importlib.util
import io
import json
import logging
import sys
from pathlib import Path

import torch

from config.errors import UserError
from config.hf import architecture, read_hf_config
from config.sections import have_transformer_engine
from model import lora, rules

log = logging.getLogger(__name__)

# Decided once, at import: the fused-Adam test double makes later calls of have_transformer_engine() say yes
# (for the optimizer) while the layers stay the ones built without Transformer Engine.
HAVE_TRANSFORMER_ENGINE = have_transformer_engine()



# HF architecture -> the Megatron-Bridge package whose import registers its bridge, for the families this trainer
# tests (docs/models.md); any other architecture imports every bridge, as `import megatron.bridge` does.
FAMILY_BRIDGES = {"Qwen2ForCausalLM": "megatron.bridge.models.qwen", "Qwen3ForCausalLM": "megatron.bridge.models.qwen",
                  "Qwen3MoeForCausalLM": "megatron.bridge.models.qwen", "LlamaForCausalLM": "megatron.bridge.models.llama",
                  "MistralForCausalLM": "megatron.bridge.models.mistral"}
# Packages whose `__init__` imports every bridge (and the diffusion models): run only when a name they define is used.
EAGER_BRIDGE_PACKAGES = ("megatron.bridge", "megatron.bridge.models")


def auto_bridge(hf_path: str | Path, setting: str | None = None):
    """Megatron-Bridge's AutoBridge for a local HF checkpoint directory (fp32 weights as stored); an architecture it has
    no bridge for is refused naming `setting` (`KEY=VALUE`, default `model.path=` the directory)."""
    lora.allow_import_without_te()  # Bridge's import reaches its LoRA layers, which import TE
    # Bridge's import helper logs a traceback at INFO for every optional TE symbol it cannot find,
    # and forces its own level and handler at import; disabling the logger is the only switch.
    logging.getLogger("megatron.bridge.utils.import_utils").disabled = True
    family = FAMILY_BRIDGES.get(architecture(read_hf_config(Path(hf_path), "model.path")))
    if family is None:  # every bridge, as `import megatron.bridge` gives (and a lazy package of an earlier call runs)
        for name in EAGER_BRIDGE_PACKAGES:
            getattr(importlib.import_module(name), "AutoBridge")
    else:
        if not any(name in sys.modules for name in EAGER_BRIDGE_PACKAGES):
            for name in EAGER_BRIDGE_PACKAGES:
                lazy_package(name)
        importlib.import_module(family)  # its bridges register themselves (a later call may bring another family)
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    freeze_imported_objects()
    hf = read_hf_config(Path(hf_path), "model.path")
    if not AutoBridge.can_handle(str(hf_path)):  # Bridge's own test: a registered bridge for the architecture
        key, _, path = (setting or f"model.path={hf_path}").partition("=")
        raise UserError(
            f"`{key}={path}` is a {architecture(hf) or hf.get('model_type')} checkpoint, an architecture Megatron-Bridge "
            "0.6.2 has no bridge for, so its weights cannot be loaded into megatron-core (nor exported back). Point "
            f"`--{key}` at a Llama, Mistral, Qwen2, Qwen3 or Qwen3-MoE checkpoint (docs/models.md: Model families "
            "verified).")
    return AutoBridge.from_hf_pretrained(str(hf_path), torch_dtype=torch.float32)


def lazy_package(name: str) -> None:
    """Put package `name` into `sys.modules` without running its `__init__`: its submodules import as usual, and the
    first use of a name the `__init__` defines runs it then (PEP 562's module `__getattr__`). Megatron-Bridge's
    `__init__` imports all of its model bridges, about a third of its import time, where a run needs one family's."""
    spec = importlib.util.find_spec(name)
    package = importlib.util.module_from_spec(spec)
    initialised = False

    def __getattr__(attribute: str):
        nonlocal initialised
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        if importlib.util.find_spec(f"{name}.{attribute}") is not None:  # a submodule: import it alone
            return importlib.import_module(f"{name}.{attribute}")
        if initialised:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}")
        initialised = True
        spec.loader.exec_module(package)  # the whole package, as a plain import would have done
        return getattr(package, attribute)

    package.__getattr__ = __getattr__
    sys.modules[name] = package


def freeze_imported_objects() -> None:
    """Move the objects made so far (about a million, nearly all from importing torch, megatron-core, Megatron-Bridge and
    transformers, alive for the process's life) out of the garbage collector's sight, once per process. Each full
    collection during training scanned them all: a short GRPO run took 3.3 s against 4.3 s without this (median of 3,
    alternating in one process). Objects made later are collected as usual, and frozen ones (the data a loop loaded before
    this import among them) are still freed by reference counting when their last reference goes: only a reference
    cycle among them would outlive its use."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


def layer_spec_name(attention: str = "auto") -> str:
    """The layer implementation `attention` names; `auto` is Transformer Engine when installed, else SDPA."""
    if attention == "auto":
        return "transformer_engine" if HAVE_TRANSFORMER_ENGINE else "sdpa"
    return attention


def _layer_spec(name: str):
    """The provider callable that builds the named layer spec.

    `sdpa` is megatron-core's local layers with `torch.nn.functional.scaled_dot_product_attention` as the
    core attention (fused kernels on GPUs); `local` keeps megatron-core's own core attention, which
    materialises the full score matrix (kept reachable for tests and the GPU benchmark).
    """
    from megatron.bridge.models import gpt_provider

    from model.attention import local_layer_spec, sdpa_layer_spec
    from model.moe_router import with_micro_batch_weighted_router
    from model.norm import torch_norm_block_spec

    # Without TE or apex, megatron-core's local norms refuse sequence parallelism; TorchNorm is the same norm without
    # that refusal (model/norm.py), so both non-TE specs run with and without it. Every spec's MoE layers route with
    # model/moe_router.py's router, whose load-balancing loss is weighted alike at every tensor-parallel size.
    specs = {"transformer_engine": with_micro_batch_weighted_router(gpt_provider.transformer_engine_layer_spec),
             "sdpa": functools.partial(torch_norm_block_spec, with_micro_batch_weighted_router(sdpa_layer_spec)),
             "local": functools.partial(torch_norm_block_spec, with_micro_batch_weighted_router(local_layer_spec))}
    return specs[name]


def configure_provider(bridge, *, dtype: str, tp: int, pp: int, vpp: int | None, seq_length: int,
                       attention: str = "auto", load_weights: bool = True, transformer_overrides: dict | None = None,
                       ep: int = 1, etp: int | None = None, moe_dispatcher: str = "alltoall",
                       moe_router: dict | None = None, setting: str | None = None):
    """A GPT model provider for this checkpoint with our parallelism, precision and layer spec set.

    `ep`/`etp` are the expert-parallel and expert tensor-parallel degrees (`etp=None`: megatron-core's default, `tp`);
    `moe_dispatcher` is megatron-core's token dispatcher for a Mixture-of-Experts model (a dense one ignores both).

    `moe_router` (`rules.moe_router_overrides`) sets a Mixture-of-Experts model's router; a dense model has none.
    `transformer_overrides` are set last, before megatron-core validates the whole (`finalize()`): `build_policy`
    passes `rules.transformer_overrides(config)` there (sequence parallelism, recomputation).
    `setting` (`KEY=VALUE`, default `model.path=` the checkpoint's directory) is what a refusal names.
    """
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    _refuse_family_specific_layer_spec(bridge, provider, setting)
    _refuse_norms_needing_transformer_engine(bridge, provider, setting)
    keep_checkpoint_aux_loss_coeff(bridge, provider)
    fill_yarn_defaults(provider)
    # Every router of a Mixture-of-Experts model gets megatron-core's RouterReplay (model/routing.py): with no action
    # set it routes as without, so it costs nothing until GRPO records or replays routes.
    provider.moe_enable_routing_replay = bool(getattr(provider, "num_moe_experts", None))
    spec_name = layer_spec_name(attention)
    provider.transformer_layer_spec = _layer_spec(spec_name)
    log.info("layer spec: %s", spec_name)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.virtual_pipeline_model_parallel_size = vpp
    provider.expert_model_parallel_size = ep
    provider.expert_tensor_parallel_size = etp
    if getattr(provider, "num_moe_experts", None):
        provider.moe_token_dispatcher_type = moe_dispatcher
    # Off unless the overrides switch it on (Bridge's providers may default it on; tp=1 refuses it).
    provider.sequence_parallel = False
    provider.seq_length = seq_length
    provider.params_dtype = rules.DTYPES[dtype]
    provider.pipeline_dtype = rules.DTYPES[dtype]
    provider.bf16 = dtype == "bf16"
    provider.fp16 = dtype == "fp16"
    # megatron-core's fused cross entropy (SFT's loss; Bridge's providers turn it on) casts the logits' gradient to
    # bf16 whatever their dtype (`fused_cross_entropy.calculate_gradients`): in an fp32 or fp16 model every gradient
    # of the loss lost its low bits. Fused only where the logits are bf16 anyway; elsewhere megatron-core's unfused
    # cross entropy, which keeps their dtype (and compiles nothing on a run's first step).
    provider.cross_entropy_loss_fusion = bool(getattr(provider, "cross_entropy_loss_fusion", False)) and dtype == "bf16"
    # Fused weight-gradient accumulation is a TE/apex CUDA kernel.
    provider.gradient_accumulation_fusion = HAVE_TRANSFORMER_ENGINE and torch.cuda.is_available()
    provider.use_cpu_initialization = not torch.cuda.is_available()
    # gloo: the pipeline schedule's stage-to-stage exchanges one by one, in megatron-core's paired order, not as one
    # batch. gloo matches a batch's sends and receives between two ranks in the order they are listed, so at PP=2
    # (the previous stage is also the next) the interleaved schedule's activation and gradient, exchanged together,
    # arrived swapped: PP=2 x VPP=2 trained on wrong values (step-1 loss 1.005 against 0.030 for the same batch at
    # VPP=1); unbatched, the losses are equal. NCCL's batches are grouped, and unaffected.
    provider.batch_p2p_comm = torch.cuda.is_available()
    # Local attention's fused softmax is a CUDA extension built with apex, not shipped with megatron-core;
    # without it the fused path fails at import, so use megatron's PyTorch softmax (the same computation).
    provider.masked_softmax_fusion = importlib.util.find_spec("scaled_masked_softmax_cuda") is not None
    router_settings = (moe_router or {}) if getattr(provider, "num_moe_experts", None) else {}
    for key, value in {**router_settings, **(transformer_overrides or {})}.items():
        setattr(provider, key, value)
    disable_fusions_needing_transformer_engine(provider)
    keep_routes_visible(provider)
    provider.finalize()
    return provider


# transformers' values for yarn settings a config.json may leave out (Qwen's published yarn snippet gives only `factor`
# and `original_max_position_embeddings`): Megatron-Bridge passes on only those written, and megatron-core has no
# default for the betas (its build fails) and does not round the correction range unless told to, as transformers does.
YARN_DEFAULTS = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": True}


def fill_yarn_defaults(provider) -> None:
    """A yarn-scaled model's settings its config.json left out, as transformers reads them (`YARN_DEFAULTS`), so that
    megatron-core rotates as transformers does (tests/test_checkpoint_shape.py compares the tables)."""
    if getattr(provider, "position_embedding_type", None) != "yarn":
        return
    for key, value in YARN_DEFAULTS.items():
        if getattr(provider, key, None) is None:
            setattr(provider, key, value)


def keep_checkpoint_aux_loss_coeff(bridge, provider) -> None:
    """A Mixture-of-Experts checkpoint's own load-balancing coefficient (config.json's `router_aux_loss_coef`), the
    default `model.moe_aux_loss_coeff` promises: Megatron-Bridge 0.6.2 reads it, then its Qwen3-MoE bridge sets 1e-3
    over it whatever the checkpoint says."""
    coefficient = getattr(bridge.hf_pretrained.config, "router_aux_loss_coef", None)
    if getattr(provider, "num_moe_experts", None) and coefficient is not None:
        provider.moe_aux_loss_coeff = coefficient


def keep_routes_visible(provider) -> None:
    """A router with RouterReplay chooses its experts through it; TE's fused top-k (`moe_router_fusion`) bypasses it,
    so GRPO would record no route (its first rollout failed) and replay none: with replay on, the fusion is off."""
    if getattr(provider, "moe_enable_routing_replay", False) and getattr(provider, "moe_router_fusion", False):
        provider.moe_router_fusion = False
        log.info("moe_router_fusion turned off: Transformer Engine's fused top-k bypasses RouterReplay, which records and "
                 "replays the rollouts' routes")


def _refuse_family_specific_layer_spec(bridge, provider, setting: str | None = None) -> None:
    """Refuse a family whose Bridge provider brings its own layer spec, which configure_provider would replace with ours,
    naming `setting` (`KEY=VALUE`; a reward model is read through a temporary causal view, whose path says nothing).

    Gemma 2 and 3 are such families (measured with Megatron-Bridge 0.6.2): their specs add post-attention and post-MLP
    norms inside Transformer Engine linear layers, soft-capping or per-layer sliding windows, and norms computing
    x * (1 + w), which megatron-core's non-TE norm refuses. Built from our spec they would be a different model.
    """
    from megatron.bridge.models import gpt_provider

    spec = provider.transformer_layer_spec
    if spec is gpt_provider.default_layer_spec:
        return
    key, _, path = (setting or f"model.path={bridge.hf_pretrained.model_name_or_path}").partition("=")
    named = (getattr(bridge.hf_pretrained.config, "architectures", None) or ["this"])[0]
    raise UserError(
        f"`{key}={path}` is a {named} checkpoint, a family Megatron-Bridge builds from its own layer "
        f"specification (`{getattr(spec, '__name__', type(spec).__name__)}`). This trainer builds every model from "
        "megatron-core's standard GPT layers (Transformer Engine's, or the local/SDPA ones without it), which lack that "
        "family's own layers (for Gemma 2 and 3: post-attention and post-MLP norms, logit soft-capping, per-layer sliding "
        "windows, norms scaled by 1 + weight), so it would train a different model and refuses the checkpoint. Point "
        f"`--{key}` at a Llama, Mistral, Qwen2, Qwen3 or Qwen3-MoE checkpoint (docs/models.md: Model families verified).")


def _refuse_norms_needing_transformer_engine(bridge, provider, setting: str | None = None) -> None:
    """Without Transformer Engine, refuse a family whose norms scale by 1 + weight (Gemma's), naming `setting` as
    `_refuse_family_specific_layer_spec` does: megatron-core's torch norms cannot (model/norm.py raised in the build)."""
    if HAVE_TRANSFORMER_ENGINE or not getattr(provider, "layernorm_zero_centered_gamma", False):
        return
    key, _, path = (setting or f"model.path={bridge.hf_pretrained.model_name_or_path}").partition("=")
    named = (getattr(bridge.hf_pretrained.config, "architectures", None) or ["this"])[0]
    raise UserError(
        f"`{key}={path}` is a {named} checkpoint, whose norms scale by 1 + weight (`layernorm_zero_centered_gamma`), "
        "which only Transformer Engine's norms compute; it is not installed, and megatron-core's torch norms refuse "
        f"the setting. Point `--{key}` at a Llama, Mistral, Qwen2, Qwen3 or Qwen3-MoE checkpoint (docs/models.md: "
        "Model families verified), or install Transformer Engine on a CUDA machine (README, GPUs).")


# Fusions a Bridge provider may switch on whose only implementation is Transformer Engine's. The rest
# (bias_activation_fusion, bias_dropout_fusion, native cross_entropy_loss_fusion) are megatron-core's own
# torch.compile'd PyTorch and run anywhere; masked_softmax_fusion and gradient_accumulation_fusion are set
# above from whether their CUDA extensions are installed.
TRANSFORMER_ENGINE_FUSIONS = {
    "apply_rope_fusion": "TE's fused rotary kernel; finalize() fails without it (set by the Llama provider)",
    "persist_layer_norm": "a fused CUDA LayerNorm kernel; megatron's non-TE norm refuses it (set by the Llama provider)",
    "moe_permute_fusion": "TE >= 2.1's token permutation; finalize() fails without it (Qwen3-MoE and most MoE providers)",
    "moe_router_fusion": "TE >= 2.7's top-k routing and aux-loss kernels",
}


def disable_fusions_needing_transformer_engine(provider) -> None:
    """Without Transformer Engine, switch off the fusions only TE implements (logged once); with TE, change nothing."""
    if HAVE_TRANSFORMER_ENGINE:
        return
    turned_off = [name for name in TRANSFORMER_ENGINE_FUSIONS if getattr(provider, name, False)]
    for name in turned_off:
        setattr(provider, name, False)
    # TE's parallel cross entropy (DeepSeek/Kimi providers pick it); megatron-core's native fused one is the same loss.
    uses_te_cross_entropy = getattr(provider, "cross_entropy_fusion_impl", "native") == "te"
    if getattr(provider, "cross_entropy_loss_fusion", False) and uses_te_cross_entropy:
        provider.cross_entropy_fusion_impl = "native"
        turned_off.append("cross_entropy_fusion_impl=te (now native)")
    if turned_off:
        log.info("Transformer Engine is not installed: turned off %s", ", ".join(turned_off))


# What Megatron-Bridge prints after every export that wrote every tensor: our own line says where the export went.
EXPORT_SUCCESS = "Success: All tensors from the original checkpoint were written."


def export_hf(bridge, chunks: list, out_dir: str | Path) -> None:
    """Write the model as a Hugging Face checkpoint (safetensors, config, tokenizer). Collective: every rank calls it.
    Bridge's printed lines pass through, but for its success line."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            bridge.save_hf_pretrained(chunks, str(out_dir), show_progress=False)
    finally:
        # Only the bare line: its other form says that tensors the model holds were left out of the export.
        kept = [line for line in printed.getvalue().splitlines() if line.strip() and line.strip() != EXPORT_SUCCESS]
        if kept:
            print("\n".join(kept), flush=True)


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def saved_dtype(out_dir: Path) -> str | None:
    """The floating-point dtype most of a Hugging Face checkpoint's tensors are saved in, from its first safetensors
    file's header (None when it has none)."""
    files = sorted(out_dir.glob("*.safetensors"))
    if not files:
        return None
    with files[0].open("rb") as stream:
        header = json.loads(stream.read(int.from_bytes(stream.read(8), "little")))
    counts = collections.Counter(SAFETENSORS_DTYPES[entry["dtype"]] for name, entry in header.items()
                                 if name != "__metadata__" and entry["dtype"] in SAFETENSORS_DTYPES)
    return counts.most_common(1)[0][0] if counts else None


def declare_saved_dtype(out_dir: str | Path) -> None:
    """Make the export's config.json name the dtype its tensors are saved in: Bridge keeps the source's, so a bf16
    run's export said float32, and `dtype="auto"` loaders took twice the memory."""
    config_path, dtype = Path(out_dir) / "config.json", saved_dtype(Path(out_dir))
    config = json.loads(config_path.read_text())
    if dtype is not None and config.get("dtype", config.get("torch_dtype")) != dtype:
        config.update({key: dtype for key in ("dtype", "torch_dtype") if key in config or key == "dtype"})
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def keep_source_tokenizer_settings(out_dir: str | Path, source_dir: str | Path, padding: bool = True) -> None:
    """The export's tokenizer_config.json as its source had it in two settings:
    - no padding token where the source had none: `build.load_tokenizer` pads with the end token for the run, and
      saved, a collator that masks labels equal to `pad_token_id` would mask every end of turn. A source may name its
      padding token in special_tokens_map.json alone (as older transformers saved tokenizers), which transformers
      reads too: that one is kept;
    - the source's `tokenizer_class` where transformers 5 writes its own `TokenizersBackend` (for Llama 3's
      `PreTrainedTokenizerFast`, say): transformers 4, which inference servers may pin, cannot load that name, and
      transformers 5 reads the source's name as the same tokenizer.
    `padding=False` keeps the export's padding token (a reward model's: transformers scores each row at its last
    token that is not `pad_token_id`)."""
    source, saved = Path(source_dir) / "tokenizer_config.json", Path(out_dir) / "tokenizer_config.json"
    if not (source.is_file() and saved.is_file()):
        return
    named = [Path(source_dir) / name for name in ("tokenizer_config.json", "special_tokens_map.json")]
    pads = any(path.is_file() and json.loads(path.read_text()).get("pad_token") is not None for path in named)
    settings = json.loads(saved.read_text())
    changed = padding and not pads and settings.pop("pad_token", None) is not None
    source_class = json.loads(source.read_text()).get("tokenizer_class")
    if settings.get("tokenizer_class") == "TokenizersBackend" and isinstance(source_class, str) and source_class:
        settings["tokenizer_class"], changed = source_class, True
    if changed:
        saved.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def declare_end_ids(out_dir: str | Path, end_ids: tuple[int, ...]) -> None:
    """Make the export's generation_config.json list every id that ends a completion here (`generate.end_token_ids`):
    a base model trained on a ChatML template ends its turns with <|im_end|>, which its own generation_config does not
    name, so transformers' `generate` would run past it."""
    path = Path(out_dir) / "generation_config.json"
    declared = json.loads(path.read_text()) if path.is_file() else {}
    listed = declared.get("eos_token_id")
    listed = listed if isinstance(listed, list) else [] if listed is None else [listed]
    if all(end in listed for end in end_ids):
        return
    declared["eos_token_id"] = list(dict.fromkeys([*listed, *end_ids]))
    path.write_text(json.dumps(declared, indent=2) + "\n")
