"""The configuration's rules on the model and its parallel layout (`ModelChecks`, run by
`config.loops.TrainerConfig.validate` before any model is built): the layout against the model and the machine, the
model's settings, Mixture-of-Experts routers and layouts, recomputation. Each raises a `UserError` naming the key to
change."""

import logging
from pathlib import Path

from config import sections
from config.checkpoint_shape import (check_attention_settings, check_every_layer_sparse, check_rope_scaling,
                                     check_shape_settings)
from config.checks import require
from config.hf import architecture, causal_architecture, hf_expert_count, is_classifier, read_hf_config
from config.sections import (
    ATTENTION_NAMES, DTYPE_NAMES, EMBEDDED_MODELS, HF_EXPERT_KEYS, MOE_AUX_LOSS_TYPES, MOE_DISPATCHERS,
    MOE_ROUTER_DTYPES, MOE_ROUTER_KEYS, RECOMPUTE_METHODS, RECOMPUTE_MODULES, RECOMPUTE_NAMES
)

log = logging.getLogger(__name__)


# The checkpoints whose `max_position_embeddings` warning (`validate_model_shape`) this process has printed.
SAID_POSITIONS: set = set()


class ModelChecks:
    """The parallel layout against the model and the machine, the model's settings, MoE routers, recomputation."""

    STARTS_FROM_A_CLASSIFIER = False  # `trainer.rm` takes a reward model's checkpoint as its start; the others do not

    def check_layout_divides(self, hf: dict, name: str = "model", key: str = "model.path") -> int:
        """TP divides the heads and the vocabulary of a checkpoint (its config.json `hf`; `name` says which, `key` where
        it is set), PP x VPP its layers, and its rope settings are ones megatron-core reproduces; the layers each model
        chunk holds."""
        parallel = self.parallel
        # Megatron-Bridge has bridges for vision-language checkpoints (Qwen2.5-VL, Gemma 3's): it built one, whose forward
        # takes other inputs than a text model's, and the first step failed with a TypeError after the data and model.
        require("vision_config" not in hf,
                 f"`--{key}` is a vision-language checkpoint ({architecture(hf) or hf.get('model_type')}: its config.json "
                 "has a `vision_config`), and this trainer trains and generates text with text-only models. Point "
                 f"`--{key}` at a text-only checkpoint (Qwen2.5-Instruct rather than Qwen2.5-VL; docs/models.md: Model "
                 "families verified).")
        check_shape_settings(hf, name)
        check_rope_scaling(hf, name, key)
        check_attention_settings(hf, name, key, self.data.max_seq_len)
        check_every_layer_sparse(hf, name, key)
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
        if is_classifier(hf):  # trainer.rm's start: a reward model's export, trained on
            check_decoder_classifier(hf, model_path, "model.path")
        parallel = self.parallel
        per_chunk = self.check_layout_divides(hf)
        positions = hf.get("max_position_embeddings")
        said = (str(model_path), positions, self.data.max_seq_len)  # checked at start-up and again at the build
        if positions and self.data.max_seq_len > positions and said not in SAID_POSITIONS:
            SAID_POSITIONS.add(said)
            log.warning("`data.max_seq_len=%d` is longer than `model.path=%s` was trained on (config.json's "
                        "max_position_embeddings, %d): positions past it are ones its rotary embedding never saw, and "
                        "long rows may train and generate worse. Lower `--data.max_seq_len` to %d or less unless the "
                        "checkpoint is known to extend further.", self.data.max_seq_len, model_path, positions, positions)
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


def check_decoder_classifier(hf: dict, path, key: str) -> None:
    """Refuse, from its config.json, a sequence classifier whose backbone is no causal LM (an encoder's, as DeBERTa's
    reward models): a reward model is read as its causal LM with the score head (`model.score_head.causal_view`), and
    such a one failed once the policy was built, said to lack `score.weight`."""
    require(causal_architecture(hf) is not None,
             f"`{key}={path}` is a {architecture(hf)}, a classifier whose family has no causal language model in "
             "transformers (an encoder's, as DeBERTa's reward models are): a reward model here is a decoder, read as its "
             "causal language model with a score head on each row's last token. Point "
             f"`--{key}` at a reward model of a decoder family (Llama, Mistral, Qwen2, Qwen3: docs/models.md).")
