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


def _startup_store(timeout_s: float, keys: str = STARTUP_KEYS):
    """torchrun's store (MASTER_ADDR:MASTER_PORT) under this launch attempt's prefix `keys`, or None where no launcher
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
    return dist.PrefixStore(f"{keys}/{attempt}", store)


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


# Failures after the process group exists. A rank that stopped alone with a UserError mid-run (an environment whose
# service went away on its node) printed nothing, since rank 0 prints, and rank 0 stopped in its next collective with
# gloo's `Connection closed by peer` traceback (NCCL's waits until torchrun stops it): the paragraph was only in
# torchrun's summary. So the rank leaves its paragraph in torchrun's store, and a peer whose collective then fails
# says it instead of that traceback.
MID_RUN_KEYS = "megatron-trainer/mid-run"
# How long a rank whose collective failed looks for a peer's paragraph: the peer leaves it before it exits, but its
# way out may close the process group first.
PEER_PARAGRAPH_WAIT_S = 5.0


def tell_peers_mid_run(paragraph: str) -> None:
    """Once the process group is up, leave this rank's paragraph where a peer whose collective fails because this rank
    stopped reads it (`peer_paragraph`). Best effort: a store out of reach costs only that."""
    import contextlib
    import socket

    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if (store := _startup_store(10, MID_RUN_KEYS)) is not None and not store.check(["failed"]):
            store.set("failed", f"rank {os.environ.get('RANK', '0')} (on {socket.gethostname()}) stopped: {paragraph}")


def peer_paragraph() -> str | None:
    """The paragraph a peer left when it stopped mid-run (`tell_peers_mid_run`), waited for a few seconds while this
    rank's process group is up; None when there is none."""
    import contextlib
    import time

    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if (store := _startup_store(10, MID_RUN_KEYS)) is None:
            return None
        deadline = time.monotonic() + (PEER_PARAGRAPH_WAIT_S if dist.is_initialized() else 0)
        while True:
            if store.check(["failed"]):
                return store.get("failed").decode()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
    return None
