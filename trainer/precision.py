"""Pure rules from our config to megatron-core's `OptimizerConfig` and `DistributedDataParallelConfig`.

Nothing here touches a process group or a model, so every branch is tested on the real classes on CPU.
"""

import dataclasses
import importlib.util

import torch

from model.build import DTYPES as TORCH_DTYPES
from trainer.config import DTYPE_NAMES
from trainer.errors import UserError

FP16_INITIAL_LOSS_SCALE = 32768


def have_transformer_engine() -> bool:
    """Whether Transformer Engine is importable (its FusedAdam backs the precision-aware optimizer)."""
    return importlib.util.find_spec("transformer_engine") is not None


def precision_aware(config) -> bool:
    """fp16 always keeps fp32 master weights in TE's FusedAdam; bf16 only when the user opts in."""
    return config.model.dtype == "fp16" or (config.model.dtype == "bf16" and config.optim.use_precision_aware_optimizer)


def _check_override_keys(overrides: dict, config_class, key: str) -> None:
    """Reject override keys the megatron-core class does not have, naming our config key."""
    known = {item.name for item in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"`{key}` sets {', '.join(f'`{name}`' for name in unknown)}, which megatron-core's "
                        f"{config_class.__name__} does not have. Remove or rename them in `{key}`.")


def validate(config) -> None:
    """Start-up checks of the precision/optimizer/DDP settings; each error names the key to change."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    optim = config.optim
    for key in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(optim, key) not in DTYPE_NAMES:
            raise UserError(f"`optim.{key}={getattr(optim, key)}` is not one of {', '.join(DTYPE_NAMES)}. Change `--optim.{key}`.")
    if config.model.dtype not in DTYPE_NAMES:
        raise UserError(f"`model.dtype={config.model.dtype}` is not one of {', '.join(DTYPE_NAMES)}. Change `--model.dtype`.")
    _check_override_keys(optim.override_optimizer_config, OptimizerConfig, "optim.override_optimizer_config")
    _check_override_keys(config.ddp.override_ddp_config, DistributedDataParallelConfig, "ddp.override_ddp_config")
    if not precision_aware(config):
        return
    why = "`model.dtype=fp16`" if config.model.dtype == "fp16" else "`optim.use_precision_aware_optimizer=true`"
    optimizer = optim.override_optimizer_config.get("optimizer", "adam")
    if optimizer != "adam":
        raise UserError(f"{why} needs the adam optimizer, but `optim.override_optimizer_config.optimizer={optimizer}`.")
    if not (config.parallel.use_distributed_optimizer or config.parallel.use_megatron_fsdp):
        raise UserError(f"{why} needs the distributed optimizer: set `--parallel.use_distributed_optimizer=true`.")
    if not have_transformer_engine():
        raise UserError(f"{why} uses Transformer Engine's FusedAdam, and Transformer Engine is not installed. Install it "
                        "(`uv sync --extra te` on a CUDA machine, or use NVIDIA's NGC PyTorch container), or use "
                        "`--model.dtype=bf16 --optim.use_precision_aware_optimizer=false`.")


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
        params_dtype=TORCH_DTYPES[dtype],
        use_precision_aware_optimizer=precision_aware(config),
    )
    if dtype == "fp16":
        # Moments stay fp32; master weights are kept whole (no bf16 + int16 remainder trick for fp16).
        settings.update(initial_loss_scale=FP16_INITIAL_LOSS_SCALE, min_loss_scale=1, store_param_remainders=False)
    elif precision_aware(config):
        settings.update(
            main_grads_dtype=TORCH_DTYPES[optim.main_grads_dtype],
            exp_avg_dtype=TORCH_DTYPES[optim.exp_avg_dtype],
            exp_avg_sq_dtype=TORCH_DTYPES[optim.exp_avg_sq_dtype],
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
