"""Pure rules from our config (and where the run happens) to megatron-core's settings.

`optimizer_config` and `ddp_config` build megatron-core's `OptimizerConfig` and `DistributedDataParallelConfig`;
`transformer_overrides` gives the `TransformerConfig` fields our config implies (sequence parallelism, activation
recomputation), `moe_router_overrides` those of a Mixture-of-Experts router; `cuda_device_max_connections` the environment variable megatron-core's communication overlap needs.
Nothing here touches a process group, a device or a model: the machine comes in as an `Environment`, so every
branch is tested on the real classes on CPU, GPUs simulated. The checks of the same settings run earlier, at
start-up (`config.loops.TrainerConfig.validate`).
"""

import dataclasses
import math

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_INITIAL_LOSS_SCALE = 32768


def optimizer_config(config):
    """megatron-core OptimizerConfig for our config: precision by model dtype, then `optim.*`, then the override."""
    from megatron.core.optimizer import OptimizerConfig

    optim, dtype = config.optim, config.model.dtype
    settings = dict(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.final_lr,
        weight_decay=optim.weight_decay,
        clip_grad=optim.clip_grad,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        use_distributed_optimizer=config.parallel.use_distributed_optimizer or config.parallel.use_megatron_fsdp,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        params_dtype=DTYPES[dtype],
        use_precision_aware_optimizer=config.precision_aware,
    )
    if dtype == "fp16":
        # Moments stay fp32; master weights are kept whole (no bf16 + int16 remainder trick for fp16).
        settings.update(initial_loss_scale=FP16_INITIAL_LOSS_SCALE, min_loss_scale=1, store_param_remainders=False)
    elif config.precision_aware:
        settings.update(
            main_grads_dtype=DTYPES[optim.main_grads_dtype],
            exp_avg_dtype=DTYPES[optim.exp_avg_dtype],
            exp_avg_sq_dtype=DTYPES[optim.exp_avg_sq_dtype],
            main_params_dtype=torch.float32,
        )
    settings.update(optim.override_optimizer_config)
    if not settings["clip_grad"]:
        # Clipping off is clipping at infinity (a no-op), so megatron-core still computes the global norm the rows
        # report: with 0, Megatron-FSDP's optimizer (one, not chained) returned 0.0 as the norm at every step.
        settings["clip_grad"] = math.inf
    return OptimizerConfig(**settings)


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where a run happens, as far as the rules care: read once at start-up (`model.parallel.detect_environment`)."""

    cuda: bool = False
    compute_capability: tuple[int, int] | None = None  # the GPU's (major, minor); None on CPU
    data_parallel_size: int = 1


CPU = Environment()


def ddp_config(config, optimizer=None, extra_defaults: dict | None = None, environment: Environment = CPU):
    """megatron-core DistributedDataParallelConfig whose gradient buckets follow the optimizer's main-gradient dtype.

    `environment` switches communication overlap on where it pays (`overlap_settings`); `extra_defaults` are
    environment-driven defaults (the CPU layer's gloo settings). The user's `ddp.override_ddp_config` wins over both.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    optimizer = optimizer or optimizer_config(config)
    low_precision_grads = optimizer.use_precision_aware_optimizer and optimizer.main_grads_dtype != torch.float32
    settings = dict(
        grad_reduce_in_fp32=not low_precision_grads,
        use_distributed_optimizer=optimizer.use_distributed_optimizer,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        average_in_collective=False,
    )
    if config.parallel.use_megatron_fsdp:
        settings.update(
            use_megatron_fsdp=True,
            use_distributed_optimizer=True,
            # Not Megatron-FSDP's own check: where it runs it raises on the one rank whose local gradients hold a NaN
            # (a ValueError printing the whole gradient; its peers wait in the reduce-scatter) after a host sync per
            # bucket, and an SFT at lr 50 on 2 processes went through NaN steps unchecked. The loops stop every rank
            # alike on megatron-core's global gradient norm (`trainer.metrics.stop_if_diverged`).
            check_for_nan_in_grad=False,
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True,
            # Megatron-FSDP ignores grad_reduce_in_fp32 and keeps gradients in the compute dtype unless
            # told: apply the same rule (fp32 unless the optimizer's main gradients are lower).
            megatron_fsdp_main_grads_dtype=optimizer.main_grads_dtype if low_precision_grads else torch.float32,
            # megatron-core's optimizer reads a precision-aware optimizer's gradients from `decoupled_grad` under
            # Megatron-FSDP ("Megatron-FSDP always uses decoupled_grad with FusedAdam"), where Megatron-FSDP installs
            # them only when told (Megatron-Bridge's rule). Without it the gradients stay in `.grad`: bf16 trained
            # nothing (grad_norm 0, every update empty) and fp16 failed at its first step.
            megatron_fsdp_use_decoupled_grad=optimizer.use_precision_aware_optimizer,
        )
    settings.update(overlap_settings(config, optimizer.use_distributed_optimizer, environment))
    settings.update(extra_defaults or {})
    settings.update(config.ddp.override_ddp_config)
    return DistributedDataParallelConfig(**settings)


# The distributed optimizer's checkpoints (`dp_reshardable`) are keyed by gradient bucket, so the bucket layout must
# not follow the data-parallel size, or a run saved at one size cannot resume at another: megatron-core's default is
# max(40M, 1M x DP) parameters a bucket, and one bucket for the whole model where gradients are not overlapped.
BUCKET_SIZE = 40_000_000


def overlap_settings(config, distributed_optimizer: bool, environment: Environment) -> dict:
    """Communication overlap as Megatron-Bridge's performance recipes set it: on CUDA with the distributed optimizer,
    gradient reduce-scatters run during backward in buckets of `BUCKET_SIZE` parameters at every data-parallel size
    (one rank included, where the reduce-scatter is a copy: so a checkpoint resumes at any other size), and with more
    than one data-parallel rank parameter all-gathers run during the next forward; with virtual pipeline stages every
    stage starts its all-gathers together (`align_param_gather`).

    Empty (megatron-core's synchronous defaults, one bucket) elsewhere: on CPU, gloo's communication runs on the
    cores the compute it would hide behind needs (it works there when forced: tests/test_levers.py); under
    Megatron-FSDP, whose checkpoints are laid out per parameter, only the all-gathers.
    """
    if not (environment.cuda and distributed_optimizer):
        return {}
    parallel = config.parallel
    settings = {} if parallel.use_megatron_fsdp else {"overlap_grad_reduce": True, "bucket_size": BUCKET_SIZE}
    if environment.data_parallel_size > 1:
        settings.update(overlap_grad_reduce=True, overlap_param_gather=True,
                        align_param_gather=parallel.pp > 1 and parallel.vpp > 1)
    return settings


# Blackwell (compute capability 10) and newer: Megatron-Bridge's performance scripts give every run 32 connections.
MANY_CONNECTIONS_FROM_CAPABILITY = 10


def cuda_device_max_connections(parallel, environment: Environment) -> str | None:
    """The `CUDA_DEVICE_MAX_CONNECTIONS` a run needs, set before CUDA is initialised; None: leave CUDA's default (8).

    The rule of Megatron-Bridge's performance scripts: up to Hopper, tensor parallelism wants 1, so kernels start in
    the order they are queued and a tensor-parallel collective is not queued behind the GEMM it should overlap
    (megatron-core warns without it under sequence parallelism); Megatron-FSDP instead needs more than 1 (Bridge
    refuses 1), so it keeps the default. From Blackwell on, 32, so streams are not serialised.
    """
    if not environment.cuda:
        return None
    if environment.compute_capability and environment.compute_capability[0] >= MANY_CONNECTIONS_FROM_CAPABILITY:
        return "32"
    if parallel.tp > 1 and not parallel.use_megatron_fsdp:
        return "1"
    return None


def transformer_overrides(config) -> dict:
    """Transformer-config fields our config implies: sequence parallelism (only with tp > 1), activation recomputation,
    and no fused gradient accumulation under Megatron-FSDP."""
    model = config.model
    settings = {"sequence_parallel": config.parallel.uses_sequence_parallel, "recompute_granularity": None,
                "recompute_method": None, "recompute_num_layers": None}
    if model.recompute == "selective":
        settings.update(recompute_granularity="selective", recompute_modules=list(model.recompute_modules))
    elif model.recompute == "full":
        settings.update(recompute_granularity="full", recompute_method=model.recompute_method,
                        recompute_num_layers=model.recompute_num_layers)
    if config.parallel.use_megatron_fsdp:
        settings["gradient_accumulation_fusion"] = False
    return settings


def moe_router_overrides(model, lora: bool = False) -> dict:
    """Transformer-config fields of a Mixture-of-Experts router that the `model.moe_*` keys set (`providers.configure_provider`
    applies them only to a model with experts); a key left at `default` or unset keeps the checkpoint provider's value.
    Under LoRA (`lora`) the base's expert biases stay as loaded, as its weights do: megatron-core updates them outside
    the optimizer, and a LoRA checkpoint holds the adapters alone, so a resume would have dropped their change."""
    settings = {}
    if model.moe_aux_loss_type != "default":
        settings["moe_router_load_balancing_type"] = model.moe_aux_loss_type
    if model.moe_aux_loss_coeff is not None:
        settings["moe_aux_loss_coeff"] = model.moe_aux_loss_coeff
    if model.moe_z_loss_coeff is not None:
        # 0 is None to megatron-core: its router computes the z-loss whenever the coefficient is not None, and logs it
        # divided by the coefficient.
        settings["moe_z_loss_coeff"] = model.moe_z_loss_coeff or None
    if model.moe_router_dtype != "default":
        settings["moe_router_dtype"] = model.moe_router_dtype
    if model.moe_freeze_router or lora:
        settings["moe_router_bias_update_rate"] = 0.0  # expert biases (DeepSeek-V3's aux-free balancing) stay too
    return settings


def _recompute_summary(transformer) -> str:
    """The recompute settings of a TransformerConfig in one phrase."""
    granularity = transformer.recompute_granularity
    if granularity == "selective":
        return f"selective modules={','.join(transformer.recompute_modules)}"
    if granularity == "full":
        return f"full method={transformer.recompute_method} num_layers={transformer.recompute_num_layers}"
    return "none"


def settings_table(optimizer, ddp, transformer=None, cuda_connections: str | None = None, cuda: bool = False) -> str:
    """A short table of the resolved optimizer, DDP, sequence-parallel, recompute and CUDA settings, printed once at
    start-up. `transformer` is the model's TransformerConfig; `cuda_connections` the CUDA_DEVICE_MAX_CONNECTIONS in force."""
    rows = [
        ("precision", f"bf16={optimizer.bf16} fp16={optimizer.fp16} params={str(optimizer.params_dtype).removeprefix('torch.')}"),
        ("optimizer", f"{optimizer.optimizer} lr={optimizer.lr:g} min_lr={optimizer.min_lr:g} wd={optimizer.weight_decay:g} "
                      f"betas=({optimizer.adam_beta1:g}, {optimizer.adam_beta2:g}) eps={optimizer.adam_eps:g} clip={optimizer.clip_grad:g}"),
        ("optimizer state", f"precision_aware={optimizer.use_precision_aware_optimizer} distributed={optimizer.use_distributed_optimizer} "
                            f"main_grads={str(optimizer.main_grads_dtype).removeprefix('torch.')} "
                            f"exp_avg={str(optimizer.exp_avg_dtype).removeprefix('torch.')} "
                            f"exp_avg_sq={str(optimizer.exp_avg_sq_dtype).removeprefix('torch.')}"),
        ("gradient buckets", f"grad_reduce_in_fp32={ddp.grad_reduce_in_fp32}"),
        ("communication overlap", f"overlap_grad_reduce={ddp.overlap_grad_reduce} overlap_param_gather={ddp.overlap_param_gather} "
                                  f"align_param_gather={ddp.align_param_gather}"),
        ("data parallel", f"megatron_fsdp={ddp.use_megatron_fsdp} sharding={ddp.data_parallel_sharding_strategy}"
                          + (f" communication_unit={ddp.suggested_communication_unit_size} elements"
                             if ddp.use_megatron_fsdp else "")),
    ]
    if transformer is not None:
        rows += [("sequence parallel", f"{transformer.sequence_parallel} (tp={transformer.tensor_model_parallel_size})"),
                 ("recompute", _recompute_summary(transformer))]
        if getattr(transformer, "num_moe_experts", None):
            rows.append(("MoE router", f"load_balancing={transformer.moe_router_load_balancing_type} "
                                       f"aux_loss_coeff={transformer.moe_aux_loss_coeff:g} "
                                       f"z_loss_coeff={transformer.moe_z_loss_coeff or 0:g} "
                                       f"dtype={transformer.moe_router_dtype or 'the model dtype'}"))
    rows.append(("CUDA connections", f"CUDA_DEVICE_MAX_CONNECTIONS={cuda_connections or 'unset (CUDA default 8)'}"
                 if cuda else "not applicable (no CUDA)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)
