"""Atomic saves: a checkpoint written whole, then published (renamed, `latest` moved, old ones pruned), or a paragraph.

A save writes into `.partial-step_N/` (the model and optimizer in the background, `ckpt.async_save`), fsyncs it,
and renames it when every rank has finished, then moves `latest` (fsynced), then prunes old checkpoints (never the
one just written): `latest` names a complete checkpoint at every instant, whenever the process dies (`publish_checkpoint`).
What a killed save leaves is removed at the next start-up.
"""

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ckpt.failures import failures_everywhere, bytes_in_words
from ckpt.layout import LATEST, PARTIAL, PREFIX, REPLACED, SHARDED_DIR, STATE_FILE, checkpoint_name
from ckpt.state import save_model_and_optimizer, rng_state
from ckpt.writer import BackgroundSaves
from config.errors import UserError

log = logging.getLogger(__name__)


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
        written.append(save_model_and_optimizer(chunks, optimizer, partial / SHARDED_DIR, background is not None))
        _write_durably(partial / "rng" / f"rank_{dist.get_rank():05d}.pt", rng_state())
        if is_main:
            _write_durably(partial / STATE_FILE, state)

    def publish():
        if is_main:
            fsync_tree(partial)
            publish_checkpoint(checkpoint_dir, partial, final)
            prune_checkpoints(checkpoint_dir, keep_last, keep=final)
            log.info("saved checkpoint %s", final)

    def run(*phases) -> None:
        for phase in phases:
            failures = failures_everywhere(phase)
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


def _save_failed(checkpoint_dir: Path, step: int, failures: list, save_bytes: tuple[int, str], keep_last: int) -> str:
    """The paragraph a failed save ends the run with: where, why, what one save needs, and what `latest` still holds."""
    rank, text = failures[0]
    others = f", and on {len(failures) - 1} more rank(s)" if len(failures) > 1 else ""
    free = shutil.disk_usage(checkpoint_dir).free if checkpoint_dir.is_dir() else 0
    needs, how = save_bytes
    if "No space left on device" not in text and free < max(needs, 1):
        # torch.save reports a full disk as `unexpected pos N vs M`; the free space says what happened.
        text = f"No space left on device (the file system is full; the writer reported {text})"
    need = f" and one checkpoint needs about {bytes_in_words(needs)} ({how}); a save writes a new one before deleting the " \
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
            f"`{checkpoint_dir}` has {bytes_in_words(free)} free{need}. {resume}.")


def publish_checkpoint(checkpoint_dir: Path, partial: Path, final: Path) -> None:
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
    fsync_directory(checkpoint_dir)


def prune_checkpoints(checkpoint_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete complete checkpoints beyond the newest `keep_last` up to `keep`, the one just written (never it). Those
    after it are a branch a resume from an earlier checkpoint left behind: they neither count nor go (each is
    replaced when the run reaches its step), so the resumed run keeps `keep_last` of its own."""
    complete = sorted(path for path in checkpoint_dir.glob(f"{PREFIX}*") if path.is_dir() and path.name <= keep.name)
    for path in complete[: max(len(complete) - keep_last, 0)]:
        if path != keep:
            shutil.rmtree(path)


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


def _write_durably(path: Path, state) -> None:
    """`torch.save` and fsync: a checkpoint published afterwards never holds a half-written file after a power loss."""
    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())


def fsync_directory(directory: Path) -> None:
    """Make the names in `directory` (renames, new entries) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (the shards torch.distributed.checkpoint wrote included)."""
    for directory, _, files in os.walk(root):
        for name in files:
            descriptor = os.open(Path(directory) / name, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        fsync_directory(Path(directory))


def tree_bytes(root: Path) -> int:
    """Bytes of the files under `root`."""
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())
