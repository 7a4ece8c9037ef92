"""User code run once per model replica: `run_once_per_replica(compute, *args)` runs a reward or a tool on the first
rank of each tensor- and pipeline-parallel group and sends its result (or its failure, as one paragraph) to the others,
so every shard and stage of one replica sees the same value."""

import logging
import pickle

import torch
import torch.distributed as dist

from config.errors import UserError

log = logging.getLogger(__name__)



def run_once_per_replica(compute, *args):
    """`compute(*args)` run on the first rank of this rank's model-parallel group only (the tensor- and
    pipeline-parallel ranks of one model replica), its (picklable) result sent to the others: user code that may
    differ between calls (a tool, a reward: a clock, a network call) then gives every shard and stage of one replica
    the same value, and runs once per replica. Without tensor or pipeline parallelism it is just the call. Collective
    over the model-parallel group.

    Every exception reaches every rank of the group, so no peer waits for a result that never comes: a UserError is
    raised with its message on every rank; any other exception from `compute`, or a result that cannot be pickled,
    is logged with its traceback on the computing rank and raised on every rank as one UserError paragraph naming
    `compute`, the exception's type and message, and where the traceback is."""
    from megatron.core import parallel_state

    if not dist.is_initialized() or parallel_state.get_model_parallel_group().size() == 1:
        return compute(*args)
    group = parallel_state.get_model_parallel_group()
    source = dist.get_process_group_ranks(group)[0]
    box, result, error = [None], None, None
    if dist.get_rank() == source:
        result, error, pickled = _compute_for_peers(compute, args)
        box = [pickled]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    dist.broadcast_object_list(box, src=source, group=group, device=device)
    if error is not None:
        raise error
    if dist.get_rank() == source:
        return result
    failed, value = pickle.loads(box[0])
    if failed:
        raise UserError(value)
    return value


def _compute_for_peers(compute, args) -> tuple[object, UserError | None, bytes]:
    """On the computing rank: `compute(*args)`, the UserError to raise (None when it succeeded), and the pickled
    outcome its peers receive, `(False, result)` or `(True, the error's paragraph)`.

    The result is pickled here rather than inside the broadcast, so one that cannot be pickled fails before the
    collective and its error is what the peers receive."""
    try:
        result = compute(*args)
    except UserError as error:
        return None, error, pickle.dumps((True, str(error)))
    except Exception as error:
        failure = _shared_failure(compute, error, f"{_qualified_name(compute)} raised")
    else:
        try:
            return result, None, pickle.dumps((False, result))
        except Exception as error:
            failure = _shared_failure(compute, error, f"Pickling the result of {_qualified_name(compute)} (a "
                                      f"{type(result).__name__}), to send it to the other ranks, failed",
                                      " Return plain data from it (no locks, threads, open files or lambdas).")
    return None, failure, pickle.dumps((True, str(failure)))


def _shared_failure(compute, error: Exception, problem: str, fix: str = "") -> UserError:
    """The paragraph every model-parallel rank raises for `error` on the computing rank; logs the traceback there,
    once. Call it in the `except` block that caught `error`."""
    rank = dist.get_rank()
    log.exception("%s failed on global rank %d, which runs it for its model-parallel group", _qualified_name(compute),
                  rank)
    detail = " ".join(str(error).split()).rstrip(".") or "(no message)"
    failure = UserError(f"{problem} on global rank {rank}, the rank of its model-parallel group (the tensor- and "
                        f"pipeline-parallel ranks of one model replica) that runs it for the others: "
                        f"{type(error).__name__}: {detail}. Its full traceback is logged on that rank (logger "
                        f"{log.name!r}); every rank of the group stops with this message rather than wait for the "
                        f"result.{fix}")
    failure.__cause__ = error
    return failure


def _qualified_name(function) -> str:
    """`module.Qualified.name` of a function or bound method; the repr of another callable (a partial)."""
    qualified = getattr(function, "__qualname__", None)
    return f"{function.__module__}.{qualified}" if qualified else repr(function)
