"""HF checkpoint -> Megatron-Bridge -> megatron-core model chunks (TP/PP/VPP, DDP or Megatron-FSDP), and back to HF.

This is the one place where parallelism is applied to the model and where the layer spec is chosen:
`build_policy` assembles everything a loop trains, always in the same order.
"""

import contextlib
import dataclasses
import functools
import gc
import importlib.util
import logging
import os
from pathlib import Path

import torch

from config.errors import UserError
from config import outputs
from config.sections import EMBEDDED_MODELS, have_transformer_engine
from model import lora, moe, parallel, rules

log = logging.getLogger(__name__)

# Decided once, at import: the fused-Adam test double makes later calls of have_transformer_engine() say yes
# (for the optimizer) while the layers stay the ones built without Transformer Engine.
HAVE_TRANSFORMER_ENGINE = have_transformer_engine()


def resolve_model_path(config) -> Path:
    """`model.path`: an embedded model (`tiny`, `tiny-moe`: built offline on first use), else an HF directory; its
    shape is checked against the parallel layout before anything is built."""
    if config.model.path in EMBEDDED_MODELS:
        from model.tiny import ensure_tiny_checkpoint

        path = ensure_tiny_checkpoint(name=config.model.path)
    else:
        path = Path(config.model.path)
    config.validate_model_shape(path)
    check_weight_files(path)
    return path


def check_weight_files(path: Path) -> None:
    """Every safetensors file's header and length, read without loading weights: a truncated download is named now."""
    from safetensors import SafetensorError, safe_open

    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(weights, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise UserError(f"`{weights}` is truncated or corrupted ({error}). Download or save the checkpoint again, "
                            "or point `--model.path` at another one.") from None


def environment_ddp_defaults() -> dict:
    """DDP settings the machine imposes (gloo on CPU lacks a reduction Megatron-FSDP fuses); empty on GPUs."""
    from model import cpu_compat

    return {} if torch.cuda.is_available() else dict(cpu_compat.DDP_CONFIG_OVERRIDES)


def auto_bridge(hf_path: str | Path):
    """Megatron-Bridge's AutoBridge for a local HF checkpoint directory (fp32 weights as stored)."""
    lora.allow_import_without_te()  # Bridge's import reaches its LoRA layers, which import TE
    # Bridge's import helper logs a traceback at INFO for every optional TE symbol it cannot find,
    # and forces its own level and handler at import; disabling the logger is the only switch.
    logging.getLogger("megatron.bridge.utils.import_utils").disabled = True
    from megatron.bridge import AutoBridge

    freeze_imported_objects()
    return AutoBridge.from_hf_pretrained(str(hf_path), torch_dtype=torch.float32)


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
    from model.norm import torch_norm_block_spec

    # Without TE or apex, megatron-core's local norms refuse sequence parallelism; TorchNorm is the same norm without
    # that refusal (model/norm.py), so both non-TE specs run with and without it.
    specs = {"transformer_engine": gpt_provider.transformer_engine_layer_spec,
             "sdpa": functools.partial(torch_norm_block_spec, sdpa_layer_spec),
             "local": functools.partial(torch_norm_block_spec, local_layer_spec)}
    return specs[name]


def configure_provider(bridge, *, dtype: str, tp: int, pp: int, vpp: int | None, seq_length: int,
                       attention: str = "auto", load_weights: bool = True, transformer_overrides: dict | None = None,
                       ep: int = 1, etp: int | None = None, moe_dispatcher: str = "alltoall",
                       moe_router: dict | None = None):
    """A GPT model provider for this checkpoint with our parallelism, precision and layer spec set.

    `ep`/`etp` are the expert-parallel and expert tensor-parallel degrees (`etp=None`: megatron-core's default, `tp`);
    `moe_dispatcher` is megatron-core's token dispatcher for a Mixture-of-Experts model (a dense one ignores both).

    `moe_router` (`rules.moe_router_overrides`) sets a Mixture-of-Experts model's router; a dense model has none.
    `transformer_overrides` are set last, before megatron-core validates the whole (`finalize()`): `build_policy`
    passes `rules.transformer_overrides(config)` there (sequence parallelism, recomputation).
    """
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    _refuse_family_specific_layer_spec(bridge, provider)
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
    _disable_fusions_needing_transformer_engine(provider)
    _keep_routes_visible(provider)
    provider.finalize()
    return provider


def _keep_routes_visible(provider) -> None:
    """A router with RouterReplay chooses its experts through it; TE's fused top-k (`moe_router_fusion`) bypasses it,
    so GRPO would record no route (its first rollout failed) and replay none: with replay on, the fusion is off."""
    if getattr(provider, "moe_enable_routing_replay", False) and getattr(provider, "moe_router_fusion", False):
        provider.moe_router_fusion = False
        log.info("moe_router_fusion turned off: Transformer Engine's fused top-k bypasses RouterReplay, which records and "
                 "replays the rollouts' routes")


def _refuse_family_specific_layer_spec(bridge, provider) -> None:
    """Refuse a family whose Bridge provider brings its own layer spec, which configure_provider would replace with ours.

    Gemma 2 and 3 are such families (measured with Megatron-Bridge 0.6.2): their specs add post-attention and post-MLP
    norms inside Transformer Engine linear layers, soft-capping or per-layer sliding windows, and norms computing
    x * (1 + w), which megatron-core's non-TE norm refuses. Built from our spec they would be a different model.
    """
    from megatron.bridge.models import gpt_provider

    spec = provider.transformer_layer_spec
    if spec is gpt_provider.default_layer_spec:
        return
    path = bridge.hf_pretrained.model_name_or_path
    architecture = (getattr(bridge.hf_pretrained.config, "architectures", None) or ["this"])[0]
    raise UserError(
        f"`model.path={path}` is a {architecture} checkpoint, a family Megatron-Bridge builds from its own layer "
        f"specification (`{getattr(spec, '__name__', type(spec).__name__)}`). This trainer builds every model from "
        "megatron-core's standard GPT layers (Transformer Engine's, or the local/SDPA ones without it), which lack that "
        "family's own layers (for Gemma 2 and 3: post-attention and post-MLP norms, logit soft-capping, per-layer sliding "
        "windows, norms scaled by 1 + weight), so it would train a different model and refuses the checkpoint. Point "
        "`--model.path` at a Llama, Mistral, Qwen2, Qwen3 or Qwen3-MoE checkpoint (README: Model families verified).")


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


def _disable_fusions_needing_transformer_engine(provider) -> None:
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


def build_chunks(provider, ddp_config=None) -> list:
    """Instantiate the model chunks (one per virtual pipeline stage) with HF weights, then wrap each for data parallelism.

    `ddp_config=None` leaves them unwrapped (inference, parity checks).
    """
    from megatron.core.transformer.module import Float16Module

    moe.start_metrics_tracker()
    chunks = provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        mixed_precision_wrapper=Float16Module,
    )
    if ddp_config is None:
        return chunks
    return wrap_for_data_parallel(chunks, provider, ddp_config)


def wrap_for_data_parallel(chunks: list, transformer_config, ddp_config) -> list:
    """Synchronise every chunk across data-parallel ranks, then wrap each in megatron-core DDP or Megatron-FSDP."""
    from megatron.core.distributed import DistributedDataParallel, FullyShardedDataParallel

    # Before wrapping: Megatron-FSDP shards parameters into DTensors, which cannot be broadcast whole.
    broadcast_parameters(chunks)
    if ddp_config.use_megatron_fsdp and ddp_config.suggested_communication_unit_size is None:
        ddp_config.suggested_communication_unit_size = fsdp_communication_unit(chunks)
    wrapper = FullyShardedDataParallel if ddp_config.use_megatron_fsdp else DistributedDataParallel
    wrapped = [
        # Bucketing only for the first chunk: later chunks' gradients are ready late in backward anyway
        # (megatron-core's own convention for virtual pipeline stages).
        wrapper(config=transformer_config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    if ddp_config.use_megatron_fsdp and not torch.cuda.is_available():
        # Megatron-FSDP switches overlapped parameter gathers on for full sharding (it sets the flag on this very
        # config object). On CPU they overlap nothing (gloo runs on the cores the compute needs) and stream
        # ordering is a no-op, so after each optimizer step its gathers are made synchronous: a step ends with
        # every parameter gathered and no gloo work in flight. On GPUs its overlap stays, and every read of
        # parameters outside a forward waits for it first (`Policy.sync_parameters`).
        ddp_config.overlap_param_gather = False
    return wrapped


def fsdp_communication_unit(chunks: list) -> int:
    """Megatron-FSDP's communication unit in elements: two transformer layers' parameters, so one layer is gathered
    while the next is prefetched (its own rule, which megatron-fsdp 0.6.1 then raises to at least 1e9 elements, so
    that a model under 500M parameters is gathered whole and sharding saves no memory)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [module for chunk in chunks for module in chunk.modules() if isinstance(module, TransformerLayer)]
    if not layers:
        return 1_000_000_000
    return 2 * max(sum(param.numel() for param in layer.parameters()) for layer in layers)


def broadcast_parameters(chunks: list) -> None:
    """Give every data-parallel rank the parameters of DP rank 0, in every model chunk (not only the first)."""
    from megatron.core import parallel_state

    for chunk in chunks:
        for param in chunk.parameters():
            # Expert weights are replicated over the expert-data-parallel group instead (megatron's `allreduce` flag).
            expert = not getattr(param, "allreduce", True)
            group = (parallel_state.get_expert_data_parallel_group() if expert
                     else parallel_state.get_data_parallel_group(with_context_parallel=True))
            torch.distributed.broadcast(param.data, src=torch.distributed.get_global_rank(group, 0), group=group)


def attach_training_hooks(transformer_config, chunks: list, optimizer, ddp_config) -> None:
    """Tell megatron-core's pipeline schedule how to finalise gradients, scale the loss, delay DP syncs and, with
    overlapped communication, when to start each chunk's gradient reduction and parameter gathering."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(method: str):
        bound = [getattr(chunk, method) for chunk in chunks]
        return bound[0] if len(bound) == 1 else bound

    transformer_config.finalize_model_grads_func = finalize_model_grads
    transformer_config.grad_scale_func = optimizer.scale_loss
    # With overlapped reduction, gradient syncs must wait for the last microbatch.
    transformer_config.no_sync_func = per_chunk("no_sync")
    if ddp_config.overlap_grad_reduce:
        # With pipeline stages, a chunk's reduction starts as soon as its last backward is done (megatron's align_grad_reduce).
        transformer_config.grad_sync_func = per_chunk("start_grad_sync")
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        transformer_config.param_sync_func = per_chunk("start_param_sync")


def experts_span_data_parallel(provider) -> bool:
    """Whether a Mixture-of-Experts layer's expert-model-parallel group (expert TP x EP ranks) reaches beyond one
    tensor-parallel group, so that data-parallel ranks exchange tokens in every forward. megatron-core lays out both
    grids tensor-parallel ranks first (order tp-cp-ep-dp-pp), so that is when etp x ep exceeds tp: at tp=2, etp=1,
    ep=2 the experts are split over the tensor-parallel peers, which run the same forwards anyway."""
    if not getattr(provider, "num_moe_experts", None):
        return False
    expert_ranks = provider.expert_model_parallel_size * (provider.expert_tensor_parallel_size or 1)
    return expert_ranks > provider.tensor_model_parallel_size


# The provider fields `attach_training_hooks` sets: bound to the DDP wrappers and the optimizer.
TRAINING_HOOKS = ("finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func")


@contextlib.contextmanager
def _training_hooks_detached(provider):
    """The provider without its training hooks inside the block, with them after.

    A Mixture-of-Experts layer whose experts are narrower than a dense MLP (megatron-core's SequentialMLP) deep-copies
    the config it is built with; the hooks would drag the DDP wrappers, the optimizer and their process groups into
    that copy, which cannot copy a process group (a second model built after training is wired up, GRPO's KL
    reference, failed so on tiny-moe)."""
    saved = {name: getattr(provider, name, None) for name in TRAINING_HOOKS}
    for name in saved:
        setattr(provider, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(provider, name, value)


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode inside the block (dropout off), in the mode it was in after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def export_hf(bridge, chunks: list, out_dir: str | Path) -> None:
    """Write the model as a Hugging Face checkpoint (safetensors, config, tokenizer). Collective: every rank calls it."""
    bridge.save_hf_pretrained(chunks, str(out_dir), show_progress=False)


# ---------------------------------------------------------------- the policy a loop trains


def load_tokenizer(model_path: Path):
    """The checkpoint's tokenizer (loaded before the model, so data errors come first)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_path)


@dataclasses.dataclass
class Policy:
    """The trained model and everything built with it: Bridge and its provider, chunks, optimizer, LR schedule, tokenizer."""

    bridge: object
    provider: object  # Bridge's model provider, a megatron-core TransformerConfig: every chunk's settings
    chunks: list
    optimizer: object
    lr_schedule: object
    tokenizer: object
    hf_config: dict
    lora: object = None  # Megatron-Bridge's LoRA transform when `peft.method=lora` (its adapters are the trained part)

    @property
    def vocab_size(self) -> int:
        """Rows of the HF vocabulary (megatron pads its embedding beyond this)."""
        return self.hf_config["vocab_size"]

    @property
    def can_generate(self) -> bool:
        """Generation runs one model chunk per rank through the pipeline stages: no virtual pipeline stages."""
        return len(self.chunks) == 1

    @functools.cached_property
    def generator(self):
        """The policy's generation object: end ids from the tokenizer and `generation_config.json`; under Megatron-FSDP,
        whose every forward gathers parameters, and where a Mixture-of-Experts layer exchanges tokens between
        data-parallel ranks (`experts_span_data_parallel`), the data-parallel group inside (so every rank runs the same
        forwards). DDP's forwards otherwise communicate nothing across data-parallel ranks, so there each rank
        generates on its own, with no agreement per step, but for multi-turn rollouts (see `Generator`)."""
        from megatron.core import parallel_state

        from model.generate import Generator, end_token_ids

        gathers_per_forward = any(getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False)
                                  for chunk in self.chunks) or experts_span_data_parallel(self.provider)
        data_parallel = (parallel_state.get_data_parallel_group()
                         if parallel_state.get_data_parallel_world_size() > 1 else None)
        return Generator(self.chunks, self.vocab_size,
                         end_token_ids(self.bridge.hf_pretrained.model_name_or_path, self.tokenizer),
                         data_parallel if gathers_per_forward else None, data_parallel, self.routes)

    @functools.cached_property
    def routes(self):
        """The routers of a Mixture-of-Experts policy, to record, replay and compare routes (`model.routing`); empty
        (false) for a dense model."""
        from model.routing import Routes

        return Routes(self.chunks)

    @functools.cached_property
    def routing_figures(self):
        """The per-step routing figures of a Mixture-of-Experts policy (`moe.RoutingFigures`: hooks on its routers, set
        on first use); a dense policy's report nothing."""
        return moe.RoutingFigures(self.chunks, self.provider)

    def global_tokens(self, local_tokens: int) -> float:
        """Tokens of a step over every rank, each model replica's batch counted once (its TP/PP ranks saw the same)."""
        provider = self.provider
        return parallel.all_reduce_sum([float(local_tokens)])[0] / (provider.tensor_model_parallel_size
                                                                     * provider.pipeline_model_parallel_size)

    def sync_parameters(self) -> None:
        """Finish the parameter gathers of the last optimizer step, before anything reads parameters outside a forward
        (checkpoint save, HF export, shutdown). Collective.

        DDP with `overlap_param_gather`: the gather of updated shards waits for the next forward, so run it now.
        Megatron-FSDP with it: the step's asynchronous all-gathers may still be writing into parameter storage;
        wait for every one of them (`synchronize_param_gather`), which leaves the parameters as their shards.
        """
        for chunk in self.chunks:
            ddp_config = getattr(chunk, "ddp_config", None)
            if ddp_config is None or not ddp_config.overlap_param_gather:
                continue
            if ddp_config.use_megatron_fsdp:
                chunk.synchronize_param_gather()
            else:
                chunk.start_param_sync(force_sync=True)

    @contextlib.contextmanager
    def adapters_disabled(self):
        """With LoRA: the base model inside the block (the adapters switched off), exactly as it was built."""
        with self.lora.disable_adapter(self.chunks):
            yield

    def frozen_copy(self) -> list:
        """A second copy of the starting weights that is never trained (GRPO's KL reference without LoRA)."""
        with _training_hooks_detached(self.provider):
            chunks = build_chunks(self.provider)
        for chunk in chunks:
            chunk.requires_grad_(False).eval()
        return chunks

    def export(self, directories: dict, is_main: bool) -> None:
        """Write the model and its tokenizer as a Hugging Face checkpoint into `directories[outputs.HF]`, and with LoRA
        the adapter in PEFT format into `directories[outputs.HF_ADAPTER]` (`ckpt.checkpoint` stages and publishes
        them). Collective."""
        self.sync_parameters()
        export_hf(self.bridge, self.chunks, directories[outputs.HF])  # with LoRA: the adapters merged into the weights
        if self.lora is not None:
            # The base as an absolute path, so the adapter loads from wherever it is read.
            base = Path(self.bridge.hf_pretrained.model_name_or_path).resolve()
            self.bridge.save_hf_adapter(self.chunks, str(directories[outputs.HF_ADAPTER]), peft_config=self.lora,
                                        base_model_name_or_path=str(base))
        if is_main:
            self.tokenizer.save_pretrained(directories[outputs.HF])

    def exports(self) -> tuple[str, ...]:
        """The names of what `export` writes into `train.out_dir`."""
        return outputs.EXPORTS if self.lora is not None else (outputs.HF,)


def build_policy(config, model_path: Path, tokenizer, *, trainable: bool = True,
                 on_phase=lambda phase: None) -> Policy:
    """Everything a loop trains, in one fixed order: layer spec and TP/PP/VPP, DDP or Megatron-FSDP (after a
    parameter sync over every chunk), optimizer and LR schedule, then the pipeline schedule's training hooks.

    `trainable=False` stops after the layer spec and parallel layout: bare chunks for generation and parity
    checks, no optimizer.
    `on_phase(name)` is called as each phase ends (the loops' start-up report times them).
    """
    from megatron.core.optimizer import get_megatron_optimizer

    bridge = auto_bridge(model_path)
    on_phase("megatron and Bridge import")
    provider = configure_provider(
        bridge, dtype=config.model.dtype, tp=config.parallel.tp, pp=config.parallel.pp,
        vpp=config.parallel.vpp if config.parallel.vpp > 1 else None, seq_length=config.data.max_seq_len,
        attention=config.model.attention, ep=config.parallel.ep, etp=config.parallel.expert_tensor_parallel_size,
        moe_dispatcher=config.model.moe_dispatcher, moe_router=rules.moe_router_overrides(config.model),
        transformer_overrides={"calculate_per_token_loss": True, **rules.transformer_overrides(config)})
    hf_config = bridge.hf_pretrained.config.to_dict()
    if not trainable:
        return Policy(bridge, provider, build_chunks(provider), None, None, tokenizer, hf_config)
    optimizer_config = rules.optimizer_config(config)
    environment = parallel.detect_environment(config.parallel, torch.distributed.get_world_size())
    ddp_config = rules.ddp_config(config, optimizer_config, environment_ddp_defaults(), environment)
    chunks = build_chunks(provider)
    if config.model.moe_freeze_router:
        moe.freeze_routers(chunks)  # before the DDP wrap and the optimizer: neither then holds the routers' weights
    adapters = lora.apply(chunks, config.peft, provider) if config.peft.method == "lora" else None
    chunks = wrap_for_data_parallel(chunks, provider, ddp_config)
    on_phase("model build and HF weights")
    optimizer = get_megatron_optimizer(optimizer_config, chunks)
    lr_schedule = warmup_cosine_schedule(optimizer, config)
    attach_training_hooks(provider, chunks, optimizer, ddp_config)
    on_phase("optimizer")
    log.info("resolved settings:\n%s", rules.settings_table(
        optimizer_config, ddp_config, provider, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), environment.cuda))
    return Policy(bridge, provider, chunks, optimizer, lr_schedule, tokenizer, hf_config, adapters)


def warmup_cosine_schedule(optimizer, config):
    """megatron-core's LR schedule: linear warmup over `optim.warmup_steps`, cosine decay to `optim.final_lr` at `train.steps`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = min(config.optim.warmup_steps, max(config.train.steps - 1, 0))
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=config.optim.lr,
        min_lr=config.optim.final_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=config.train.steps,
        lr_decay_style="cosine",
        start_wd=config.optim.weight_decay,
        end_wd=config.optim.weight_decay,
        wd_incr_steps=config.train.steps,
        wd_incr_style="constant",
    )
