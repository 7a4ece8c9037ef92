"""Checkpoints: megatron-core distributed checkpointing for model + optimizer, plus the loop's own state.

Layout under `ckpt.dir`:
    step_00000040/            one complete checkpoint
        model_and_optimizer/  every model chunk and the optimizer, sharded, reshardable over data parallelism:
                              DDP: megatron-core `dist_checkpointing` (torch_dist format);
                              Megatron-FSDP: its own DTensors through torch.distributed.checkpoint (fsdp_dtensor)
        rng/rank_00000.pt     every rank's RNG states (Python, NumPy, torch CPU and CUDA, megatron's tracker)
        trainer_state.pt      step, LR schedule, data position, resolved config, model fingerprint
    latest                    name of the newest complete checkpoint, replaced atomically last

A save writes into `.partial-step_N/` (the model and optimizer in the background, `ckpt.async_save`), fsyncs it,
and renames it when every rank has finished, then moves `latest` (fsynced), then prunes old checkpoints (never the
one just written): `latest` names a complete checkpoint at every instant, whenever the process dies (`_publish`).
What a killed save leaves is removed at the next start-up.

A fresh run (no `--resume-from-checkpoint`) refuses a `train.out_dir` that holds an earlier run's checkpoints
or metrics, unless `train.overwrite_output_dir=true` (`check_output_dir`), so no run destroys another; no run
deletes or overwrites its own inputs (`model.path`, `data.path`).

After the last step the run's exports (`config.outputs.EXPORTS`: `hf/`, with LoRA `hf_adapter/`) are written into
`.partial-NAME/` and renamed when complete, so a directory named `hf` is whole; a resumed run that finds every step
done but an export missing or unfinished (a `.partial-NAME/` left) builds the model and writes it.
"""

import contextlib
import json
import logging
import os
import pickle
import queue
import random
import secrets
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from config import outputs
from config.cli import to_dict
from config.errors import UserError
from config.process import is_global_rank_zero
from config.sections import read_hf_config

log = logging.getLogger(__name__)

LATEST = "latest"
PREFIX = "step_"
PARTIAL = ".partial-"
REPLACED = ".replaced-"
STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "model_and_optimizer"
# Each DP rank saves its optimizer shard as is; the format reshards over data parallelism (DP=2 -> DP=1).
# ('fully_reshardable' would also reshard TP/PP, but megatron-core 0.19.2 cannot load it into torch's
# AdamW, the optimizer used without TE/Apex: its loader expects a saved `step` tensor per parameter.)
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
# Megatron-FSDP checkpoints through torch.distributed.checkpoint with one DTensor per parameter and per
# Adam moment, so they reshard over data parallelism too.
FSDP_SHARDING = {"distrib_optim_sharding_type": "fsdp_dtensor"}
# Megatron-Bridge names every LoRA adapter's parameters `<layer>.adapter.<...>`.
ADAPTER_KEY = ".adapter."


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after `step` optimizer steps."""
    return f"{PREFIX}{step:08d}"


def model_fingerprint(hf_config: dict, parallel, peft=None, model_path: Path | None = None) -> dict:
    """What must match for a checkpoint to load into this model (Megatron-FSDP and DDP write different formats).

    With LoRA a checkpoint holds the adapters only, so their settings and the base they were trained on (the
    checkpoint's weight files: names and sizes) must match too."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "tie_word_embeddings")
    fingerprint = {"model": {key: hf_config.get(key) for key in keys}, "tp": parallel.tp, "pp": parallel.pp,
                   "vpp": parallel.vpp, "megatron_fsdp": parallel.use_megatron_fsdp}
    if peft is not None and peft.method == "lora":
        fingerprint["lora"] = {"rank": peft.rank, "alpha": peft.alpha, "dropout": peft.dropout,
                               "target_modules": sorted(peft.target_modules),
                               "base": sorted((path.name, path.stat().st_size) for path in Path(model_path).glob("*.safetensors"))}
    return fingerprint


# ---------------------------------------------------------------- resolving what to resume from


def checkpoint_dir(config) -> Path:
    """`ckpt.dir`, defaulting to `<train.out_dir>/checkpoints`."""
    return Path(config.ckpt.dir or Path(config.train.out_dir) / "checkpoints")


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
    saved = state.get("fingerprint") or {}
    if saved.get("megatron_fsdp", False) != fingerprint["megatron_fsdp"]:
        saved_by, this_run = ("Megatron-FSDP", "DDP") if saved.get("megatron_fsdp") else ("DDP", "Megatron-FSDP")
        raise UserError(f"Checkpoint `{path}` was saved by a {saved_by} run and this run uses {this_run}; the two keep "
                        "model and optimizer in different formats. Resume with the same `parallel.use_megatron_fsdp` "
                        f"(`--parallel.use_megatron_fsdp={str(not fingerprint['megatron_fsdp']).lower()}`).")
    if saved.get("lora") != fingerprint.get("lora"):
        raise UserError(f"Checkpoint `{path}` was saved with {_describe_lora(saved)} and this run uses "
                        f"{_describe_lora(fingerprint)}: LoRA adapters load only onto the base and settings they were "
                        "trained with. Use the checkpoint's `model.path` and `peft.*` settings, or start a new "
                        "`train.out_dir`.")
    if saved != fingerprint:
        raise UserError(f"Checkpoint `{path}` was saved for a different model or parallel layout: it has "
                        f"{state.get('fingerprint')}, this run has {fingerprint}. Use the same `model.path` and "
                        "`parallel.tp`/`parallel.pp`/`parallel.vpp` (data parallelism may differ).")
    return path, state["step"]


def _earlier_run(config) -> list[Path]:
    """What an earlier run left in `train.out_dir` and `ckpt.dir` that this run would write over or delete: its
    checkpoints (complete, partial, replaced, the pointer) and every run output (`config.outputs.RUN_OUTPUTS`, and
    exports being written)."""
    out_dir, directory = Path(config.train.out_dir), checkpoint_dir(config)
    saves = [*directory.glob(f"{PREFIX}*"), *directory.glob(f"{PARTIAL}*"), *directory.glob(f"{REPLACED}*"),
             directory / LATEST]
    run_outputs = [out_dir / name for name in outputs.RUN_OUTPUTS] + [out_dir / f"{outputs.PARTIAL}{name}"
                                                                      for name in outputs.EXPORTS]
    return sorted(path for path in saves + run_outputs if path.exists())


def _inside(path: Path, directory: Path) -> bool:
    """Whether `path` is `directory` or lies under it (both resolved, so links and `..` do not hide it)."""
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def _check_inputs_survive(config, replaced: list[Path], action: str) -> None:
    """Refuse a run that would delete or overwrite its own inputs: `model.path` and a `data.path` on disk."""
    for key, value in (("model.path", config.model.path), ("data.path", config.data.path)):
        if not value or not Path(value).exists():  # `tiny`, a bundled task or a hub dataset name
            continue
        hit = next((path for path in replaced if _inside(Path(value), path)), None)
        if hit is not None:
            raise UserError(f"`{key}={value}` lies inside `{hit}`, which this run {action}, so it would destroy its "
                            f"own input. Copy the input elsewhere and point `--{key}` at the copy, or write this run to "
                            "another `--train.out_dir`.")


def check_output_dir(config, resume: str, is_main: bool) -> None:
    """Refuse a fresh run whose `train.out_dir` holds an earlier run's checkpoints or metrics (before any work), or
    with `train.overwrite_output_dir=true` delete them first (global rank 0). A resumed run continues them. Any run
    is refused when its exports would replace `model.path` or `data.path`, or its overwrite would delete them."""
    out_dir = Path(config.train.out_dir)
    _check_inputs_survive(config, [out_dir / name for name in outputs.EXPORTS],
                          "writes after its last step (its Hugging Face export)")
    if resume:
        return
    earlier = _earlier_run(config)
    if not any(path.name == outputs.METRICS or path.name.startswith(PREFIX) or path.name == LATEST
               for path in earlier):
        return
    if not config.train.overwrite_output_dir:
        raise UserError(
            f"`train.out_dir={out_dir}` holds an earlier run ({', '.join(f'`{path}`' for path in earlier[:3])}"
            f"{', ...' if len(earlier) > 3 else ''}), and this run would overwrite its checkpoints and metrics. Continue "
            "it with `--resume-from-checkpoint latest`, write this run elsewhere with a new `--train.out_dir`, or "
            "replace it with `--train.overwrite_output_dir=true` (deletes its checkpoints and metrics first).")
    _check_inputs_survive(config, earlier, "deletes first (`train.overwrite_output_dir=true`)")
    if is_main:
        log.warning("train.overwrite_output_dir=true: deleting the earlier run's checkpoints and outputs in %s", out_dir)
        for path in earlier:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


def _describe_lora(fingerprint: dict) -> str:
    """A fingerprint's LoRA settings in words."""
    settings = fingerprint.get("lora")
    if settings is None:
        return "full fine-tuning (no LoRA)"
    base = ", ".join(f"{name} {size} B" for name, size in settings["base"])
    return (f"LoRA rank {settings['rank']}, alpha {settings['alpha']:g}, dropout {settings['dropout']:g} on "
            f"{', '.join(settings['target_modules'])} over a base of {base}")


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
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_fp8_extra_state_case

    state = {}
    for index, chunk in enumerate(chunks):
        state[f"model{index}"] = chunk.state_dict()
        handle_fp8_extra_state_case(state[f"model{index}"])  # TE's FP8 scaling metadata is not a weight
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


def _save_model_and_optimizer(chunks: list, optimizer, directory: Path, background: bool):
    """Write model chunks and optimizer, sharded, into `directory`. Collective.

    DDP goes through megatron-core's dist_checkpointing with its fully parallel strategy (replicated tensors written
    by the data-parallel ranks in turn, not all by one). With `background`, only the plan is made here (collective)
    and megatron-core's `AsyncRequest` is returned: its write runs in a forked process (`BackgroundSaves`), its
    finalize functions write the index once every rank's part is on disk. Megatron-FSDP writes its DTensors through
    torch.distributed.checkpoint, synchronously."""
    if _uses_megatron_fsdp(chunks):
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


class WriteResults:
    """The channel megatron-core's checkpoint writer hands its results (or its exception) back through: a file.

    megatron-core 0.19.2 writes a checkpoint's shards in `write_preloaded_data_multithread`, in this process for a
    synchronous save and in a forked one for an asynchronous save, and hands the results to the finalize step through
    a module-level queue it otherwise creates as a multiprocessing Manager queue with the 'spawn' start method: a new
    Python process per rank that re-imports the main module (8.6 s on the first save here) and outlives a trainer
    killed with -9. A plain pipe would not do either: a writer whose results exceed the pipe's buffer (64 KiB, about
    300 tensors' results) blocks at exit until they are read, and they are read only after it exits. So the writer
    puts them into a file in the temporary directory (one per process, named by host, pid and a random token; a second
    save waits for the first; not on the checkpoint's disk, which may be the one that is full), and the finalize step
    reads and deletes it: results that are missing or unreadable are a failed write. A writer's failure comes back
    with the error text the writer only logged (`[Errno 28] No space left on device`), as an OSError, which the
    finalize step's exception names.
    """

    _installed = None

    def __init__(self):
        # Containers sharing /tmp may run trainers with the same pid: the host name and a random token keep them apart.
        name = f"megatron-trainer-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.write-results"
        self.path = Path(tempfile.gettempdir()) / name
        self.logged = []

    @classmethod
    def install(cls) -> "WriteResults":
        """Make this process's channel megatron-core's queue, for the save about to be written."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if cls._installed is None:
            cls._installed = cls()
        filesystem_async._results_queue = cls._installed
        cls._installed.path.unlink(missing_ok=True)
        cls._installed.logged = []
        return cls._installed

    @contextlib.contextmanager
    def capturing(self):
        """Keep what the writer logs inside the block for `put` (one paragraph later, no lines of the writer's own)."""
        with _writer_errors() as self.logged:
            yield

    def put(self, results) -> None:
        """Called by the writer (in the writing process): the results, or its exception with what it logged. Never
        raises: results it cannot write (the temporary directory full too) are missing, which is a failed write."""
        if isinstance(results, Exception):
            # The writer's summary names no cause (`error: <class 'OSError'>`); its log has the OSError's text.
            cause = next((text for text in self.logged if "[Errno" in text), self.logged[0] if self.logged else None)
            if cause is not None:
                text = cause.rpartition("an error: ")[2]
                results = (OSError if "[Errno" in text else RuntimeError)(text)
        try:
            with open(self.path, "wb") as file:
                pickle.dump(results, file)
        except OSError:
            self.path.unlink(missing_ok=True)

    def get_nowait(self):
        """Called by the finalize step: what the writer put (read once: the file is deleted)."""
        try:
            with open(self.path, "rb") as file:
                results = pickle.load(file)
        except FileNotFoundError:
            raise queue.Empty from None
        except Exception as error:  # a results file the writer could not finish
            results = RuntimeError(f"the checkpoint writer's results are unreadable ({type(error).__name__})")
        self.path.unlink(missing_ok=True)
        return results


def _in_writer_process(write, trainer_pid: int):
    """megatron-core's write function as the forked writer process runs it: it dies with the trainer (a writer left
    behind by a trainer killed with -9 would go on writing into a checkpoint the next start-up deletes), and what its
    threads log on failure comes back in the results (`WriteResults`) instead of on the console."""

    def run(*args, **kwargs):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not Linux: the writer outlives a killed trainer, and finishes its write
            pass
        if os.getppid() != trainer_pid:  # the trainer died before the line above
            os._exit(1)
        try:
            with WriteResults._installed.capturing():
                write(*args, **kwargs)
        except BaseException:  # no results: the finalize step reports the failed write
            os._exit(1)

    return run


class BackgroundSaves:
    """Checkpoint writes in flight, through megatron-core's `AsyncCallsQueue`: each save's write runs in a process
    forked from this one (megatron-core's `TemporalAsyncCaller`; on a GPU the tensors are first copied to host memory,
    on a CPU the fork's copy-on-write pages are the snapshot), and its finalize functions (the checkpoint's index,
    then `save`'s publish: rename, `latest`, prune) run on every rank once every rank's writer has finished.
    `finish` is collective while a save is in flight."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.calls = AsyncCallsQueue(persistent=False)

    def start(self, request, finalize) -> None:
        """Start writing `request` (megatron-core's AsyncRequest) in the background; `finalize` runs when done."""
        if request.async_fn is not None:  # None: this rank has nothing to write
            request = request._replace(async_fn=_in_writer_process(request.async_fn, os.getpid()))
        self.calls.schedule_async_request(request._replace(finalize_fns=[finalize]))

    def pending(self) -> bool:
        """Whether a save is written or waits to be finalized (the same on every rank)."""
        return self.calls.get_num_unfinalized_calls() > 0

    def finish(self, wait: bool) -> None:
        """Finalize every save whose write has finished on every rank; with `wait`, wait for all of them first."""
        if self.pending():
            self.calls.maybe_finalize_async_calls(blocking=wait)


def _load_model_and_optimizer(chunks: list, optimizer, directory: Path) -> None:
    """Read model chunks and optimizer written by `_save_model_and_optimizer`. Collective."""
    if _uses_megatron_fsdp(chunks):
        _load_fsdp(chunks, optimizer, directory)
        return
    from megatron.core import dist_checkpointing

    _materialise_optimizer_state(optimizer)
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


def _uses_lora(chunks: list) -> bool:
    """Whether the chunks carry LoRA adapters (checkpoints then hold the adapters, not the frozen base)."""
    return any(ADAPTER_KEY in name for name, _ in chunks[0].named_parameters())


def _adapter_state(sharded_state: dict) -> dict:
    """The adapters' entries of a chunk's sharded state dict (Megatron-Bridge's own rule for PEFT checkpoints)."""
    return {key: value for key, value in sharded_state.items() if ADAPTER_KEY in key and "_extra_state" not in key}


def _load_adapters(module, state: dict) -> None:
    """Load adapter tensors into a LoRA model; every key it has besides them must be a frozen base weight."""
    result = module.load_state_dict(state, strict=False)
    stray = [key for key in result.missing_keys if ADAPTER_KEY in key] + list(result.unexpected_keys)
    if stray:
        raise RuntimeError(f"the checkpoint's adapters do not match the model's: {stray[:4]}")


def _uses_megatron_fsdp(chunks: list) -> bool:
    """Whether the chunks are wrapped in Megatron-FSDP (which checkpoints through its DTensor path)."""
    return bool(getattr(chunks[0], "ddp_config", None) and chunks[0].ddp_config.use_megatron_fsdp)


def _barrier() -> None:
    """All ranks reach this point before anyone goes on."""
    if dist.is_initialized():
        dist.barrier()


def save(checkpoint_dir: Path, step: int, chunks: list, optimizer, state: dict, keep_last: int, is_main: bool,
         save_bytes: tuple[int, str] = (0, ""), background: "BackgroundSaves | None" = None, on_published=None) -> Path:
    """Write a complete checkpoint atomically, point `latest` at it, prune old ones. Collective.

    With `background`, the model and optimizer shards are written by a forked process while training goes on (the
    RNG and trainer state, small, are written now), and the checkpoint is published when `background.finish` finds
    every rank's write done; until then `latest` names the previous one. `on_published(path)` runs on every rank
    after the publish.

    Each phase ends with every rank learning whether any rank's part failed (a full disk, a quota, permissions);
    then every rank raises the same one-paragraph UserError (`_save_failed`, with `save_bytes`: the bytes one save
    needs and how that is known), so no rank waits for a peer that stopped and none prints a traceback."""
    final = checkpoint_dir / checkpoint_name(step)
    partial = checkpoint_dir / f"{PARTIAL}{checkpoint_name(step)}"
    written = []  # megatron-core's AsyncRequest with `background`, else None (written already)

    def prepare():
        if is_main:
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            (partial / SHARDED_DIR).mkdir(parents=True)
            (partial / "rng").mkdir()

    def write():  # torch.distributed.checkpoint raises a rank's write failure on every rank alike
        written.append(_save_model_and_optimizer(chunks, optimizer, partial / SHARDED_DIR, background is not None))
        _write_durably(partial / "rng" / f"rank_{dist.get_rank():05d}.pt", rng_state())
        if is_main:
            _write_durably(partial / STATE_FILE, state)

    def publish():
        if is_main:
            _fsync_tree(partial)
            _publish(checkpoint_dir, partial, final)
            _prune(checkpoint_dir, keep_last, keep=final)
            log.info("saved checkpoint %s", final)

    def run(*phases) -> None:
        for phase in phases:
            failures = _failures_everywhere(phase)
            if failures:
                raise UserError(_save_failed(checkpoint_dir, step, failures, save_bytes, keep_last))

    def finalize(megatron_fns=()):  # megatron-core's finalize functions (the index), then the publish
        run(*megatron_fns, publish)
        if on_published is not None:
            on_published(final)

    run(prepare, write)
    request = written[0]
    if request is None:
        finalize()
    else:
        background.start(request, lambda: finalize(request.finalize_fns))
    return final


def _tree_bytes(root: Path) -> int:
    """Bytes of the files under `root`."""
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def _estimated_save_bytes(policy, adapters_only: bool) -> int:
    """Bytes of one checkpoint: the saved weights in their dtype (with LoRA the adapters only) plus 12 bytes per
    trained parameter (the optimizer's fp32 main copy and Adam's two moments; measured: 16.3 bytes per parameter of
    the fp32 tiny model). Collective: this rank's model shard, summed over every rank, over the data-parallel copies."""
    from megatron.core import parallel_state

    parameters = [param for chunk in policy.chunks for param in chunk.parameters()]
    trained = [param for param in parameters if param.requires_grad]
    saved = trained if adapters_only else parameters
    local = sum(param.numel() * param.element_size() for param in saved) + 12 * sum(param.numel() for param in trained)
    total = torch.tensor([float(local)], dtype=torch.float64)
    if dist.is_initialized():
        total = total.cuda() if torch.cuda.is_available() else total
        dist.all_reduce(total)
    return int(total.item() / parallel_state.get_data_parallel_world_size())


# megatron-core's checkpoint writer logs each writer thread's exception here (an OSError's text among them) and then
# raises a summary without it.
WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


@contextlib.contextmanager
def _writer_errors():
    """The error messages megatron-core's checkpoint writer logs inside the block, kept for the failure paragraph
    instead of printed (one paragraph, no lines of the writer's own)."""
    messages = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: messages.append(record.getMessage())
    writer_log = logging.getLogger(WRITER_LOGGER)
    propagate = writer_log.propagate
    writer_log.addHandler(handler)
    writer_log.propagate = False
    try:
        yield messages
    finally:
        writer_log.removeHandler(handler)
        writer_log.propagate = propagate


def _failures_everywhere(phase) -> list[tuple[int, str]]:
    """Run `phase` on this rank; return every rank's failure as (rank, `Type: message`), [] when all succeeded.
    Collective (in place of a barrier)."""
    from torch.distributed.checkpoint.api import CheckpointException

    failure = None
    try:
        phase()
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        failure = _underlying_error(error)
    outcomes = [(0, failure)]
    if dist.is_initialized():
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (dist.get_rank(), failure))
    return [(rank, text) for rank, text in outcomes if text]


def _size(nbytes: float) -> str:
    """Bytes in words: `13.1 MB`, `2.4 GB`."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""


def _save_failed(checkpoint_dir: Path, step: int, failures: list, save_bytes: tuple[int, str], keep_last: int) -> str:
    """The paragraph a failed save ends the run with: where, why, what one save needs, and what `latest` still holds."""
    rank, text = failures[0]
    others = f", and on {len(failures) - 1} more rank(s)" if len(failures) > 1 else ""
    free = shutil.disk_usage(checkpoint_dir).free if checkpoint_dir.is_dir() else 0
    needs, how = save_bytes
    if "No space left on device" not in text and free < max(needs, 1):
        # torch.save reports a full disk as `unexpected pos N vs M`; the free space says what happened.
        text = f"No space left on device (the file system is full; the writer reported {text})"
    need = f" and one checkpoint needs about {_size(needs)} ({how}); a save writes a new one before deleting the " \
           f"oldest of `ckpt.keep_last={keep_last}`" if needs else ""
    pointer = checkpoint_dir / LATEST
    if pointer.is_file():
        latest = pointer.read_text().strip()
        resume = (f"`latest` still names `{latest}`, a complete checkpoint: make room (or move `{checkpoint_dir}` to a "
                  "larger disk and set `--ckpt.dir` there) and continue with `--resume-from-checkpoint latest`; the "
                  "partial save is removed then")
    else:
        resume = ("no complete checkpoint was written before, so the run starts again from step 0: make room, or set "
                  "`--ckpt.dir` on a larger disk")
    return (f"Saving the checkpoint of step {step} into `{checkpoint_dir}` failed on rank {rank}{others}: {text}. "
            f"`{checkpoint_dir}` has {_size(free)} free{need}. {resume}.")


def _export_failed(staged: dict, text: str, model_path: Path, checkpoint_dir: Path) -> str:
    """The paragraph a failed export ends the run with: where, why, what the export needs, and how to write it."""
    where = " and ".join(f"`{path}`" for path in staged.values())
    out_dir = next(iter(staged.values())).parent
    # The rerun deletes the partial export before writing a new one: its space counts as available.
    available = shutil.disk_usage(out_dir).free + sum(_tree_bytes(path) for path in staged.values() if path.is_dir())
    needs = sum(path.stat().st_size for path in model_path.glob("*.safetensors"))
    pointer = checkpoint_dir / LATEST
    latest = f"`{pointer.read_text().strip()}`" if pointer.is_file() else "the last one"
    return (f"Writing the run's export into {where} failed on rank {dist.get_rank()}: {text}. `{out_dir}` has "
            f"{_size(available)} available for it, and the export needs about {_size(needs)} (the weights in "
            f"`{model_path}`). The run's checkpoint {latest}, which `latest` in `{checkpoint_dir}` names, is complete and "
            "intact: make room (or fix what the error names) and rerun with `--resume-from-checkpoint latest`, which "
            "writes the export without training again.")


def _publish(checkpoint_dir: Path, partial: Path, final: Path) -> None:
    """Rename the complete `partial` to `final` and point `latest` at it, such that `latest` names a complete
    checkpoint at every instant, whenever the process dies.

    When `final` exists already (a resumed run re-reaching a step it saved before), `latest` may name it: the
    pointer first names the new save, then the old one moved aside, then the new one under its final name; the
    old one is deleted last. A pointer left on either by a crash is still a complete checkpoint.
    """
    if final.exists():
        replaced = checkpoint_dir / f"{REPLACED}{final.name}"
        _point_latest(checkpoint_dir, partial.name)
        shutil.rmtree(replaced, ignore_errors=True)  # an older crash's leftover, which `latest` may have named
        os.replace(final, replaced)
        _point_latest(checkpoint_dir, replaced.name)
        os.replace(partial, final)
        _point_latest(checkpoint_dir, final.name)
        shutil.rmtree(replaced)
    else:
        os.replace(partial, final)
        _point_latest(checkpoint_dir, final.name)


def _point_latest(checkpoint_dir: Path, name: str) -> None:
    """Replace the `latest` pointer atomically and durably (the new name is on disk before and after the rename)."""
    pointer = checkpoint_dir / f"{LATEST}.tmp"
    with open(pointer, "w") as file:
        file.write(name)
        file.flush()
        os.fsync(file.fileno())
    os.replace(pointer, checkpoint_dir / LATEST)
    _fsync_directory(checkpoint_dir)


def _write_durably(path: Path, state) -> None:
    """`torch.save` and fsync: a checkpoint published afterwards never holds a half-written file after a power loss."""
    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())


def _fsync_directory(directory: Path) -> None:
    """Make the names in `directory` (renames, new entries) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (the shards torch.distributed.checkpoint wrote included)."""
    for directory, _, files in os.walk(root):
        for name in files:
            descriptor = os.open(Path(directory) / name, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        _fsync_directory(Path(directory))


def clean_stale_saves(checkpoint_dir: Path) -> None:
    """Delete what saves killed midway left in `checkpoint_dir` (partial and replaced checkpoints, a pointer being
    written), except a directory `latest` names. Called by global rank 0 at start-up."""
    if not checkpoint_dir.is_dir():
        return
    pointer = checkpoint_dir / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    for path in [*checkpoint_dir.glob(f"{PARTIAL}*"), *checkpoint_dir.glob(f"{REPLACED}*")]:
        if path.name != named:
            log.info("removing %s, left by a save that did not finish", path)
            shutil.rmtree(path, ignore_errors=True)
    (checkpoint_dir / f"{LATEST}.tmp").unlink(missing_ok=True)


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


def _damaged_shard(directory: Path) -> str:
    """Which shard file of a torch.distributed.checkpoint directory is missing or shorter than its index says."""
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
    return f"its model/optimizer shards in `{directory}` are corrupted"


def _underlying_error(error: BaseException) -> str:
    """The first rank's own exception inside torch.distributed.checkpoint's wrapper (and an OSError under a wrapper of
    its writer threads, such as `Local worker 0 encountered an error`), as `Type: message` on one line."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    error = cause if cause is not None else error
    text = " ".join(str(error).split())[:300]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def load(path: Path, chunks: list, optimizer) -> dict:
    """Load model chunks, optimizer and this rank's RNG from a checkpoint; return the loop's saved state."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _load_model_and_optimizer(chunks, optimizer, path / SHARDED_DIR)
    # A truncated or corrupted shard: torch.distributed.checkpoint gathers every rank's failure (an EOFError, say) into
    # one CheckpointException, raised on every rank alike (it derives from BaseException, not Exception).
    except (Exception, CheckpointException) as error:
        raise UserError(f"Checkpoint `{path}` cannot be loaded: {_damaged_shard(path / SHARDED_DIR)} "
                        f"({_underlying_error(error)}). Resume from an earlier checkpoint with "
                        "`--resume-from-checkpoint PATH`.") from None
    rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:  # resumed at another world size: this rank has no saved stream of its own
        log.warning("checkpoint %s has no RNG state for rank %d; RNG streams restart from the seed", path, dist.get_rank())
    return torch.load(path / STATE_FILE, weights_only=False)


# A signal this soon after the first is the same stop request delivered twice: a terminal's Ctrl-C reaches every
# worker directly and again through torchrun, which passes on what it receives, as it does Slurm's SIGTERM to every
# process of a job step.
REPEAT_AFTER_S = 2.0


class Preemption:
    """SIGTERM/SIGINT (torchrun forwards them) ask the loop to finish its step, save and exit 0.

    One per process, caught from the moment the command line is parsed (`catch_stop_signals`): a signal during
    start-up, the model build, or between GRPO's default SFT and GRPO is kept and honoured at the first step's end.
    A second signal (more than `REPEAT_AFTER_S` after the first) stops the process at once, wherever it waits (a
    background save's writer included), with one line and status 128 + the signal's number, as a shell reports a
    process the signal killed. The save in flight is abandoned; `latest` moves only when a save is complete."""

    _installed = None

    def __init__(self):
        self.requested = self.requested_anywhere = False
        self.first_signal_at = None
        self.checkpoint_dir = None  # the run's `ckpt.dir`, once a Checkpointer knows it: named by a second signal
        self.pid = os.getpid()
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signal_number, self._request)

    def _request(self, signal_number, frame):
        if os.getpid() != self.pid:  # a forked checkpoint writer: it dies with the trainer (`_in_writer_process`)
            return
        now = time.monotonic()
        if self.first_signal_at is None:
            self.first_signal_at = now
        elif now - self.first_signal_at > REPEAT_AFTER_S:
            self._stop_now(signal_number)
        self.requested = True

    def _stop_now(self, signal_number) -> None:
        """End this process now, after one line on global rank 0 (written directly: the interrupted code may be
        inside a print). Its forked checkpoint writer dies with it."""
        if is_global_rank_zero():
            os.write(2, f"{self._abandoned(signal.Signals(signal_number).name)}\n".encode())
        os._exit(128 + signal_number)

    def _abandoned(self, signal_name: str) -> str:
        """The line a second signal ends the run with: what was lost, and what to resume from."""
        pointer = self.checkpoint_dir / LATEST if self.checkpoint_dir is not None else None
        if pointer is not None and pointer.is_file():
            latest = f"`{pointer.read_text().strip()}` in `{self.checkpoint_dir}`, the last complete checkpoint"
        else:
            latest = "the last complete checkpoint"
        return (f"stopped at once by a second {signal_name}: the checkpoint save in flight, if any, is abandoned, and "
                f"`latest` still names {latest} (continue with `--resume-from-checkpoint latest`)")

    def agreed(self) -> bool:
        """True on every rank once any rank was signalled (ranks may receive the signal at different steps)."""
        flag = torch.tensor([float(self.requested)])
        if torch.cuda.is_available():
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.requested_anywhere = bool(flag.item())
        return self.requested_anywhere


def catch_stop_signals() -> Preemption:
    """This process's stop-signal catcher, installed on the first call (the loops call it right after parsing)."""
    if Preemption._installed is None:
        Preemption._installed = Preemption()
    return Preemption._installed


def check_shared_directories(config) -> None:
    """Every rank sees the directories global rank 0 sees (`train.out_dir`, `ckpt.dir`): rank 0 writes a token into
    each (into its nearest existing parent when it does not exist yet: nothing is created), every rank reads it back
    at the same path, resolved on its own node. A node with a node-local directory is named now, not at the first
    save hours in. Collective; nothing to do on one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    directories = list(dict.fromkeys([Path(config.train.out_dir), checkpoint_dir(config)]))
    box = [None]
    if is_global_rank_zero():  # the token, and how many levels up each directory's nearest existing parent is
        box = [(f"{os.getpid()}-{time.time_ns()}",
                [next(level for level, path in enumerate([directory, *directory.parents]) if path.exists())
                 for directory in directories])]
    dist.broadcast_object_list(box, src=0)
    token, levels = box[0]
    probes = [([directory, *directory.parents][level]) / f".rank0-sees-this-{token}"
              for directory, level in zip(directories, levels)]
    if is_global_rank_zero():
        for probe in probes:
            probe.write_text(token)
    _barrier()
    unseen = [str(directory) for directory, probe in zip(directories, probes)
              if not (probe.is_file() and probe.read_text() == token)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank(), socket.gethostname(), unseen))
    if is_global_rank_zero():
        for probe in probes:
            probe.unlink(missing_ok=True)
    blind = [(rank, host, missing) for rank, host, missing in everyone if missing]
    if blind:
        where = "; ".join(f"rank {rank} on {host} cannot see {', '.join(f'`{path}`' for path in missing)}"
                          for rank, host, missing in blind[:4])
        raise UserError(f"Every process must see the run's directories as global rank 0 does, to write its part of "
                        f"each checkpoint there, but {where}{'; ...' if len(blind) > 4 else ''}. Put `train.out_dir` "
                        "(and `ckpt.dir`) on a file system every node mounts at the same path (docs/nodes.md).")


# ---------------------------------------------------------------- the run's checkpointer


class Checkpointer:
    """Saves and restores one run's named stateful parts: the policy's model chunks and optimizer (sharded),
    every rank's RNG, and any objects with `state_dict()` / `load_state_dict()` (LR schedule, data position).
    After the last step it also writes the run's output, the trained model as a Hugging Face checkpoint."""

    def __init__(self, config, resume: str, model_path: Path):
        """Resolve what to resume from before any model is built: a bad target costs nothing and overwrites nothing."""
        self.config = config
        self.directory, self.model_path = checkpoint_dir(config), Path(model_path)
        self.fingerprint = model_fingerprint(read_hf_config(model_path, "model.path"), config.parallel, config.peft,
                                             model_path)
        self.resume_path, self.resume_step = resolve_resume(resume, self.directory, self.fingerprint)
        self.policy, self.parts, self.preemption = None, {}, catch_stop_signals()
        self.preemption.checkpoint_dir = self.directory
        self.save_bytes = (0, "")  # what one save needs, and how that is known (`track`, then each save)
        self.background = BackgroundSaves() if config.ckpt.async_save else None
        self.slowest_step_s, self.last_save_s = 0.0, 0.0  # what a scheduler's stop warning must cover
        if is_global_rank_zero():
            clean_stale_saves(self.directory)

    def _missing_exports(self) -> list[str]:
        """The exports a finished run has not written (completely) yet: absent, or an export of them began and did not
        finish (its `.partial-NAME/` is left; an `hf/` beside it is an earlier finish's)."""
        names = outputs.EXPORTS if self.config.peft.method == "lora" else (outputs.HF,)
        out_dir = Path(self.config.train.out_dir)
        return [name for name in names
                if not (out_dir / name).is_dir() or (out_dir / f"{outputs.PARTIAL}{name}").exists()]

    def finished(self) -> bool:
        """Whether the checkpoint resumed from has already run every step and the run's exports are written (said
        once, then there is nothing to do). A finished run whose export is missing goes on to write it."""
        if self.resume_step < self.config.train.steps:
            return False
        missing = self._missing_exports()
        if missing:
            log.info("this run finished all %d steps (checkpoint %s) but its export %s was not written (completely): "
                     "building the model to write it", self.config.train.steps, self.resume_path,
                     ", ".join(f"{name}/" for name in missing))
            return False
        log.info("this run already finished all %d steps (checkpoint %s); nothing to do", self.config.train.steps,
                 self.resume_path)
        return True

    def track(self, policy, **parts) -> None:
        """Name what a checkpoint holds (stop signals are caught since start-up: see `catch_stop_signals`), and warn
        when `ckpt.dir` has room for fewer than two checkpoints (estimated from the parameters). Collective."""
        self.policy, self.parts = policy, parts
        if self.background is not None and _uses_megatron_fsdp(policy.chunks):
            self.background = None
            if is_global_rank_zero():
                log.info("ckpt.async_save: Megatron-FSDP saves synchronously (its DTensor checkpoints go through "
                         "torch.distributed.checkpoint, which megatron-core's asynchronous saving does not cover)")
        estimate = _estimated_save_bytes(policy, self.config.peft.method == "lora")
        self.save_bytes = (estimate, "estimated from the parameters and their Adam state")
        existing = next(path for path in (self.directory, *self.directory.parents) if path.exists())
        free = shutil.disk_usage(existing).free
        if free < 2 * estimate and is_global_rank_zero():
            log.warning("`ckpt.dir=%s` has %s free, and one checkpoint needs about %s (%s); a save writes a new one "
                        "before deleting the oldest, so saves may fail for space. Make room, or set `--ckpt.dir` on a "
                        "larger disk.", self.directory, _size(free), _size(estimate), self.save_bytes[1])

    def resume(self) -> int:
        """Load every tracked part from the resume target; returns the step to continue after (0: fresh start)."""
        if self.resume_path is None:
            return 0
        state = load(self.resume_path, self.policy.chunks, self.policy.optimizer)
        for name, part in self.parts.items():
            part.load_state_dict(state[name])
        log.info("resumed from %s at step %d", self.resume_path, state["step"])
        return state["step"]

    def save(self, step: int) -> Path:
        """Write every tracked part after `step` (in the background with `ckpt.async_save`, once the previous save is
        published). Collective."""
        started = time.perf_counter()
        self.wait()  # a second save waits for the first
        state = {"step": step, "config": to_dict(self.config), "fingerprint": self.fingerprint,
                 **{name: part.state_dict() for name, part in self.parts.items()}}
        self.policy.sync_parameters()  # with overlapped parameter gathering, the last step's gather may be in flight
        path = save(self.directory, step, self.policy.chunks, self.policy.optimizer, state, self.config.ckpt.keep_last,
                    is_global_rank_zero(), self.save_bytes, self.background, self._published)
        self.last_save_s = time.perf_counter() - started
        return path

    def _published(self, path: Path) -> None:
        """After a checkpoint is published: what one save needs is now its measured size."""
        if is_global_rank_zero():
            self.save_bytes = (_tree_bytes(path), f"the size of `{path.name}`")

    def wait(self) -> None:
        """Wait for the save in flight and publish it (before an export, and before the run exits). Collective."""
        if self.background is not None:
            self.background.finish(wait=True)

    def maybe_save_or_export(self, step: int, step_seconds: float = 0.0) -> bool:
        """Save after `step` when due (ckpt.save_interval, the last step, train.exit_interval, a signal), and export
        the model after the last; True: stop now (a stopped run exports nothing: it is resumed, not finished). A
        background save whose write has finished everywhere is published here; a run that stops waits for its last.

        Every way out of a loop passes through a save here, so no parameter gather is in flight at shutdown."""
        train = self.config.train
        self.slowest_step_s = max(self.slowest_step_s, step_seconds)
        if self.background is not None:
            self.background.finish(wait=False)
        stop = self.preemption.agreed() or step == train.exit_interval
        interval = self.config.ckpt.save_interval
        if stop or step == train.steps or (interval and step % interval == 0):
            path = self.save(step)
        if stop or step == train.steps:
            started = time.perf_counter()
            self.wait()
            self.last_save_s += time.perf_counter() - started
        if step == train.steps:
            self.export()
        if stop and self.preemption.requested_anywhere:
            log.info("stopping at step %d (signal); slowest step %.1f s, this save %.1f s: a scheduler's stop warning "
                     "must cover a step and a save. Resume with --resume-from-checkpoint latest", step,
                     self.slowest_step_s, self.last_save_s)
            if is_global_rank_zero() and os.environ.get(STOP_FILE_VARIABLE):
                _write_stop_file(Path(os.environ[STOP_FILE_VARIABLE]), step, path)
        elif stop:
            log.info("stopping at step %d (train.exit_interval); resume with --resume-from-checkpoint latest", step)
        return stop


    def export(self) -> None:
        """Write the run's exports (`hf/`, with LoRA `hf_adapter/`) into `.partial-NAME/`, fsync them and rename them
        (replacing an earlier export of the same name), so a directory named `hf` is always complete. Collective.

        A failure (a full disk, a quota) ends the run with one paragraph (`_export_failed`) and leaves what a killed
        export leaves: `.partial-NAME/` and any earlier export as it was, so a rerun writes it (`finished`)."""
        out_dir, is_main = Path(self.config.train.out_dir), is_global_rank_zero()
        staged = {name: out_dir / f"{outputs.PARTIAL}{name}" for name in self.policy.exports()}
        try:
            self._stage_exports(staged, is_main)
        except Exception as error:  # rank 0's own (only it writes); a peer's, its next collective once rank 0 has left
            raise UserError(_export_failed(staged, _underlying_error(error), self.model_path, self.directory)) from None
        if is_main:
            for name, path in staged.items():
                final, replaced = out_dir / name, out_dir / f"{REPLACED}{name}"
                if final.exists():  # the export of an earlier finish, replaced whole
                    shutil.rmtree(replaced, ignore_errors=True)
                    os.replace(final, replaced)
                os.replace(path, final)
                shutil.rmtree(replaced, ignore_errors=True)
            _fsync_directory(out_dir)
            log.info("saved the model as a Hugging Face checkpoint in %s%s", out_dir / outputs.HF,
                     f", its LoRA adapter in PEFT format in {out_dir / outputs.HF_ADAPTER}" if len(staged) > 1 else "")
        _barrier()

    def _stage_exports(self, staged: dict, is_main: bool) -> None:
        """Write the exports into their `.partial-NAME/` directories, durably (global rank 0 writes). Collective."""
        if is_main:
            for path in staged.values():
                shutil.rmtree(path, ignore_errors=True)  # left by an export that was killed or failed
                path.mkdir(parents=True)
        _barrier()
        self.policy.export(staged, is_main)
        _barrier()
        if is_main:
            for path in staged.values():
                _fsync_tree(path)

    def export_if_already_finished(self, start_step: int) -> None:
        """After a loop that had no step left to run (a resume of a finished run whose export was missing): export."""
        if start_step >= self.config.train.steps:
            self.export()


# A scheduler script names this file; a run stopped by a signal writes it after its checkpoint is saved, so the
# script requeues that run and not one that crashed (scripts/slurm/train.sbatch).
STOP_FILE_VARIABLE = "TRAINER_STOP_FILE"


def _write_stop_file(path: Path, step: int, checkpoint: Path) -> None:
    """One JSON line saying the run stopped on a signal after saving `checkpoint`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "checkpoint": str(checkpoint), "reason": "signal"}) + "\n")
