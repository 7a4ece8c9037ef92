"""What the ranks of a save or an export learn together: that all have arrived, and every rank's failure as one line.

Each phase of a save ends with every rank learning whether any rank's part failed (a full disk, a quota,
permissions), so every rank raises the same one-paragraph UserError (the save's in `publish`, the export's in
`export`) and none waits for a peer that stopped. Those paragraphs give sizes in words (`bytes_in_words`).
"""

import torch.distributed as dist


def barrier() -> None:
    """All ranks reach this point before anyone goes on."""
    if dist.is_initialized():
        dist.barrier()


def failures_everywhere(phase) -> list[tuple[int, str]]:
    """Run `phase` on this rank; return every rank's failure as (rank, `Type: message`), [] when all succeeded.
    Collective (in place of a barrier)."""
    from torch.distributed.checkpoint.api import CheckpointException

    failure = None
    try:
        phase()
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        failure = underlying_error(error)
    outcomes = [(0, failure)]
    if dist.is_initialized():
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (dist.get_rank(), failure))
    return [(rank, text) for rank, text in outcomes if text]


def underlying_error(error: BaseException) -> str:
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


def bytes_in_words(nbytes: float) -> str:
    """Bytes in words: `13.1 MB`, `2.4 GB`."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""
