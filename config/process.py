"""Where this process sits among torchrun's, read from the environment torchrun sets (valid before and after the
process group starts; a process started without torchrun is rank 0), and where it keeps what it builds once."""

import os
import pathlib


def is_global_rank_zero() -> bool:
    """Whether this is global rank 0, the one process that writes shared files and prints."""
    return int(os.environ.get("RANK", "0")) == 0


def nearest_existing(path: pathlib.Path) -> pathlib.Path:
    """`path`, or the nearest of its parents that exists: where a directory at `path` would be made (a file there
    means none can be)."""
    return next(parent for parent in (path, *path.parents) if parent.exists())


def cache_dir() -> pathlib.Path:
    """Where built things are kept between runs (the tiny model, tokenized SFT data): `$TRAINER_CACHE_DIR`, or
    `~/.cache/megatron-trainer` when it is unset. A UserError when a file stands there or above it."""
    from config.errors import UserError

    path = pathlib.Path(os.environ.get("TRAINER_CACHE_DIR") or pathlib.Path.home() / ".cache" / "megatron-trainer")
    blocking = nearest_existing(path)
    if not blocking.is_dir():
        raise UserError(f"The cache directory `{path}` cannot be made: `{blocking}` is a file. Set $TRAINER_CACHE_DIR "
                        "to a directory (or a path to create one).")
    return path
