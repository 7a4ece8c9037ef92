"""Model and optimizer state in each layout, and every rank's RNG: what a checkpoint's shards hold, saved and loaded.

DDP: megatron-core `dist_checkpointing` (torch_dist format); Megatron-FSDP: its own DTensors through
torch.distributed.checkpoint (fsdp_dtensor); LoRA: the adapters only (the frozen base is `model.path`). Both formats
reshard over data parallelism.
"""

import logging
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ckpt.failures import underlying_error
from ckpt.layout import SHARDED_DIR, STATE_FILE
from ckpt.writer import WriteResults
from config import console
from config.errors import UserError

log = logging.getLogger(__name__)

# Each DP rank saves its optimizer shard as is; the format reshards over data parallelism (DP=2 -> DP=1).
# ('fully_reshardable' would also reshard TP/PP, but megatron-core 0.19.2 cannot load it into torch's
# AdamW, the optimizer used without TE/Apex: its loader expects a saved `step` tensor per parameter.)
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
# Megatron-FSDP checkpoints through torch.distributed.checkpoint with one DTensor per parameter and per
# Adam moment, so they reshard over data parallelism too.
FSDP_SHARDING = {"distrib_optim_sharding_type": "fsdp_dtensor"}
# Megatron-Bridge names every LoRA adapter's parameters `<layer>.adapter.<...>`.
ADAPTER_KEY = ".adapter."


# ---------------------------------------------------------------- RNG


def rng_state() -> dict:
    """Every RNG this process draws from."""
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` captured."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- saving the model and optimizer


def save_model_and_optimizer(chunks: list, optimizer, directory: Path, background: bool):
    """Write model chunks and optimizer, sharded, into `directory`. Collective.

    DDP goes through megatron-core's dist_checkpointing with its fully parallel strategy (replicated tensors written
    by the data-parallel ranks in turn, not all by one). With `background`, only the plan is made here (collective)
    and megatron-core's `AsyncRequest` is returned: its write runs in a forked process (`BackgroundSaves`), its
    finalize functions write the index once every rank's part is on disk. Megatron-FSDP writes its DTensors through
    torch.distributed.checkpoint, synchronously."""
    initialise_unstepped_optimizer_state(optimizer)
    if uses_megatron_fsdp(chunks):
        import torch.distributed.checkpoint as dcp

        state, _ = _fsdp_state_dict(chunks, optimizer, is_loading=False)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))
        return None
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1),
                                                parallel_state.get_data_parallel_group(with_context_parallel=True))
    with WriteResults.install().capturing():  # a synchronous save writes here
        return dist_checkpointing.save(_sharded_state_dict(chunks, optimizer, is_loading=False), str(directory),
                                       strategy, async_sharded_save=background, async_strategy="mcore")


def initialise_unstepped_optimizer_state(optimizer) -> None:
    """Give a precision-aware optimizer (Transformer Engine's FusedAdam) that has not stepped yet the state of one that
    never will have: zero moments and master weights copied from the parameters (megatron-core's own `init_state_fn`).
    FusedAdam makes its state in its first step, and under fp16 every update is skipped until the dynamic loss scale
    fits, so a save before then would find no state to write (KeyError: 'master_param')."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if part.config.use_precision_aware_optimizer and not part.optimizer.state:
            part.init_state_fn(part.optimizer, part.config)


def _sharded_state_dict(chunks: list, optimizer, is_loading: bool) -> dict:
    """megatron-core's sharded view of every model chunk and of the optimizer (DDP: dist_checkpointing format).

    With LoRA, the adapters only: the frozen base is the run's `model.path`, loaded at start-up."""
    model = {f"model{index}": chunk.module.sharded_state_dict() for index, chunk in enumerate(chunks)}
    if _uses_lora(chunks):
        model = {name: _adapter_state(state) for name, state in model.items()}
    optimizer_state = optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)
    return {**model, "optimizer": optimizer_state}


def _fsdp_state_dict(chunks: list, optimizer, is_loading: bool) -> tuple[dict, set]:
    """Megatron-FSDP's own view: every chunk's parameters and the optimizer state as DTensors sharded over DP.

    The tensors are the live sharded main weights and Adam moments, so torch.distributed.checkpoint writes
    them, or reads into them, in place. (For loading, megatron-core first gives the optimizer its state
    with one zero-gradient step.) Also returns the names of the optimizer entries `_complete_optimizer_state` added.
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict, handle_fp8_extra_state_case

    state = {}
    for index, chunk in enumerate(chunks):
        model_state = chunk.state_dict()
        handle_fp8_extra_state_case(model_state)  # TE's FP8 scaling metadata is not a weight
        # Under expert parallelism each rank numbers its own experts from 0, so two ranks' experts would share a key
        # and one would overwrite the other (measured at EP=2: the resumed run left the straight one at the first step
        # after the resume). Their global numbers keep them apart, as the optimizer's keys already are, and as
        # Megatron-Bridge's own fsdp_dtensor checkpoints do.
        num_experts = chunk.config.num_moe_experts
        state[f"model{index}"] = handle_experts_in_state_dict(model_state, num_experts) if num_experts else model_state
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=FSDP_SHARDING)
    added = _complete_optimizer_state(state["optimizer"], optimizer)
    # Megatron-FSDP shards unevenly over DP: every DTensor learns its chunk's global offset, one
    # all_gather_object per DTensor, in key order, so every rank must hold the same DTensor keys.
    return preprocess_state_dict_for_uneven_dtensor(state), added


def _complete_optimizer_state(optimizer_state: dict, optimizer) -> set:
    """Give every parameter an optimizer-state entry on every rank, also where this rank's shard is empty.

    Megatron-FSDP splits each bucket evenly over DP ranks, so a small parameter can fall wholly on
    other ranks. Its local gradient is then None (megatron_fsdp's `update_main_grads`), the optimizer
    never creates state for it here, and megatron-core's `sharded_param_state_fsdp_dtensor` lists only
    the parameters that have state: ranks hold different DTensor keys, run different numbers of the
    per-DTensor collectives above, and the save hangs (Megatron-LM issue #4910; not specific to gloo).
    Empty DTensors of the right global shape make the keys agree; they hold no data, so they write nothing
    and read nothing. Returns the names added, which the load drops again.
    """
    from torch.distributed.tensor import DTensor

    state = optimizer_state["state"]
    # The kinds of state tensors (exp_avg, exp_avg_sq, ...) and their dtypes; a rank may have none at all.
    local_kinds = {key: value.dtype for entry in state.values() for key, value in entry.items()
                   if isinstance(value, DTensor)}
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, local_kinds)
    kinds = {key: dtype for rank_kinds in every_rank for key, dtype in rank_kinds.items()}
    added = set()
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            name = optimizer._param_name(param)  # the key megatron-core's state dict uses
            if name not in state:
                state[name] = {key: torch.zeros_like(param, dtype=dtype) for key, dtype in kinds.items()}
                added.add(name)
    return added


def estimated_save_bytes(policy, adapters_only: bool) -> int:
    """Bytes of one checkpoint: the saved weights in their dtype (with LoRA the adapters only) plus 12 bytes per
    trained parameter (the optimizer's fp32 main copy and Adam's two moments; measured: 16.3 bytes per parameter of
    the fp32 tiny model). Collective: this rank's model shard, summed over every rank, each parameter over its copies:
    the data-parallel ranks hold copies of a dense parameter, the expert-data-parallel ranks of an expert's (with
    expert parallelism, fewer: the expert-parallel ranks hold different experts)."""
    from megatron.core import parallel_state

    copies = {True: parallel_state.get_data_parallel_world_size(),  # megatron's `allreduce` flag: False for experts
              False: parallel_state.get_expert_data_parallel_world_size()}
    local = 0.0
    for chunk in policy.chunks:
        for param in chunk.parameters():
            saved = param.numel() * param.element_size() if (param.requires_grad or not adapters_only) else 0
            trained = 12 * param.numel() if param.requires_grad else 0
            local += (saved + trained) / copies[getattr(param, "allreduce", True)]
    total = torch.tensor([local], dtype=torch.float64)
    if dist.is_initialized():
        total = total.cuda() if torch.cuda.is_available() else total
        dist.all_reduce(total)
    return int(total.item())


# ---------------------------------------------------------------- loading them


def load(path: Path, chunks: list, optimizer) -> dict:
    """Load model chunks, optimizer and this rank's RNG from a checkpoint; return the loop's saved state."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load_model_and_optimizer(chunks, optimizer, path / SHARDED_DIR)
    # A truncated or corrupted shard: torch.distributed.checkpoint gathers every rank's failure (an EOFError, say) into
    # one CheckpointException, raised on every rank alike (it derives from BaseException, not Exception).
    except (Exception, CheckpointException) as error:
        damage = _damaged_shard(path / SHARDED_DIR)
        if damage is None:  # every shard whole, as its index says: the checkpoint is sound, and this run differs
            raise UserError(f"Checkpoint `{path}` cannot be loaded into this run: its shards are all there, as long as "
                            "its index says, but this run lays out its model or optimizer state otherwise "
                            f"({underlying_error(error)}). Something that shapes the state differs from the run that "
                            "saved it, such as the distributed optimizer's gradient buckets (`ddp.override_ddp_config`: "
                            "`bucket_size`, `overlap_grad_reduce`, or their defaults in the version of this trainer that "
                            "saved it); the settings that changed, if any, are named above in the line `resuming with "
                            "settings changed`. Resume with the checkpoint's settings, or start a new `train.out_dir`."
                            ) from None
        raise UserError(f"Checkpoint `{path}` cannot be loaded: {damage} ({underlying_error(error)}). Resume from an "
                        "earlier checkpoint with `--resume-from-checkpoint PATH`.") from None
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        try:
            state = torch.load(rng_file, weights_only=False)
        except Exception as error:  # a truncated or foreign file, as `trainer_state.pt`'s
            raise UserError(f"Checkpoint file `{rng_file}` cannot be read ({error}). It is corrupted; resume from an "
                            "earlier checkpoint with `--resume-from-checkpoint PATH`.") from None
        set_rng_state(state)
    else:  # resumed at another world size: this rank has no saved stream of its own
        log.warning("checkpoint %s has no RNG state for this rank; its RNG streams restart from the seed", path,
                    extra=console.ABOUT_THIS_RANK)
    return torch.load(path / STATE_FILE, weights_only=False)


def _damaged_shard(directory: Path) -> str | None:
    """Which shard file of a torch.distributed.checkpoint directory is missing or shorter than its index says, or that
    its index cannot be read; None when every shard is whole."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(directory).read_metadata().storage_data or {}
    except Exception as error:  # the index itself is unreadable
        return f"its index `{directory / '.metadata'}` cannot be read ({type(error).__name__})"
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            return f"its shard `{file}` is missing"
        if file.stat().st_size < size:
            return f"its shard `{file}` is truncated ({file.stat().st_size} of {size} bytes)"
    return None


def load_model_and_optimizer(chunks: list, optimizer, directory: Path) -> None:
    """Read model chunks and optimizer written by `save_model_and_optimizer`. Collective."""
    if uses_megatron_fsdp(chunks):
        _load_fsdp(chunks, optimizer, directory)
        return
    from megatron.core import dist_checkpointing

    materialise_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks, optimizer, is_loading=True), str(directory))
    for index, chunk in enumerate(chunks):
        if _uses_lora(chunks):
            _load_adapters(chunk.module, loaded[f"model{index}"])
        else:
            chunk.module.load_state_dict(loaded[f"model{index}"])
    # In fp32 the distributed optimizer's main parameters are views of the model's (leaf) parameters,
    # which megatron-core's dp_reshardable loader copies into in place: not a differentiable operation.
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_step_counters(optimizer)


def _load_fsdp(chunks: list, optimizer, directory: Path) -> None:
    """Megatron-FSDP: read the DTensors in place, then make the loaded weights the ones the forward uses."""
    import torch.distributed.checkpoint as dcp

    state, added = _fsdp_state_dict(chunks, optimizer, is_loading=True)
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    for name in added:  # this rank keeps no optimizer state for parameters it holds no part of
        del state["optimizer"]["state"][name]
    optimizer.load_state_dict(state["optimizer"])
    for chunk in chunks:
        # The load filled the sharded main weights; the forward all-gathers the separate compute-weight
        # buffer (and keeps some units gathered between steps). Refresh both, as an optimizer step does,
        # so the loaded weights are live from the very next forward, not only after the next step.
        chunk.module.install_optimized_model_weights()
        chunk.start_param_sync()


def materialise_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer the state tensors a checkpoint is loaded into.

    torch's AdamW (megatron-core's optimizer when neither TE nor Apex is installed) creates its state at
    the first step, and the distributed optimizer's state_dict() needs it. One zero-gradient step
    creates it, as megatron-core itself does for Megatron-FSDP; the load then overwrites every value.
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(part, "_init_optimizer_states_with_dummy_values") and not part.optimizer.state:
            part._init_optimizer_states_with_dummy_values()


def _restore_step_counters(optimizer) -> None:
    """Give every parameter its own, correct Adam step counter after a load.

    With torch's AdamW (no TE/Apex), megatron-core 0.19.2 saves the step count in the param groups,
    but after a dp_reshardable load the per-parameter `step` tensors AdamW reads keep the value of
    the zero-gradient step above (and may be one tensor shared by all parameters, which AdamW would
    increment once per parameter). Rebuild one tensor per parameter from the group's saved count.
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype, device=state["step"].device)


# ---------------------------------------------------------------- which layout


def uses_megatron_fsdp(chunks: list) -> bool:
    """Whether the chunks are wrapped in Megatron-FSDP (which checkpoints through its DTensor path)."""
    return bool(getattr(chunks[0], "ddp_config", None) and chunks[0].ddp_config.use_megatron_fsdp)


def _uses_lora(chunks: list) -> bool:
    """Whether the chunks carry LoRA adapters (checkpoints then hold the adapters, not the frozen base)."""
    return any(ADAPTER_KEY in name for name, _ in chunks[0].named_parameters())


def _adapter_state(sharded_state: dict) -> dict:
    """The adapters' entries of a chunk's sharded state dict (Megatron-Bridge's own rule for PEFT checkpoints)."""
    return {key: value for key, value in sharded_state.items() if ADAPTER_KEY in key and "_extra_state" not in key}


def _load_adapters(module, state: dict) -> None:
    """Load adapter tensors into a LoRA model; every key it has besides them must be a frozen base weight."""
    # In bf16 and fp16 the chunk's model is megatron-core's Float16Module, whose load_state_dict passes the load on to
    # the model it wraps (same keys) but returns None: ask that model, whose answer lists the keys.
    result = getattr(module, "module", module).load_state_dict(state, strict=False)
    stray = [key for key in result.missing_keys if ADAPTER_KEY in key] + list(result.unexpected_keys)
    if stray:
        raise RuntimeError(f"the checkpoint's adapters do not match the model's: {stray[:4]}")
