"""Pure rules from our config to megatron-core's `OptimizerConfig` and `DistributedDataParallelConfig`.

Nothing here touches a process group or a model, so every branch is tested on the real classes on CPU.
The checks of the same settings run earlier, at start-up (`config.sections.TrainerConfig.validate`).
"""

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
        min_lr=optim.min_lr,
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
    return OptimizerConfig(**settings)


def ddp_config(config, optimizer=None, extra_defaults: dict | None = None):
    """megatron-core DistributedDataParallelConfig whose gradient buckets follow the optimizer's main-gradient dtype.

    `extra_defaults` are environment-driven defaults (the CPU layer's gloo settings); the user's
    `ddp.override_ddp_config` still wins over them.
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
            check_for_nan_in_grad=True,
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True,
            # Megatron-FSDP ignores grad_reduce_in_fp32 and keeps gradients in the compute dtype unless
            # told: apply the same rule (fp32 unless the optimizer's main gradients are lower).
            megatron_fsdp_main_grads_dtype=optimizer.main_grads_dtype if low_precision_grads else torch.float32,
        )
    settings.update(extra_defaults or {})
    settings.update(config.ddp.override_ddp_config)
    return DistributedDataParallelConfig(**settings)


def transformer_overrides(config) -> dict:
    """Transformer-config fields the precision/FSDP rules imply (Megatron-FSDP cannot fuse gradient accumulation)."""
    return {"gradient_accumulation_fusion": False} if config.parallel.use_megatron_fsdp else {}


def settings_table(optimizer, ddp) -> str:
    """A short table of the resolved optimizer and DDP settings, printed once at start-up."""
    rows = [
        ("precision", f"bf16={optimizer.bf16} fp16={optimizer.fp16} params={str(optimizer.params_dtype).removeprefix('torch.')}"),
        ("optimizer", f"{optimizer.optimizer} lr={optimizer.lr:g} min_lr={optimizer.min_lr:g} wd={optimizer.weight_decay:g} "
                      f"betas=({optimizer.adam_beta1:g}, {optimizer.adam_beta2:g}) eps={optimizer.adam_eps:g} clip={optimizer.clip_grad:g}"),
        ("optimizer state", f"precision_aware={optimizer.use_precision_aware_optimizer} distributed={optimizer.use_distributed_optimizer} "
                            f"main_grads={str(optimizer.main_grads_dtype).removeprefix('torch.')} "
                            f"exp_avg={str(optimizer.exp_avg_dtype).removeprefix('torch.')} "
                            f"exp_avg_sq={str(optimizer.exp_avg_sq_dtype).removeprefix('torch.')}"),
        ("gradient buckets", f"grad_reduce_in_fp32={ddp.grad_reduce_in_fp32} overlap_grad_reduce={ddp.overlap_grad_reduce}"),
        ("data parallel", f"megatron_fsdp={ddp.use_megatron_fsdp} sharding={ddp.data_parallel_sharding_strategy}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)
