"""Checkpoints: megatron-core distributed checkpointing for model + optimizer, plus the loop's own state.

Layout under `ckpt.dir`:
    step_00000040/            one complete checkpoint
        model_and_optimizer/  megatron-core `dist_checkpointing` (sharded, reshardable over data parallelism)
        rng/rank_00000.pt     every rank's RNG states (Python, NumPy, torch CPU and CUDA, megatron's tracker)
        trainer_state.pt      step, LR schedule, data position, resolved config, model fingerprint
    latest                    name of the newest complete checkpoint, replaced atomically last

A save writes into `.partial-step_N/` and renames it when every rank has finished, then moves
`latest`, then prunes old checkpoints (never the one just written), so a crash at any point leaves
the previous checkpoint loadable and `latest` pointing at it.
"""

import logging
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trainer.errors import UserError

log = logging.getLogger(__name__)

LATEST = "latest"
PREFIX = "step_"
PARTIAL = ".partial-"
STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "model_and_optimizer"
# Each DP rank saves its optimizer shard as is; the format reshards over data parallelism (DP=2 -> DP=1).
# ('fully_reshardable' would also reshard TP/PP, but megatron-core 0.19.2 cannot load it into torch's
# AdamW, the optimizer used without TE/Apex: its loader expects a saved `step` tensor per parameter.)
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after `step` optimizer steps."""
    return f"{PREFIX}{step:08d}"


def model_fingerprint(hf_config: dict, parallel) -> dict:
    """What must match for a checkpoint to load into this model."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "tie_word_embeddings")
    return {"model": {key: hf_config.get(key) for key in keys}, "tp": parallel.tp, "pp": parallel.pp, "vpp": parallel.vpp}


# ---------------------------------------------------------------- what can be checkpointed


def enabled(config) -> bool:
    """Checkpoints are written for DDP runs; Megatron-FSDP's DTensor checkpoint path is not wired up yet."""
    return not config.parallel.use_megatron_fsdp


def validate(config, resume: str) -> None:
    """Refuse, at start-up, checkpoint requests a Megatron-FSDP run cannot honour yet."""
    if enabled(config):
        return
    asked = [name for name, value in (("--resume-from-checkpoint", resume), ("train.exit_interval", config.train.exit_interval),
                                      ("ckpt.save_interval", config.ckpt.save_interval)) if value]
    if asked:
        raise UserError(f"Checkpoints are not supported with `parallel.use_megatron_fsdp=true` yet, but {', '.join(asked)} "
                        "asks for them. Use DDP with the distributed optimizer (`--parallel.use_megatron_fsdp=false`, "
                        "which also shards optimizer state), or drop those settings; the final model is still "
                        "exported to `<train.out_dir>/hf/`.")


# ---------------------------------------------------------------- resolving what to resume from


def resolve_resume(resume: str, checkpoint_dir: Path, fingerprint: dict) -> tuple[Path | None, int]:
    """(checkpoint to resume from, its step), or (None, 0) to start fresh; raises UserError for anything unusable.

    Runs before any model is built, so a bad `--resume-from-checkpoint` costs nothing and overwrites nothing.
    """
    if not resume:
        return None, 0
    if resume == LATEST:
        pointer = checkpoint_dir / LATEST
        if not pointer.is_file():
            log.info("--resume-from-checkpoint latest: no checkpoint in %s yet, starting fresh", checkpoint_dir)
            return None, 0
        path = checkpoint_dir / pointer.read_text().strip()
    else:
        path = Path(resume)
        if (path / LATEST).is_file():  # a checkpoint directory rather than one checkpoint
            path = path / (path / LATEST).read_text().strip()
    if not path.is_dir():
        raise UserError(f"Checkpoint `{path}` does not exist. Check `--resume-from-checkpoint` (a checkpoint "
                        "directory, its parent `ckpt.dir`, or `latest`).")
    # `.metadata` is the index torch.distributed.checkpoint writes under megatron-core's torch_dist format.
    for required in (STATE_FILE, f"{SHARDED_DIR}/.metadata", "rng"):
        if not (path / required).exists():
            raise UserError(f"Checkpoint `{path}` is incomplete or corrupted: `{path / required}` is missing. "
                            "Resume from an earlier checkpoint with `--resume-from-checkpoint PATH`.")
    try:
        state = torch.load(path / STATE_FILE, weights_only=False)
    except Exception as error:  # a truncated or foreign file
        raise UserError(f"Checkpoint file `{path / STATE_FILE}` cannot be read ({error}). It is corrupted; "
                        "resume from an earlier checkpoint with `--resume-from-checkpoint PATH`.") from None
    if state.get("fingerprint") != fingerprint:
        raise UserError(f"Checkpoint `{path}` was saved for a different model or parallel layout: it has "
                        f"{state.get('fingerprint')}, this run has {fingerprint}. Use the same `model.path` and "
                        "`parallel.tp`/`parallel.pp`/`parallel.vpp` (data parallelism may differ).")
    return path, state["step"]


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


# ---------------------------------------------------------------- model and optimizer


def _sharded_state_dict(chunks: list, optimizer, is_loading: bool) -> dict:
    """megatron-core's sharded view of every model chunk and of the optimizer (DDP: dist_checkpointing format)."""
    model = {f"model{index}": chunk.module.sharded_state_dict() for index, chunk in enumerate(chunks)}
    optimizer_state = optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=OPTIMIZER_SHARDING)
    return {**model, "optimizer": optimizer_state}


def _save_model_and_optimizer(chunks: list, optimizer, directory: Path) -> None:
    """Write model chunks and optimizer, sharded, into `directory`. Collective."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(_sharded_state_dict(chunks, optimizer, is_loading=False), str(directory))


def _load_model_and_optimizer(chunks: list, optimizer, directory: Path) -> None:
    """Read model chunks and optimizer written by `_save_model_and_optimizer`. Collective."""
    from megatron.core import dist_checkpointing

    _materialise_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks, optimizer, is_loading=True), str(directory))
    for index, chunk in enumerate(chunks):
        chunk.module.load_state_dict(loaded[f"model{index}"])
    # In fp32 the distributed optimizer's main parameters are views of the model's (leaf) parameters,
    # which megatron-core's dp_reshardable loader copies into in place: not a differentiable operation.
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_step_counters(optimizer)


def _barrier() -> None:
    """All ranks reach this point before anyone goes on."""
    if dist.is_initialized():
        dist.barrier()


def save(checkpoint_dir: Path, step: int, chunks: list, optimizer, state: dict, keep_last: int, is_main: bool) -> Path:
    """Write a complete checkpoint atomically, point `latest` at it, prune old ones. Collective."""
    final = checkpoint_dir / checkpoint_name(step)
    partial = checkpoint_dir / f"{PARTIAL}{checkpoint_name(step)}"
    if is_main:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
        (partial / SHARDED_DIR).mkdir(parents=True)
        (partial / "rng").mkdir()
    _barrier()
    _save_model_and_optimizer(chunks, optimizer, partial / SHARDED_DIR)
    torch.save(rng_state(), partial / "rng" / f"rank_{dist.get_rank():05d}.pt")
    _barrier()
    if is_main:
        torch.save(state, partial / STATE_FILE)
        if final.exists():  # the same step saved before (a resumed run re-reaching it): replace it whole
            shutil.rmtree(final)
        os.replace(partial, final)
        pointer = checkpoint_dir / f"{LATEST}.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, checkpoint_dir / LATEST)
        _prune(checkpoint_dir, keep_last, keep=final)
        log.info("saved checkpoint %s", final)
    _barrier()
    return final


def _prune(checkpoint_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete complete checkpoints beyond the newest `keep_last` (never `keep`)."""
    complete = sorted(path for path in checkpoint_dir.glob(f"{PREFIX}*") if path.is_dir())
    for path in complete[: max(len(complete) - keep_last, 0)]:
        if path != keep:
            shutil.rmtree(path)


def _materialise_optimizer_state(optimizer) -> None:
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


def load(path: Path, chunks: list, optimizer) -> dict:
    """Load model chunks, optimizer and this rank's RNG from a checkpoint; return the loop's saved state."""
    _load_model_and_optimizer(chunks, optimizer, path / SHARDED_DIR)
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:  # resumed at another world size: this rank has no saved stream of its own
        log.warning("checkpoint %s has no RNG state for rank %d; RNG streams restart from the seed", path, dist.get_rank())
    return torch.load(path / STATE_FILE, weights_only=False)



class Preemption:
    """SIGTERM/SIGINT (torchrun forwards them) ask the loop to finish its step, save and exit 0."""

    def __init__(self):
        self.requested = False
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signal_number, self._request)

    def _request(self, signal_number, frame):
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (ranks may receive the signal at different steps)."""
        flag = torch.tensor([float(self.requested)])
        if torch.cuda.is_available():
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
