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


# Start-up failures before the process group exists. A rank that stops there (a file bad on its node only) never joins
# the group, and its peers waited in `init_process_group` for `parallel.timeout_minutes` (30 by default) before failing
# with a traceback; so every rank first meets the others in torchrun's own key-value store (served by the agent, which
# outlives a worker), where a rank that stopped has left its paragraph.
STARTUP_KEYS = "megatron-trainer/start-up"


def _startup_store(timeout_s: float):
    """torchrun's store (MASTER_ADDR:MASTER_PORT) under this launch attempt's start-up prefix, or None where no launcher
    agent serves one (a single process, or a launcher other than torchrun: a rank would have to serve it), or where
    the ranks cannot tell which attempt they are in: several agents that may restart their workers (`--max-restarts`).
    A node whose worker failed counts a restart, but the agents of the other nodes restart theirs for its new
    rendezvous without counting one, so their ranks met under another prefix and each waited out the whole timeout."""
    import datetime

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        return None
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    # The store outlives a launch attempt (torchrun's restart count) and an elastic change of members (the world size).
    attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{os.environ['WORLD_SIZE']}"
    return dist.PrefixStore(f"{STARTUP_KEYS}/{attempt}", store)


def tell_peers_at_startup(paragraph: str) -> None:
    """Leave this rank's start-up failure where the ranks waiting to join the process group read it
    (`meet_peers_at_startup`), so they stop with it now. Best effort: a store out of reach costs only that."""
    import contextlib
    import socket

    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():  # the peers are past the meeting, in the group's collectives
            return
        if (store := _startup_store(10)) is not None:
            store.set("failed", f"rank {os.environ.get('RANK', '0')} (on {socket.gethostname()}) stopped at start-up: "
                                f"{paragraph}")


def meet_peers_at_startup(timeout_s: float) -> None:
    """Wait, before joining the process group, until every rank of the launch has arrived here; a UserError with the
    paragraph of a rank that stopped before arriving (`tell_peers_at_startup`), as soon as it has."""
    import time

    from config.errors import UserError

    if (store := _startup_store(timeout_s)) is None:
        return
    world_size = int(os.environ["WORLD_SIZE"])
    arrived = store.add("arrived", 1)
    everyone = -(-arrived // world_size) * world_size  # a later meeting in the same processes counts on from the last
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check(["failed"]):
            raise UserError(store.get("failed").decode())
        if store.add("arrived", 0) >= everyone:
            return
        time.sleep(0.2)  # a few store requests a second per rank, thousands of ranks included
