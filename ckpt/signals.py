"""Stop signals: SIGTERM/SIGINT ask the loop to finish its step, save and exit 0; a second one stops at once.

A run stopped by a signal writes the stop file a scheduler script names (`STOP_FILE_VARIABLE`), so the script
requeues that run and not one that crashed.
"""

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ckpt.layout import LATEST
from config.process import is_global_rank_zero


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

    def pass_on(self) -> None:
        """A stop signal another process of the run received (an asynchronous run's rollout process, on a node of its
        own), honoured here as this process's own."""
        self.requested = True

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


# A scheduler script names this file; a run stopped by a signal writes it after its checkpoint is saved, so the
# script requeues that run and not one that crashed (scripts/slurm/train.sbatch).
STOP_FILE_VARIABLE = "TRAINER_STOP_FILE"


def write_stop_file(path: Path, step: int, checkpoint: Path) -> None:
    """One JSON line saying the run stopped on a signal after saving `checkpoint`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "checkpoint": str(checkpoint), "reason": "signal"}) + "\n")
