"""The provider's model chunks built and wrapped for data parallelism (megatron-core DDP or Megatron-FSDP), their
parameters made equal on every rank, and the training hooks megatron-core's schedule calls (gradient finalisation,
no-sync, parameter sync) attached.
"""

import contextlib
import logging

import torch

from model import collectives, moe

log = logging.getLogger(__name__)



def environment_ddp_defaults() -> dict:
    """DDP settings the machine imposes (gloo on CPU lacks a reduction Megatron-FSDP fuses); empty on GPUs."""
    from model import cpu_compat

    return {} if torch.cuda.is_available() else dict(cpu_compat.DDP_CONFIG_OVERRIDES)


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


def unsharded_bytes(pipeline) -> int:
    """The bytes of every parameter bucket of a Megatron-FSDP chunk, gathered whole (its tensor- and pipeline-parallel
    shard of the model, unsharded over data-parallel ranks)."""
    return sum(group.model_weight_buffer.bucket_index.size * group.model_weight_buffer.dtype.itemsize
               for group in pipeline.buffer.parameter_groups if group.model_weight_buffer is not None)


@contextlib.contextmanager
def parameters_gathered_once(chunks: list):
    """Under Megatron-FSDP: each parameter bucket a forward gathers stays gathered until the block ends, then is released
    as the forwards would have released it; elsewhere, and on a GPU whose free memory is less than twice the unsharded
    parameters, nothing changes.

    Megatron-FSDP gathers a layer's parameters before its forward and frees them after (`release_bucket`, called by
    its post-forward hook), so generation, one forward per token, gathered the whole model once per token. Inside the
    block the releases are held (a bucket already gathered is not gathered again: `all_gather_params` skips all but
    the empty ones), so the model is gathered once a generation call, and the same values reach every forward (1.8x
    the tokens/s on 2 CPU processes, the same tokens: scripts/bench/bench_fsdp_rollout.py). The parameters do not
    change inside (no optimizer step), and every rank runs the same forwards (the caller's data-parallel agreement),
    so the collectives still pair. Memory: the chunk's parameters unsharded while generating, as an inference engine
    holds them; where that would not fit twice into the GPU's free memory of any rank, each forward gathers and frees
    as before. Every rank of the world chooses alike (collective, on a GPU): not only the data-parallel group, since
    expert parameters are gathered over the expert-data-parallel group, which spans several data-parallel groups where
    experts are split over fewer ranks than the tensor-parallel size (tp=2, etp=1); a rank that held would skip
    gathers its peers run."""
    pipelines = [chunk.module.all_gather_pipeline for chunk in chunks
                 if getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False)]
    if pipelines and torch.cuda.is_available():
        need = sum(unsharded_bytes(pipeline) for pipeline in pipelines)
        fits = int(2 * need <= torch.cuda.mem_get_info()[0])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            fits = collectives.all_reduce_int(fits, torch.distributed.ReduceOp.MIN)
        if not fits:
            pipelines = []
    held = {}  # (pipeline index, bucket id, bwd) -> None, in release order
    for index, pipeline in enumerate(pipelines):
        pipeline.release_bucket = lambda bucket_id, bwd, lazy=False, index=index: held.setdefault((index, bucket_id, bwd))
    try:
        yield
    finally:
        for pipeline in pipelines:
            del pipeline.release_bucket  # the class's method again
        for index, bucket_id, bwd in held:
            pipelines[index].release_bucket(bucket_id, bwd)


# The provider fields `attach_training_hooks` sets: bound to the DDP wrappers and the optimizer.
TRAINING_HOOKS = ("finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func")


@contextlib.contextmanager
def training_hooks_detached(provider):
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
