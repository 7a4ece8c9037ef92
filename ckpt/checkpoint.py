"""The run's checkpointer: the one object the loops call to resume, save, export and stop (`Checkpointer`).

It names the run's stateful parts and calls the modules beside it, each with one job, none importing this one:
    layout.py      the names of what `ckpt.dir` holds (`latest`, `step_N/`, `.partial-step_N/`, ...)
    resume.py      `--resume-from-checkpoint` resolved to a checkpoint saved for this model, before any build
    output_dir.py  `train.out_dir`: no earlier run or input destroyed (`check_output_dir`), seen by every node
    state.py       model and optimizer state for DDP, Megatron-FSDP and LoRA, every rank's RNG: saved, loaded
    writer.py      the background writer (`BackgroundSaves`) and its results file (`WriteResults`)
    publish.py     atomic saves: staged, fsynced, renamed, `latest` moved, pruned; the failed save's paragraph
    failures.py    what the ranks learn together: all arrived, every rank's failure as one line
    export.py      the Hugging Face export after the last step, staged and renamed; its failure's paragraph
    signals.py     stop signals (`catch_stop_signals`, `Preemption`) and the stop file
The names the loops, tests and scripts reach through `ckpt.checkpoint` are imported here from those modules. What
the modules share among themselves is their declared internal API: public names (no leading underscore), imported
from the module that defines them; underscore names stay inside their module.
"""

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from ckpt.export import missing_exports, write_exports
from ckpt.failures import bytes_in_words
from ckpt.layout import checkpoint_dir, resume_arguments
from ckpt.publish import tree_bytes, clean_stale_saves, save
from ckpt.resume import LOOPS, frozen_inputs, model_fingerprint, resolve_resume, restore_metrics_row
from ckpt.signals import STOP_FILE_VARIABLE, write_stop_file, catch_stop_signals
from ckpt.state import estimated_save_bytes, uses_megatron_fsdp, load
from ckpt.writer import BackgroundSaves
from config import outputs
from config.cli import to_dict
from config.errors import AgreedStop
from config.process import is_global_rank_zero
from config.hf import read_hf_config

# Re-exported: the loops, tests and scripts reach these through `ckpt.checkpoint`.
from ckpt.layout import LATEST, PARTIAL, PREFIX, REPLACED, SHARDED_DIR, STATE_FILE, checkpoint_name  # noqa: F401
from ckpt.output_dir import check_output_dir, check_shared_directories  # noqa: F401
from ckpt.publish import prune_checkpoints, publish_checkpoint  # noqa: F401
from ckpt.resume import loop_of  # noqa: F401
from ckpt.signals import REPEAT_AFTER_S, Preemption  # noqa: F401
from ckpt.state import load_model_and_optimizer, materialise_optimizer_state  # noqa: F401
from ckpt.writer import WriteResults  # noqa: F401

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores one run's named stateful parts: the policy's model chunks and optimizer (sharded),
    every rank's RNG, and any objects with `state_dict()` / `load_state_dict()` (LR schedule, data position).
    After the last step it also writes the run's output, the trained model as a Hugging Face checkpoint."""

    def __init__(self, config, resume: str, model_path: Path):
        """Resolve what to resume from before any model is built: a bad target costs nothing and overwrites nothing."""
        self.config = config
        self.directory, self.model_path = checkpoint_dir(config), Path(model_path)
        self.fingerprint = model_fingerprint(read_hf_config(model_path, "model.path"), config.parallel, config.peft,
                                             model_path, config.model.moe_freeze_router, config.model.dtype)
        self.fingerprint.update(inputs=frozen_inputs(config, self.model_path), loop=LOOPS[type(config).__name__])
        self.resume_path, self.resume_step = resolve_resume(resume, self.directory, self.fingerprint, to_dict(config))
        self.policy, self.parts, self.preemption = None, {}, catch_stop_signals()
        self.preemption.checkpoint_dir = self.directory
        self.save_bytes = (0, "")  # what one save needs, and how that is known (`track`, then each save)
        self.background = BackgroundSaves() if config.ckpt.async_save else None
        self.slowest_step_s, self.last_save_s = 0.0, 0.0  # what a scheduler's stop warning must cover
        self.row: dict | None = None  # the metrics row of the step being saved: it travels in the checkpoint
        if is_global_rank_zero():
            clean_stale_saves(self.directory)

    def finished(self) -> bool:
        """Whether the checkpoint resumed from has already run every step and the run's exports are written (said
        once, then there is nothing to do but put back the last step's metrics row, when metrics.jsonl lacks it). A
        finished run whose export is missing goes on to write it."""
        if self.resume_step < self.config.train.steps:
            return False
        missing = missing_exports(self.config)
        if missing:
            log.info("this run finished all %d steps (checkpoint %s) but its export %s was not written (completely): "
                     "building the model to write it", self.config.train.steps, self.resume_path,
                     ", ".join(f"{name}/" for name in missing))
            return False
        log.info("this run already finished all %d steps (checkpoint %s); nothing to do", self.config.train.steps,
                 self.resume_path)
        if is_global_rank_zero():  # the last row is written after the export: a run that died there lacks it
            state = torch.load(self.resume_path / STATE_FILE, weights_only=False)
            restore_metrics_row(Path(self.config.train.out_dir) / outputs.METRICS, state.get("metrics_row"))
        return True

    def track(self, policy, **parts) -> None:
        """Name what a checkpoint holds (stop signals are caught since start-up: see `catch_stop_signals`), and warn
        when `ckpt.dir` has room for fewer than two checkpoints (estimated from the parameters). Collective."""
        self.policy, self.parts = policy, parts
        if self.background is not None and uses_megatron_fsdp(policy.chunks):
            self.background = None
            if is_global_rank_zero():
                log.info("ckpt.async_save: Megatron-FSDP saves synchronously (its DTensor checkpoints go through "
                         "torch.distributed.checkpoint, which megatron-core's asynchronous saving does not cover)")
        estimate = estimated_save_bytes(policy, self.config.peft.method == "lora")
        self.save_bytes = (estimate, "estimated from the parameters and their Adam state")
        existing = next(path for path in (self.directory, *self.directory.parents) if path.exists())
        free = shutil.disk_usage(existing).free
        if free < 2 * estimate:  # every rank sees it; the console prints rank 0's (config.console)
            log.warning("`ckpt.dir=%s` has %s free, and one checkpoint needs about %s (%s); a save writes a new one "
                        "before deleting the oldest, so saves may fail for space. Make room, or set `--ckpt.dir` on a "
                        "larger disk.", self.directory, bytes_in_words(free), bytes_in_words(estimate), self.save_bytes[1])

    def resume(self) -> int:
        """Load every tracked part from the resume target; returns the step to continue after (0: fresh start)."""
        if self.resume_path is None:
            return 0
        state = load(self.resume_path, self.policy.chunks, self.policy.optimizer)
        for name, part in self.parts.items():
            part.load_state_dict(state.get(name))  # a part a checkpoint lacks (asynchronous GRPO's) says what it does
        if is_global_rank_zero():
            restore_metrics_row(Path(self.config.train.out_dir) / outputs.METRICS, state.get("metrics_row"))
        log.info("resumed from %s at step %d", self.resume_path, state["step"])
        return state["step"]

    def save(self, step: int) -> Path:
        """Write every tracked part after `step` (in the background with `ckpt.async_save`, once the previous save is
        published). Collective."""
        started = time.perf_counter()
        self.wait()  # a second save waits for the first
        state = {"step": step, "config": to_dict(self.config), "fingerprint": self.fingerprint,
                 "metrics_row": dict(self.row) if (self.row or {}).get("step") == step else None,
                 **{name: part.state_dict() for name, part in self.parts.items()}}
        self.policy.sync_parameters()  # with overlapped parameter gathering, the last step's gather may be in flight
        path = save(self.directory, step, self.policy.chunks, self.policy.optimizer, state, self.config.ckpt.keep_last,
                    is_global_rank_zero(), self.save_bytes, self.background, self._published)
        self.last_save_s = time.perf_counter() - started
        return path

    def _published(self, path: Path) -> None:
        """After a checkpoint is published: what one save needs is now its measured size."""
        if is_global_rank_zero():
            self.save_bytes = (tree_bytes(path), f"the size of `{path.name}`")

    def wait(self) -> None:
        """Wait for the save in flight and publish it (before an export, and before the run exits). Collective."""
        if self.background is not None:
            self.background.finish(wait=True)

    @contextlib.contextmanager
    def kept_on_agreed_stop(self):
        """Around a loop: a run every rank stops alike (`AgreedStop`: a reward that failed on every completion, a NaN
        gradient norm) first publishes the save in flight, whose write was under way in the background; before, such a
        stop left it a `.partial-step_*` directory and `latest` a save older (or none). Collective on that exception only."""
        try:
            yield
        except AgreedStop:
            self.wait()
            raise

    def maybe_save_or_export(self, step: int, row: dict | None = None) -> bool:
        """Save after `step` when due (ckpt.save_interval, the last step, train.exit_interval, a signal), and export
        the model after the last; True: stop now (a stopped run exports nothing: it is resumed, not finished). A
        background save whose write has finished everywhere is published here; a run that stops waits for its last.
        `row` is the step's metrics row (its `step_time_s` read here), saved with the checkpoint: the loop writes it
        to metrics.jsonl after this returns, and a run that dies before then (in the export, or a save) gets it back
        on resume (`resume`).

        Every way out of a loop passes through a save here, so no parameter gather is in flight at shutdown."""
        train = self.config.train
        self.row = row
        self.slowest_step_s = max(self.slowest_step_s, (row or {}).get("step_time_s", 0.0))
        if self.background is not None:
            self.background.finish(wait=False)
        # A signal in the last step changes nothing: the run finishes (a stop file would requeue a finished job).
        signalled = self.preemption.agreed() and step < train.steps
        stop = signalled or train.exits_at(step)
        interval = self.config.ckpt.save_interval
        if stop or step == train.steps or (interval and step % interval == 0):
            path = self.save(step)
        if stop or step == train.steps:
            started = time.perf_counter()
            self.wait()
            self.last_save_s += time.perf_counter() - started
        if step == train.steps:
            self.export()
        if signalled:
            log.info("stopping at step %d (signal); slowest step %.1f s, this save %.1f s: a scheduler's stop warning "
                     "must cover a step and a save. Resume with %s", step, self.slowest_step_s, self.last_save_s,
                     resume_arguments(self.config))
            if is_global_rank_zero() and os.environ.get(STOP_FILE_VARIABLE):
                write_stop_file(Path(os.environ[STOP_FILE_VARIABLE]), step, path)
        elif stop:
            log.info("stopping at step %d (train.exit_interval); resume with %s", step, resume_arguments(self.config))
        return stop

    def export(self) -> None:
        """Write the run's exports (`hf/`, with LoRA `hf_adapter/`), each renamed whole when complete. Collective."""
        write_exports(self.policy, Path(self.config.train.out_dir), self.model_path, self.directory)

    def export_if_already_finished(self, start_step: int) -> None:
        """After a loop that had no step left to run (a resume of a finished run whose export was missing): export."""
        if start_step >= self.config.train.steps:
            self.export()
