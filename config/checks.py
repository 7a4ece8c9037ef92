"""The configuration's cross-key rules that need no model (`config.loops.TrainerConfig.validate` runs them): the
parallel layout and the model settings (`ModelChecks`), the optimizer, schedule, batch, LoRA and loggers
(`TrainingChecks`). Each raises a `UserError` naming the key to change."""

import dataclasses
import logging
import math
import os
from pathlib import Path

from config import sections
from config.checkpoint_shape import check_rope_scaling, check_shape_settings
from config.errors import UserError
from config.hf import architecture, hf_expert_count, is_classifier, read_hf_config
from config.sections import (
    ATTENTION_NAMES, DTYPE_NAMES, EMBEDDED_MODELS, HF_EXPERT_KEYS, LORA_TARGET_MODULES, MOE_AUX_LOSS_TYPES,
    MOE_DISPATCHERS, MOE_ROUTER_DTYPES, MOE_ROUTER_KEYS, PEFT_METHODS, PreferenceDataConfig, RECOMPUTE_METHODS,
    RECOMPUTE_MODULES, RECOMPUTE_NAMES
)

log = logging.getLogger(__name__)


def require(holds: bool, message: str) -> None:
    """Raise `message` as a UserError unless `holds`."""
    if not holds:
        raise UserError(message)


# OptimizerConfig fields whose values torch's optimizers check only when they are built, after the model (a
# ValueError then); `lr` and `min_lr` default to None, so no kind is read from their default. field: (holds, rule).
OPTIMIZER_VALUES = {
    "lr": (lambda value: value >= 0, "a number, 0 or more"), "min_lr": (lambda value: value >= 0, "a number, 0 or more"),
    "weight_decay": (lambda value: value >= 0, "a number, 0 or more"),
    "adam_beta1": (lambda value: 0 <= value < 1, "a number in [0, 1)"),
    "adam_beta2": (lambda value: 0 <= value < 1, "a number in [0, 1)"),
    "adam_eps": (lambda value: value > 0, "a positive number"), "sgd_momentum": (lambda value: value >= 0, "a number, 0 or more"),
    "clip_grad": (lambda value: value >= 0, "a number, 0 (off) or more"),
}


def check_override_keys(overrides: dict, config_class, key: str) -> None:
    """Reject override keys the megatron-core class does not have, and values of another kind than its default's (a
    number for a number, true/false for a flag, text for text), naming our config key; an optimizer it cannot build."""
    fields = {item.name: item for item in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - set(fields))
    require(not unknown, f"`{key}` sets {', '.join(f'`{name}`' for name in unknown)}, which megatron-core's "
             f"{config_class.__name__} does not have. Remove or rename them in `{key}`.")
    kinds = ((bool, "true or false", (bool,)), ((int, float), "a number", (int, float)), (str, "text", (str,)))
    for name, value in overrides.items():
        default = fields[name].default
        for default_types, kind, accepted in kinds:
            if isinstance(default, default_types) and default is not None:
                require(isinstance(value, accepted) and (bool in accepted or not isinstance(value, bool)),
                        f"`{key}` sets `{name}` to {value!r}, and megatron-core's {config_class.__name__}.{name} takes "
                        f"{kind} (its default: {default!r}). Change it in `{key}`.")
                break
    for name, (holds, rule) in (OPTIMIZER_VALUES if config_class.__name__ == "OptimizerConfig" else {}).items():
        value = overrides.get(name)
        require(name not in overrides or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and holds(value)),
                f"`{key}` sets `{name}` to {value!r}, and megatron-core's OptimizerConfig.{name} must be {rule}. "
                f"Change it in `{key}`.")
    if config_class.__name__ == "OptimizerConfig" and overrides.get("optimizer", "adam") not in ("adam", "sgd"):
        from megatron.core import optimizer as megatron_optimizer

        # The others (lion, muon, ...) are built from the emerging_optimizers package, which megatron-core checks.
        require(getattr(megatron_optimizer, "HAVE_EMERGING_OPTIMIZERS", False),
                f"`{key}` sets `optimizer` to {overrides['optimizer']!r}; without the emerging_optimizers package "
                f"megatron-core builds adam and sgd only. Install it, or change `optimizer` in `{key}`.")


def value_of(config, dotted: str):
    """The value of a dotted key."""
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


class ModelChecks:
    """The parallel layout against the model and the machine, the model's settings, MoE routers, recomputation."""

    STARTS_FROM_A_CLASSIFIER = False  # `trainer.rm` takes a reward model's checkpoint as its start; the others do not

    def check_layout_divides(self, hf: dict, name: str = "model", key: str = "model.path") -> int:
        """TP divides the heads and the vocabulary of a checkpoint (its config.json `hf`; `name` says which, `key` where
        it is set), PP x VPP its layers, and its rope settings are ones megatron-core reproduces; the layers each model
        chunk holds."""
        parallel = self.parallel
        check_shape_settings(hf, name)
        check_rope_scaling(hf, name, key)
        heads = hf.get("num_attention_heads", 1)
        kv_heads = hf.get("num_key_value_heads") or heads
        require(heads % parallel.tp == 0 and kv_heads % parallel.tp == 0,
                 f"`parallel.tp={parallel.tp}` must divide the {name}'s {heads} attention heads and {kv_heads} key/value "
                 "heads. Change `--parallel.tp`.")
        # Megatron-Bridge's providers leave `should_pad_vocab` off, so megatron-core splits config.json's vocab_size as
        # it is over the tensor-parallel ranks (VocabParallelEmbedding and the output layer assert it divides).
        vocab = hf.get("vocab_size")
        require(not vocab or vocab % parallel.tp == 0,
                 f"`parallel.tp={parallel.tp}` must divide the {name}'s vocabulary, {vocab} tokens (config.json's "
                 "vocab_size): each tensor-parallel rank holds an equal slice of the embedding and the output layer, "
                 "and the vocabulary is not padded. Change `--parallel.tp` to a divisor of "
                 f"{vocab}, or point `--{key}` at a checkpoint whose embedding is resized to a multiple of it "
                 f"(`model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of={parallel.tp})`, then `save_pretrained`).")
        layers = hf.get("num_hidden_layers", 1)
        require(layers % (parallel.pp * parallel.vpp) == 0,
                 f"`parallel.pp={parallel.pp}` x `parallel.vpp={parallel.vpp}` must divide the {name}'s {layers} layers.")
        return layers // (parallel.pp * parallel.vpp)

    def validate_model_shape(self, model_path: Path) -> None:
        """The parallel layout against the checkpoint's shape (heads and layers), before the model is built, and a
        language model where the loop generates or learns text (`STARTS_FROM_A_CLASSIFIER`)."""
        hf = read_hf_config(model_path, "model.path")
        read_hf_config(model_path, "model.path", "generation_config.json")  # its end ids are read later
        require(self.STARTS_FROM_A_CLASSIFIER or not is_classifier(hf),
                 f"`model.path={model_path}` is a reward model ({architecture(hf)}: a score head, no "
                 "language-model head), which neither generates nor learns text. Point `--model.path` at a causal "
                 "language model; a reward model scores GRPO's rollouts through `--grpo.reward_model`, and "
                 "`trainer.rm` trains one on.")
        parallel = self.parallel
        per_chunk = self.check_layout_divides(hf)
        layers = hf.get("num_hidden_layers", 1)
        model = self.model
        require(model.recompute != "full" or model.recompute_num_layers <= per_chunk,
                 f"`model.recompute_num_layers={model.recompute_num_layers}` exceeds the {per_chunk} layers each model chunk "
                 f"holds ({layers} layers over `parallel.pp={parallel.pp}` x `parallel.vpp={parallel.vpp}`); with "
                 f"`model.recompute_method={model.recompute_method}` that recomputes no more than {per_chunk}. "
                 f"Set `--model.recompute_num_layers` between 1 and {per_chunk}.")
        self._validate_experts(hf)
        expert_modules = [name for name in ("moe", "shared_experts") if name in model.recompute_modules]
        require(model.recompute != "selective" or hf_expert_count(hf) or not expert_modules,
                 f"`model.recompute_modules` names {', '.join(f'`{name}`' for name in expert_modules)}, the layers of a "
                 f"Mixture-of-Experts model, and `model.path={model.path}` is a dense model (its config.json names no "
                 f"experts: none of {', '.join(HF_EXPERT_KEYS)}), so nothing would be recomputed for them and no memory "
                 "saved. Name its dense layers instead (`[core_attn,mlp]`), or point `--model.path` at an MoE checkpoint.")
        router_keys = self._moe_router_keys_set()
        require(hf_expert_count(hf) or not router_keys,
                 f"{', '.join(f'`{key}`' for key in router_keys)} {'sets' if len(router_keys) == 1 else 'set'} the router "
                 f"of a Mixture-of-Experts model, and `model.path={self.model.path}` is a dense model (its config.json "
                 f"names no experts: none of {', '.join(HF_EXPERT_KEYS)}), which has no router, so "
                 f"{'it' if len(router_keys) == 1 else 'they'} would do nothing. Remove "
                 f"{'it' if len(router_keys) == 1 else 'them'}, or point `--model.path` at an MoE checkpoint (`tiny-moe` "
                 "is the embedded one).")

    def _validate_experts(self, hf: dict) -> None:
        """`parallel.ep`/`parallel.etp` against the checkpoint's experts per layer and expert width."""
        parallel, experts = self.parallel, hf_expert_count(hf)
        if not experts:
            require(parallel.ep == 1 and parallel.etp in (0, parallel.tp),
                     f"`parallel.ep={parallel.ep}` and `parallel.etp={parallel.etp}` split the experts of a "
                     f"Mixture-of-Experts model, and `model.path={self.model.path}` is a dense model (its config.json "
                     f"names no experts: none of {', '.join(HF_EXPERT_KEYS)}), so there is nothing to split. Use "
                     "`--parallel.ep=1 --parallel.etp=0` (data parallelism takes those ranks), or point `--model.path` "
                     "at an MoE checkpoint (`tiny-moe` is the embedded one).")
            return
        require(experts % parallel.ep == 0,
                 f"`parallel.ep={parallel.ep}` must divide the model's {experts} experts per layer (each expert-parallel "
                 f"rank holds experts / ep of them). Change `--parallel.ep` to a divisor of {experts}.")
        # Read in megatron-core 0.19.2's MoELayer.forward, which raises on a training forward in that case.
        require(parallel.tp == 1 or parallel.sequence_parallel,
                 f"`parallel.sequence_parallel=false` with `parallel.tp={parallel.tp}` on a Mixture-of-Experts model: "
                 "megatron-core 0.19.2 refuses to train an MoE layer with tensor parallelism but without sequence "
                 "parallelism (MoELayer.forward raises: each tensor-parallel rank would route the whole sequence). Use the default "
                 "`--parallel.sequence_parallel=true`, or `--parallel.tp=1`.")
        width = hf.get("moe_intermediate_size") or hf.get("intermediate_size")
        etp = parallel.expert_tensor_parallel_size
        require(not width or width % etp == 0,
                 f"`parallel.etp={parallel.etp}` ({etp} ranks per expert) must divide each expert's hidden width, {width} "
                 "(config.json's moe_intermediate_size, or intermediate_size). Change `--parallel.etp` (1 keeps every "
                 "expert whole).")
        # Megatron-Bridge 0.6.2's expert adapters build their layers with megatron-core's expert flag, which skips the
        # tensor-parallel reductions the dense adapters rely on: at ETP=2 each rank's partial LoRA-A product of fc2
        # goes into LoRA-B unsummed, and LoRA-A's gradients miss the other rank's share.
        require(not (self.peft.method == "lora" and etp > 1),
                 f"`peft.method=lora` on a Mixture-of-Experts model with each expert split over {etp} ranks "
                 f"(`parallel.etp={parallel.etp}`{f', which follows parallel.tp={parallel.tp}' if parallel.etp == 0 else ''}) "
                 "is not supported: Megatron-Bridge 0.6.2's expert adapters skip the tensor-parallel reductions, so it would train "
                 "another model than at TP=1 from the first step and export weights the trainer never had. Use "
                 "`--parallel.etp=1` (each expert whole on its rank; attention stays split over `parallel.tp`), or "
                 "full fine-tuning.")

    def _validate_model(self) -> None:
        model = self.model
        require(model.dtype in DTYPE_NAMES, f"`model.dtype={model.dtype}` is not one of {', '.join(DTYPE_NAMES)}. Change `--model.dtype`.")
        require(model.moe_dispatcher in MOE_DISPATCHERS, f"`model.moe_dispatcher={model.moe_dispatcher}` is not one of "
                 f"{', '.join(MOE_DISPATCHERS)}. Change `--model.moe_dispatcher`.")
        # megatron-core 0.19.2's MoEAllGatherTokenDispatcher all-gathers the expert group's tokens into one tensor.
        require(model.moe_dispatcher != "allgather" or self.parallel.ep == 1,
                 f"`model.moe_dispatcher=allgather` with `parallel.ep={self.parallel.ep}`: megatron-core's allgather "
                 "dispatcher gathers the tokens of every expert-parallel rank into one tensor and assumes each rank holds "
                 "as many, but every rank here pads and compacts its own batches (a rollout drops its finished rows, a "
                 "micro-batch is padded to its own longest row), so the gather would not match: a crash on gloo, "
                 "undefined on NCCL. Use the default `--model.moe_dispatcher=alltoall` (it sends each token only where "
                 "its experts are, whatever the ranks' counts), or `--parallel.ep=1`.")
        require(model.attention in ATTENTION_NAMES, f"`model.attention={model.attention}` is not one of "
                 f"{', '.join(ATTENTION_NAMES)}. Change `--model.attention`.")
        require(model.attention != "transformer_engine" or sections.have_transformer_engine(),
                 "`model.attention=transformer_engine` needs Transformer Engine, which is not installed. "
                 "Use `--model.attention=auto` (SDPA without it), or install it (README, GPUs).")
        self._validate_recompute()
        self._validate_moe_router()
        if self._model_path_exists_now():
            self.validate_model_shape(Path(model.path))

    def _validate_moe_router(self) -> None:
        """The `model.moe_*` router settings, before any model is built (whether the model has experts: validate_model_shape)."""
        model = self.model
        for key, allowed in (("moe_aux_loss_type", MOE_AUX_LOSS_TYPES), ("moe_router_dtype", MOE_ROUTER_DTYPES)):
            require(getattr(model, key) in allowed, f"`model.{key}={getattr(model, key)}` is not one of "
                     f"{', '.join(allowed)}. Change `--model.{key}`.")
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(model, key)
            require(value is None or value >= 0, f"`model.{key}` must be 0 (off) or more, got {value}: it weighs a loss "
                     f"added to the training loss. Change `--model.{key}`, or leave it unset for the checkpoint's value.")
        coeff, loss_type = model.moe_aux_loss_coeff, model.moe_aux_loss_type
        require(not (loss_type == "none" and coeff), f"`model.moe_aux_loss_coeff={coeff}` weighs a load-balancing loss, "
                 "but `model.moe_aux_loss_type=none` computes none, so the coefficient would do nothing. Set "
                 "`--model.moe_aux_loss_coeff=0` (or leave it unset), or choose a loss with `--model.moe_aux_loss_type` "
                 "(aux_loss, seq_aux_loss, global_aux_loss).")
        require(not (loss_type not in ("default", "none") and coeff == 0),
                 f"`model.moe_aux_loss_type={loss_type}` chooses a load-balancing loss, but `model.moe_aux_loss_coeff=0` "
                 "switches it off (GRPO's default), so the type would do nothing. Set `--model.moe_aux_loss_coeff` "
                 "above 0 (1e-3 is Qwen3-MoE's), or remove `--model.moe_aux_loss_type`.")

    def _moe_router_keys_set(self) -> list[str]:
        """The `model.moe_*` router settings this run changes from its loop's defaults, as `key=value`."""
        defaults = type(self)().model
        values = {key: getattr(self.model, key) for key in MOE_ROUTER_KEYS if getattr(self.model, key) != getattr(defaults, key)}
        return [f"model.{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in values.items()]

    def _validate_recompute(self) -> None:
        model = self.model
        require(model.recompute in RECOMPUTE_NAMES, f"`model.recompute={model.recompute}` is not one of "
                 f"{', '.join(RECOMPUTE_NAMES)}. Change `--model.recompute`.")
        if model.recompute == "full":
            require(model.recompute_method in RECOMPUTE_METHODS, f"`model.recompute_method={model.recompute_method}` is "
                     f"not one of {', '.join(RECOMPUTE_METHODS)}. Change `--model.recompute_method`.")
            require(model.recompute_num_layers >= 1, f"`model.recompute_num_layers` must be at least 1 with "
                     f"`model.recompute=full`, got {model.recompute_num_layers}. Change `--model.recompute_num_layers`.")
        if model.recompute != "selective":
            return
        modules = model.recompute_modules
        unknown = [name for name in modules if name not in RECOMPUTE_MODULES]
        require(modules and not unknown,
                 f"`model.recompute_modules={modules}` must name one or more of {', '.join(RECOMPUTE_MODULES)} with "
                 "`model.recompute=selective`. Change `--model.recompute_modules` (e.g. `[core_attn]`), or use "
                 "`--model.recompute=full`.")
        if "layernorm" in modules:
            self._validate_layernorm_recompute()

    def _validate_layernorm_recompute(self) -> None:
        """`layernorm` recomputation needs Transformer Engine, and a layer spec that keeps the norms separate."""
        attention = self.model.attention
        # megatron-core 0.19.2's output-discarding checkpoint (CheckpointWithoutOutput, which recomputes the norms)
        # sets `fp8 = fp8 is not None`, always true, and then reads TE's FP8 state: without TE it fails (measured).
        require(sections.have_transformer_engine(),
                 "`model.recompute_modules` names `layernorm`, which megatron-core 0.19.2 recomputes with a checkpoint "
                 "that reads Transformer Engine's FP8 state even without FP8, and Transformer Engine is not installed. "
                 "Remove `layernorm` from `--model.recompute_modules` (e.g. `[core_attn,mlp]`).")
        # Transformer Engine's layer spec fuses each norm into the linear layer after it (no separate norm module).
        require(attention not in ("transformer_engine", "auto"),
                 f"`model.recompute_modules` names `layernorm`, but the Transformer Engine layer spec (`model.attention="
                 f"{attention}`) fuses each norm into the linear layer after it, so megatron-core has no separate norm to "
                 "recompute. Remove `layernorm` from `--model.recompute_modules`, or use `--model.attention=sdpa`.")

    def _model_path_exists_now(self) -> bool:
        """Whether `model.path` must already be an HF directory at start-up (the embedded models are built on first use)."""
        return self.model.path not in EMBEDDED_MODELS

    def _validate_parallel_sizes(self) -> None:
        """The parallel degrees every other layout rule divides by, and the collective timeout, in range."""
        parallel = self.parallel
        for key in ("tp", "pp", "vpp", "timeout_minutes"):
            require(getattr(parallel, key) >= 1, f"`parallel.{key}` must be at least 1, got {getattr(parallel, key)}. "
                     f"Change `--parallel.{key}`.")
        # torch's rendezvous store counts its timeout in int64 nanoseconds: from about 1.5e8 minutes it wraps, and the
        # first connection "timed out" at once (measured at 1e10: DistNetworkError, after the data was tokenized).
        require(parallel.timeout_minutes <= 10**7,
                 f"`parallel.timeout_minutes` must be at most 10000000 (about 19 years; torch's process-group clock "
                 f"overflows beyond about 1.5e8), got {parallel.timeout_minutes}. Change `--parallel.timeout_minutes`.")

    def _validate_parallel(self, world_size: int) -> None:
        parallel = self.parallel
        self._validate_parallel_sizes()
        require(world_size % (parallel.tp * parallel.pp) == 0,
                 f"`parallel.tp={parallel.tp}` x `parallel.pp={parallel.pp}` must divide the number of processes "
                 f"({world_size}). Change `--parallel.tp`/`--parallel.pp` or `--nproc-per-node`.")
        require(parallel.vpp == 1 or parallel.pp > 1, "`parallel.vpp` > 1 needs pipeline parallelism (`parallel.pp` > 1).")
        self._validate_expert_layout(world_size)
        require(self.data.max_seq_len % parallel.sequence_multiple == 0,
                 f"`data.max_seq_len={self.data.max_seq_len}` must be a multiple of `parallel.tp={parallel.tp}`: sequence "
                 "parallelism splits every sequence over the tensor-parallel ranks. Change `--data.max_seq_len`, or set "
                 "`--parallel.sequence_parallel=false`.")
        # Measured with megatron-fsdp 0.6.1: the model build fails in its device-mesh set-up (an einops error).
        require(not (parallel.use_megatron_fsdp and parallel.pp > 1),
                 "`parallel.use_megatron_fsdp=true` does not work with pipeline parallelism in this stack "
                 f"(`parallel.pp={parallel.pp}`). Use `--parallel.use_megatron_fsdp=false` (DDP with the distributed "
                 "optimizer, which also shards optimizer state) or `--parallel.pp=1`.")

    def _validate_expert_layout(self, world_size: int) -> None:
        """`parallel.ep` and `parallel.etp` against the number of processes (the model's experts: validate_model_shape)."""
        parallel = self.parallel
        require(parallel.ep >= 1, f"`parallel.ep` must be at least 1 (1: no expert parallelism), got {parallel.ep}.")
        require(parallel.etp >= 0, f"`parallel.etp` must be 0 (megatron-core's default: `parallel.tp`) or at least 1, "
                 f"got {parallel.etp}.")
        etp = parallel.expert_tensor_parallel_size
        etp_named = f"`parallel.etp={parallel.etp}`" + (f" (parallel.tp={parallel.tp})" if parallel.etp == 0 else "")
        require(world_size % (etp * parallel.ep * parallel.pp) == 0,
                 f"{etp_named} x `parallel.ep={parallel.ep}` x `parallel.pp={parallel.pp}` = {etp * parallel.ep * parallel.pp} "
                 f"must divide the number of processes ({world_size}): megatron-core lays the experts out on a grid of "
                 "their own, each expert's weights split over etp ranks, the experts over ep ranks and the layers over pp "
                 "stages, with whole copies of that on the remaining ranks (the expert-data-parallel group). Change "
                 "`--parallel.ep`, `--parallel.etp` (1 keeps every expert whole on its rank) or `--nproc-per-node`.")
        require(not (self.peft.method == "lora" and parallel.ep > 1),
                 f"`peft.method=lora` with expert parallelism (`parallel.ep={parallel.ep}`) is not supported: measured with "
                 "Megatron-Bridge 0.6.2 on tiny-moe, LoRA at EP=2 trains another model than at EP=1 from the first step "
                 "(gradient norm 3.433 against 3.384; full fine-tuning agrees to 1e-7), and its PEFT export writes the "
                 "expert adapters of the first expert-parallel rank only (40 of 72 tensors). Use `--parallel.ep=1` with "
                 "LoRA (LoRA on a Mixture-of-Experts model trains at EP=1), or full fine-tuning with expert parallelism.")


class TrainingChecks:
    """The optimizer and precision, the schedule's counts, the batch sizes, LoRA and the loggers."""

    def _validate_optimizer(self) -> None:
        optim = self.optim
        require(isinstance(optim.betas, list) and len(optim.betas) == 2 and all(0 <= beta < 1 for beta in optim.betas),
                 f"`optim.betas` must be two numbers in [0, 1), [beta1, beta2], got {optim.betas}. Change `--optim.betas` "
                 "(e.g. `--optim.betas=[0.9,0.95]`).")
        for key, holds, rule in (("lr", optim.lr >= 0, "0 or more"), ("min_lr", optim.min_lr is None or optim.min_lr >= 0, "0 or more"),
                                 ("min_lr_ratio", 0 <= optim.min_lr_ratio <= 1, "between 0 and 1"),
                                 ("eps", optim.eps > 0, "positive"), ("weight_decay", optim.weight_decay >= 0, "0 or more"),
                                 ("clip_grad", optim.clip_grad >= 0, "0 (off) or more"),
                                 ("warmup_steps", optim.warmup_steps >= 0, "0 or more")):
            require(holds, f"`optim.{key}` must be {rule}, got {getattr(optim, key)}. Change `--optim.{key}`.")
        # AdamW's decoupled decay multiplies every weight by 1 - lr x weight_decay at each step: from 1 on, the weights
        # are zeroed or change sign every step.
        require(optim.lr * optim.weight_decay < 1,
                 f"`optim.weight_decay={optim.weight_decay}` x `optim.lr={optim.lr}` is {optim.lr * optim.weight_decay:g}: "
                 "the decoupled weight decay multiplies every weight by 1 - lr x weight_decay each step, which would "
                 "zero the weights or flip their sign. Lower `--optim.weight_decay` (0.01 and 0.1 are usual).")
        require(optim.final_lr <= optim.lr,
                 f"`optim.min_lr={optim.min_lr}` is above `optim.lr={optim.lr}`: the learning rate decays from optim.lr down "
                 "to optim.min_lr. Lower `--optim.min_lr`, or leave it unset (it then follows optim.lr: optim.lr x "
                 f"`optim.min_lr_ratio={optim.min_lr_ratio}`).")
        for key in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            require(getattr(optim, key) in DTYPE_NAMES,
                     f"`optim.{key}={getattr(optim, key)}` is not one of {', '.join(DTYPE_NAMES)}. Change `--optim.{key}`.")
        # megatron-core is imported only when there are override keys to check: importing it takes several seconds,
        # which would otherwise delay every later start-up error (in the data, say) by as much.
        if optim.override_optimizer_config:
            from megatron.core.optimizer import OptimizerConfig

            check_override_keys(optim.override_optimizer_config, OptimizerConfig, "optim.override_optimizer_config")
        if self.ddp.override_ddp_config:
            from megatron.core.distributed import DistributedDataParallelConfig

            check_override_keys(self.ddp.override_ddp_config, DistributedDataParallelConfig, "ddp.override_ddp_config")
        if optim.use_precision_aware_optimizer and self.model.dtype == "fp32":
            log.warning("`optim.use_precision_aware_optimizer=true` has no effect with `model.dtype=fp32`: fp32 training "
                        "keeps fp32 weights, gradients and Adam state already (set `--model.dtype=bf16` to use it).")
        if not self.precision_aware:
            return
        why = "`model.dtype=fp16`" if self.model.dtype == "fp16" else "`optim.use_precision_aware_optimizer=true`"
        optimizer = optim.override_optimizer_config.get("optimizer", "adam")
        require(optimizer == "adam", f"{why} needs the adam optimizer, but `optim.override_optimizer_config.optimizer={optimizer}`.")
        require(self.parallel.use_distributed_optimizer or self.parallel.use_megatron_fsdp,
                 f"{why} needs the distributed optimizer: set `--parallel.use_distributed_optimizer=true`.")
        require(sections.have_transformer_engine(),
                 f"{why} uses Transformer Engine's FusedAdam, and Transformer Engine is not installed. Install it "
                 "(`uv sync --extra te` on a CUDA machine, or use NVIDIA's NGC PyTorch container), or use "
                 "`--model.dtype=bf16 --optim.use_precision_aware_optimizer=false`.")

    def _validate_schedule(self) -> None:
        train, ckpt = self.train, self.ckpt
        checks = (("train.steps", train.steps >= 1, "at least 1"), ("train.micro_batch_size", train.micro_batch_size >= 1, "at least 1"),
                  ("train.global_batch_size", train.global_batch_size >= 1, "at least 1"),
                  ("train.exit_interval", train.exit_interval >= 0, "0 (off) or more"),
                  ("train.eval_interval", train.eval_interval >= 0, "0 (only at the end) or more"),
                  ("train.eval_samples", train.eval_samples >= 0, "0 (no evaluation) or more"),
                  ("train.log_interval", train.log_interval >= 1, "at least 1"),
                  ("ckpt.save_interval", ckpt.save_interval >= 0, "0 (only at the end) or more"),
                  ("ckpt.keep_last", ckpt.keep_last >= 1, "at least 1"),
                  ("data.max_seq_len", self.data.max_seq_len >= 2, "at least 2 (one input and one label token)"),
                  ("train.seed", 0 <= train.seed < 2**32, "from 0 to 2**32 - 1 (the random generators' range)"),
                  ("train.micro_batch_tokens", train.micro_batch_tokens == 0 or train.micro_batch_tokens >= self.data.max_seq_len,
                   f"0 (off) or at least `data.max_seq_len={self.data.max_seq_len}` (a micro-batch holds one row at least)"))
        for key, holds, rule in checks:
            require(holds, f"`{key}` must be {rule}, got {value_of(self, key)}. Change `--{key}`.")
        data = self.data
        require(data.messages_field or isinstance(data, PreferenceDataConfig) or data.prompt_field != data.response_field,
                 f"`data.prompt_field` and `data.response_field` are both `{data.prompt_field}`: every prompt would "
                 "hold its own answer. Set them to the prompt's and the response's columns (or `--data.messages_field` "
                 "for chat messages).")
        # An empty path is the current directory to the loaders: its JSON files (a tokenizer's, say) read as rows.
        require(self.data.path.strip(),
                f"`data.path` is empty{f' ({self.data.path!r})' if self.data.path else ''}: the data would be read "
                "from the current directory. Set `--data.path` to a json/jsonl/parquet file or a folder of them, a hub "
                "dataset name, or a bundled set (`arithmetic`).")
        require(self.data.eval_path or self.data.train_split != self.data.eval_split,
                 f"`data.train_split` and `data.eval_split` are both `{self.data.eval_split}`: the held-out figures "
                 "would be measured on the training rows. Set `--data.eval_split` to another split, or point "
                 "`--data.eval_path` at held-out data.")
        eval_file = Path(self.data.eval_path).expanduser() if self.data.eval_path else None
        require(not (eval_file and eval_file.is_file() and eval_file.resolve() == Path(self.data.path).expanduser().resolve()),
                 f"`data.eval_path={self.data.eval_path}` is the file `data.path` trains on: the held-out figures would "
                 "be measured on the training rows. Point `--data.eval_path` at held-out rows, or leave it unset (a "
                 "folder's `data.eval_split` files, or a hub set's split).")

    def _validate_peft(self) -> None:
        peft, parallel = self.peft, self.parallel
        require(peft.method in PEFT_METHODS, f"`peft.method={peft.method}` is not one of {', '.join(PEFT_METHODS)}. "
                 "Change `--peft.method`.")
        if peft.method != "lora":
            defaults = type(self)().peft
            changed = [f"`peft.{key}`" for key in ("rank", "alpha", "dropout", "target_modules")
                       if getattr(peft, key) != getattr(defaults, key)]
            require(not changed,
                     f"{', '.join(changed)} {'sets' if len(changed) == 1 else 'set'} LoRA's adapters, and "
                     f"`peft.method={peft.method}` trains every weight without adapters, so "
                     f"{'it' if len(changed) == 1 else 'they'} would do nothing. Set `--peft.method=lora`, or remove "
                     f"{'it' if len(changed) == 1 else 'them'}.")
            return
        unknown = [name for name in peft.target_modules if name not in LORA_TARGET_MODULES]
        require(peft.target_modules and not unknown,
                 f"`peft.target_modules={peft.target_modules}` must name one or more of {', '.join(LORA_TARGET_MODULES)} "
                 f"(megatron-core's names of the attention and MLP linear layers){f'; unknown: {unknown}' if unknown else ''}. "
                 "Change `--peft.target_modules` (e.g. `[linear_qkv,linear_proj]`).")
        for key, holds, rule in (("rank", peft.rank >= 1, "at least 1"), ("alpha", peft.alpha > 0, "positive"),
                                 ("dropout", 0 <= peft.dropout < 1, "in [0, 1)")):
            require(holds, f"`peft.{key}` must be {rule} with `peft.method=lora`, got {getattr(peft, key)}. "
                     f"Change `--peft.{key}`.")
        # Not verified with adapters in this stack: refused rather than run untested.
        require(not parallel.use_megatron_fsdp,
                 "`peft.method=lora` with `parallel.use_megatron_fsdp=true` is not supported: LoRA freezes the base "
                 "weights, and Megatron-FSDP's sharded checkpoints and parameter gathers have not been verified with "
                 "adapters here. Use `--parallel.use_megatron_fsdp=false` (the distributed optimizer shards the "
                 "adapters' optimizer state, and the frozen base needs none).")

    def _validate_log(self) -> None:
        require(not self.log.wandb or sections.have_wandb(),
                 "`log.wandb=true` needs Weights & Biases, which is not installed in this environment. Install the "
                 "project's `wandb` extra (`.venv/bin/uv sync --extra wandb`; `scripts/setup.sh` installs it with the "
                 "test dependencies), or use `--log.wandb=false` (`--log.tensorboard=true` needs nothing extra).")
        project = self.log.wandb_project or os.environ.get("WANDB_PROJECT", "")
        if self.log.wandb and project:
            import wandb

            # W&B checks the name only in `wandb.init`, which the loops call once the model is built.
            where = "`log.wandb_project`" if self.log.wandb_project else "$WANDB_PROJECT (`log.wandb_project` unset)"
            try:
                wandb.Settings(project=project)
            except (wandb.errors.UsageError, ValueError) as error:
                raise UserError(f"{where} is not a project name W&B takes: {error}. Change `--log.wandb_project` (it "
                                "wins over $WANDB_PROJECT).") from None

    def _validate_batch(self, world_size: int) -> None:
        train = self.train
        data_parallel = self.parallel.data_parallel_size(world_size)
        self._validate_token_budget()
        if train.micro_batch_tokens:
            require(train.global_batch_size % data_parallel == 0,
                     f"`train.global_batch_size={train.global_batch_size}` must be a multiple of the data-parallel size "
                     f"{data_parallel}.")
            return
        require(train.global_batch_size % (train.micro_batch_size * data_parallel) == 0,
                 f"`train.global_batch_size={train.global_batch_size}` must be a multiple of `train.micro_batch_size="
                 f"{train.micro_batch_size}` x data-parallel size {data_parallel}.")

    def _validate_token_budget(self) -> None:
        if not self.train.micro_batch_tokens:
            return
        require(self.parallel.pp == 1,
                 f"`train.micro_batch_tokens={self.train.micro_batch_tokens}` groups rows by length into micro-batches "
                 f"of varying row counts, and pipeline stages (`parallel.pp={self.parallel.pp}`) exchange activations "
                 "of one shape. Use `--train.micro_batch_tokens=0` (micro-batches of `train.micro_batch_size` rows) "
                 "with `parallel.pp` > 1.")
        require(not self.data.pack,
                 "`train.micro_batch_tokens` and `data.pack=true` both decide how a step's samples share micro-batches: "
                 "packing fills rows of `data.max_seq_len`, the budget groups rows of similar length. Choose one: "
                 "`--train.micro_batch_tokens=0` or `--data.pack=false`.")
