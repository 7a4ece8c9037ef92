"""Where a run writes: a `train.out_dir` that destroys no earlier run and none of the run's inputs, seen by every node.

A fresh run (no `--resume-from-checkpoint`) refuses a `train.out_dir` that holds an earlier run's checkpoints
or metrics, unless `train.overwrite_output_dir=true` (`check_output_dir`), so no run destroys another; no run
deletes or overwrites its own inputs (`model.path`, `data.path`).

Every rank must see `train.out_dir` and `ckpt.dir` as global rank 0 does (`check_shared_directories`), checked when
the process group is up, not at the first save hours in.
"""

import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from ckpt.failures import barrier
from ckpt.layout import LATEST, PARTIAL, PREFIX, REPLACED, checkpoint_dir
from config import outputs
from config.errors import UserError
from config.process import is_global_rank_zero, nearest_existing
from config.sections import BUNDLED_DATA, EMBEDDED_MODELS

log = logging.getLogger(__name__)


def check_output_dir(config, resume: str, is_main: bool) -> None:
    """Refuse a fresh run whose `train.out_dir` holds an earlier run's checkpoints or metrics (before any work), or
    with `train.overwrite_output_dir=true` delete them first (global rank 0). A resumed run continues them. Any run
    is refused when its exports would replace `model.path` or `data.path`, or its overwrite would delete them, and
    (global rank 0) when another run writes there now (`hold_run_directories`)."""
    replaced = _earlier_run_replaced(config, resume)
    if not is_main:
        return
    hold_run_directories(config)  # before anything is deleted: a run started twice must not delete the first's files
    if replaced:
        log.warning("train.overwrite_output_dir=true: deleting the earlier run's checkpoints and outputs in %s",
                    config.train.out_dir)
    for path in replaced:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# This process's locks on run directories (`hold_run_directories`): the directory's (device, inode), so a directory
# moved since is still known, -> the descriptor holding its lock.
HELD: dict[tuple[int, int], int] = {}


def _close_held_in_child() -> None:
    """A forked child (a checkpoint writer, a reward or tool worker) closes its copies of the held descriptors: the
    parent keeps the locks, and a child that outlived it would otherwise keep them too."""
    for descriptor in HELD.values():
        os.close(descriptor)
    HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def hold_run_directories(config) -> None:
    """Lock `train.out_dir` (made if missing), and `ckpt.dir` where it lies outside it, for this process's life: a
    second run started into either while this one runs (a job submitted twice, a command started again in another
    terminal) is refused at start-up, where both found no earlier run and then wrote the same metrics and checkpoints
    over each other. The lock is the kernel's (`flock` on the directory): it ends with the process, however that
    ends. Where the file system offers none on directories (NFS, Lustre mounted without `flock`), the run goes on
    unlocked."""
    import fcntl

    out_dir, checkpoints = Path(config.train.out_dir), checkpoint_dir(config)
    held = [("train.out_dir", out_dir)] + ([] if _inside(checkpoints, out_dir) else [("ckpt.dir", checkpoints)])
    for key, value in held:
        directory = Path(value).expanduser().resolve()
        directory.mkdir(parents=True, exist_ok=True)
        identity = (directory.stat().st_dev, directory.stat().st_ino)
        if identity in HELD:  # this process's own run (a command of a test's shared launch, a resume in-process)
            continue
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise UserError(
                f"`{key}={value}` is in use: another run started into it is still running (a process holds the "
                f"directory's lock; `fuser -v {directory}` names it). Two runs there would write the same metrics and "
                f"checkpoints over each other. Wait for it to end (then `--resume-from-checkpoint latest` continues "
                f"it), or give this run a new `--{key}`.") from None
        except OSError as error:
            os.close(descriptor)
            log.debug("%s: no lock on %s (%s): a second run started into it is not refused", key, directory, error)
            continue
        HELD[identity] = descriptor


def _earlier_run_replaced(config, resume: str) -> list[Path]:
    """`check_output_dir`'s refusals; what `train.overwrite_output_dir=true` deletes (none: nothing to delete)."""
    out_dir = Path(config.train.out_dir)
    _check_writable_directories(config)
    _check_checkpoints_survive_exports(config)
    _check_outputs_outside_data(config)
    _check_inputs_survive(config, [out_dir / name for name in outputs.EXPORTS],
                          "writes after its last step (its Hugging Face export)")
    foreign = resume and _resumes_another_run(config, resume)
    earlier = _earlier_run(config)
    unpointed = resume == LATEST and not (checkpoint_dir(config) / LATEST).is_file()
    if resume and not foreign and not unpointed:
        if config.train.overwrite_output_dir:  # a requeued job passes both: a resume never deletes its own run
            log.warning("train.overwrite_output_dir=true deletes nothing here: `--resume-from-checkpoint %s` continues "
                        "the run in %s. To start afresh, drop `--resume-from-checkpoint` (scripts/run.sh and the Slurm "
                        "script always pass it: give them a new `--train.out_dir`).", resume, checkpoint_dir(config))
        return []
    if unpointed:  # `latest` names nothing, so this run starts fresh: over a run killed before its first save (whose
        # metrics are its own to replace), or over a finished run whose checkpoints are gone and whose export is not
        earlier = [path for path in earlier if path.name in outputs.EXPORTS or path.name.startswith(PREFIX)]
        # A run whose checkpoints are in `train.out_dir`'s own `checkpoints/` resumed with `--ckpt.dir` set elsewhere
        # (moved to a larger disk, say): it started from step 0 with one info line and replaced their run's metrics.
        default = Path(config.train.out_dir) / "checkpoints"
        if default.resolve() != checkpoint_dir(config).resolve() and (default / LATEST).is_file():
            earlier += sorted(default.glob(f"{PREFIX}*"))
        # ... and the other way round: a run that saved into a `--ckpt.dir` of its own, resumed without it. The run
        # directory names no checkpoint directory, but its metrics reach a save (`ckpt.save_interval`) and no save
        # was ever begun here (one killed in its first save leaves the directory: that run starts again).
        past = 0 if checkpoint_dir(config).exists() else saved_past(out_dir / outputs.METRICS, config.ckpt.save_interval)
        earlier += [out_dir / outputs.METRICS] if past else []
    if not any(path.name == outputs.METRICS or path.name.startswith(PREFIX) or path.name == LATEST
               or (unpointed and path.name in outputs.EXPORTS) for path in earlier):
        return []
    if not config.train.overwrite_output_dir:
        keys = _holding_keys(config, earlier)
        elsewhere = "a new " + " and ".join(f"`--{key}`" for key in keys)
        held = (f"{' and '.join(f'`{key}={value}`' for key, value in keys.items())} "
                f"hold{'s' if len(keys) == 1 else ''} an earlier run ({', '.join(f'`{path}`' for path in earlier[:3])}"
                f"{', ...' if len(earlier) > 3 else ''})")
        if unpointed:
            reached = (f" (its metrics reach step {past}, past a save every `ckpt.save_interval="
                       f"{config.ckpt.save_interval}` steps)") if past else ""
            raise UserError(
                f"{held}{reached}, and `--resume-from-checkpoint latest` finds no `latest` checkpoint in "
                f"`ckpt.dir={checkpoint_dir(config)}`, so this run would start from step 0 and replace that run's "
                "metrics and export. Resume it from its checkpoints with `--ckpt.dir` (the one it saved into, or "
                f"`--resume-from-checkpoint PATH`), write this run elsewhere with {elsewhere}, or replace the earlier "
                "run with `--train.overwrite_output_dir=true`.")
        if foreign:
            raise UserError(
                f"{held}, and this run resumes from `{resume}`, a checkpoint outside its own `ckpt.dir` "
                f"(`{checkpoint_dir(config)}`): it would mix the two runs' metrics and replace the earlier run's "
                "checkpoints and export. Resume into the checkpoint's own run (its `--train.out_dir`), continue the "
                f"earlier run with `--resume-from-checkpoint latest`, write this one to {elsewhere}, or "
                "replace the earlier run with `--train.overwrite_output_dir=true` (deletes its checkpoints and metrics "
                "first).")
        raise UserError(
            f"{held}, and this run would overwrite its checkpoints and metrics. Continue "
            f"it with `--resume-from-checkpoint latest`, write this run elsewhere with {elsewhere}, or "
            "replace it with `--train.overwrite_output_dir=true` (deletes its checkpoints and metrics first).")
    _check_inputs_survive(config, earlier, "deletes first (`train.overwrite_output_dir=true`)")
    return earlier


def saved_past(metrics: Path, save_interval: int) -> int:
    """The last training step `metrics` (a run's metrics.jsonl) records when it reaches a save of every
    `save_interval` steps (a run killed before its first save has none to resume: 0), else 0."""
    steps = [row["step"] for row in outputs.read_rows(metrics) if isinstance(row.get("step"), int)]
    return max(steps) if save_interval > 0 and steps and max(steps) >= save_interval else 0


def _holding_keys(config, earlier: list[Path]) -> dict[str, Path]:
    """The keys whose directories hold the `earlier` run's files: `train.out_dir`, and `ckpt.dir` when it lies outside
    it (two runs given one `--ckpt.dir` differ in `train.out_dir` alone, so only a new `ckpt.dir` parts them)."""
    out_dir, directory = Path(config.train.out_dir), checkpoint_dir(config)
    apart = [path for path in earlier if not _inside(directory, out_dir) and _inside(path, directory)]
    return ({"train.out_dir": out_dir} if len(apart) < len(earlier) else {}) | ({"ckpt.dir": directory} if apart else {})


def _resumes_another_run(config, resume: str) -> bool:
    """Whether `--resume-from-checkpoint` names a checkpoint outside this run's own `ckpt.dir` (another run's, to
    branch from): `latest` and a checkpoint of this run (moved with its `train.out_dir` or not) are this run's."""
    path = Path(resume).expanduser()  # one that does not exist is said by `ckpt.resume.resolve_resume`
    return resume != LATEST and path.exists() and not _inside(path, checkpoint_dir(config))


def _check_writable_directories(config) -> None:
    """`train.out_dir` and `ckpt.dir` name directories (existing, or creatable under a directory): not empty, not a
    file, not under a file; refused before any work (a file there failed after the model was built, or at the first
    save as a full disk)."""
    if not config.train.out_dir.strip():
        raise UserError("`train.out_dir` is empty: the run would write its checkpoints, metrics and export into the "
                        "current directory. Set `--train.out_dir DIR`.")
    for key, value in (("train.out_dir", config.train.out_dir), ("ckpt.dir", str(checkpoint_dir(config)))):
        path = Path(value).expanduser()
        blocking = nearest_existing(path)
        if not blocking.is_dir():
            raise UserError(f"`{key}={value}`: `{blocking}` is a file, not a directory, so the run could not write "
                            f"there. Point `--{key}` at a directory (or a path to create one).")
        try:  # writable: a directory made and removed in the nearest one that exists (root passes any access check)
            os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=blocking))
        except OSError as error:
            raise UserError(f"`{key}={value}`: the run cannot write in `{blocking}` ({error.strerror}). Point "
                            f"`--{key}` at a directory you can write to.") from None


def _check_checkpoints_survive_exports(config) -> None:
    """Refuse a `ckpt.dir` inside an export's directory (`<train.out_dir>/hf`, ...): the export replaces that directory
    whole after the last step, and the checkpoints went with it (the run ended with status 0, nothing to resume)."""
    out_dir, directory = Path(config.train.out_dir).expanduser(), checkpoint_dir(config).expanduser()
    for name in outputs.EXPORTS:
        for export in (out_dir / name, out_dir / f"{outputs.PARTIAL}{name}", out_dir / f"{REPLACED}{name}"):
            if _inside(directory, export):
                raise UserError(f"`ckpt.dir={config.ckpt.dir}` lies inside `{export}`, the directory of the run's "
                                f"`{name}` export, which is replaced whole after the last step: every checkpoint would "
                                "be deleted with it. Point `--ckpt.dir` elsewhere, or leave it unset "
                                "(`<train.out_dir>/checkpoints`).")


def _check_outputs_outside_data(config) -> None:
    """Refuse a `train.out_dir` or `ckpt.dir` inside a data folder (`data.path`, `data.eval_path`) whose loader would
    read the run's files as rows: it reads the json/jsonl/parquet files under it that a split's names pick (every file
    where none is named after the split), so the run's metrics.jsonl and its export's JSON files became rows (or a mix
    of formats it refuses) from the next start on, a resume included. Hidden folders, and folders whose files are
    named after their splits (train.jsonl, test.jsonl) while the run's are not, are read as before."""
    from data.local_files import reads_any  # imported where used: a data folder is the rare case

    data = config.data
    for data_key, value, splits in (
            ("data.path", data.path, [(data.train_split, False)] + ([] if data.eval_path else [(data.eval_split, True)])),
            ("data.eval_path", data.eval_path, [(data.eval_split, True)])):
        folder = _on_disk(data_key, value)
        if folder is None or not folder.is_dir():  # a file, a bundled set or a hub name: nothing read from beside it
            continue
        out_dir, ckpt_dir = Path(config.train.out_dir).expanduser(), checkpoint_dir(config).expanduser()
        for key, directory, written in (
                ("train.out_dir", out_dir, [outputs.METRICS, outputs.SAMPLES, f"{outputs.HF}/config.json",
                                            f"{outputs.HF_ADAPTER}/adapter_config.json", "wandb/run/files/wandb-metadata.json"]),
                ("ckpt.dir", ckpt_dir, [f"{PREFIX}00000001/metadata.json"])):
            if not _inside(directory, folder):
                continue
            under = folder / directory.resolve().relative_to(folder.resolve())  # as the loader names its files
            if reads_any(folder, [under / name for name in written], splits):
                raise UserError(f"`{key}={directory}` lies inside `{data_key}={value}`, a data folder whose "
                                "json/jsonl/parquet files are read as data: the run's metrics, export or checkpoints "
                                f"would be read as rows from its next start on (a resume included). Point `--{key}` "
                                f"outside `{value}` (or into a hidden folder of it, `.runs/`, which the loader skips).")


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


def _on_disk(key: str, value: str) -> Path | None:
    """What `value`, an input key's (`model.path`, `data.path`, ...), names on disk, or None: not there (yet), or a name
    the loaders read as the embedded model or a bundled data set even where a folder so named exists."""
    bundled = EMBEDDED_MODELS if key == "model.path" else BUNDLED_DATA if key.startswith("data.") else ()
    if not value or value in bundled or not Path(value).expanduser().exists():
        return None
    return Path(value).expanduser()


def _inside(path: Path, directory: Path) -> bool:
    """Whether `path` is `directory` or lies under it (both resolved, so links and `..` do not hide it)."""
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def _check_inputs_survive(config, replaced: list[Path], action: str) -> None:
    """Refuse a run that would delete or overwrite its own inputs: `model.path`, a `data.path` or `data.eval_path` on
    disk and GRPO's `grpo.teacher` and `grpo.reward_model` (a `~` expanded, as the loaders expand it)."""
    grpo = getattr(config, "grpo", None)
    for key, value in (("model.path", config.model.path), ("data.path", config.data.path),
                       ("data.eval_path", config.data.eval_path), ("grpo.teacher", getattr(grpo, "teacher", "")),
                       ("grpo.reward_model", getattr(grpo, "reward_model", ""))):
        if (on_disk := _on_disk(key, value)) is None:  # `tiny`, a bundled task or a hub dataset name
            continue
        hit = next((path for path in replaced if _inside(on_disk, path)), None)
        if hit is not None:
            raise UserError(f"`{key}={value}` lies inside `{hit}`, which this run {action}, so it would destroy its "
                            f"own input. Copy the input elsewhere and point `--{key}` at the copy, or write this run to "
                            "another `--train.out_dir`.")


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
    barrier()
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
