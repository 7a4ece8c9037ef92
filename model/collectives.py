"""The few small collectives the loops use: sums, maxima and gathers of a handful of Python numbers over the
data-parallel group or the world, and the last pipeline stage's loss figures made known to every stage."""

import hashlib
import logging
import pickle
import socket

import numpy
import torch
import torch.distributed as dist


log = logging.getLogger(__name__)



def on_backend_device(tensor: torch.Tensor) -> torch.Tensor:
    """NCCL needs CUDA tensors; gloo takes CPU tensors."""
    return tensor.cuda() if torch.cuda.is_available() else tensor


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce a small tensor over a process group, returning it on the CPU."""
    tensor = on_backend_device(tensor)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.cpu()


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum a few Python numbers over a process group (default: the whole world)."""
    return all_reduce(torch.tensor(values, dtype=torch.float64), group).tolist()


def data_parallel_sum(values: list[float]) -> list[float]:
    """Sum a few Python numbers over this rank's data-parallel group."""
    from megatron.core import parallel_state

    return all_reduce_sum(values, parallel_state.get_data_parallel_group())


def data_parallel_gather(value) -> list:
    """A picklable value from every rank of this rank's data-parallel group, in rank order (rare, small messages)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)  # NCCL: through the current CUDA device, which init set
    return gathered


def world_gather(value) -> list:
    """A picklable value from every rank of the world (this process's default group), in rank order (start-up only)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def agreed(phase, *args):
    """`phase(*args)` on every rank of the world, whose ranks then agree on how it went: a UserError on any rank is
    raised on every rank (this rank's own, else the first failing rank's, named with its host; any other exception is
    raised on its own rank and named in that paragraph on the others), so none goes on into a collective that a peer
    stopped before (a data file bad on one node only: gloo's peer failed with `Connection reset by peer`, NCCL's would
    have waited out `parallel.timeout_minutes`). Collective; returns `phase`'s result."""
    from config.errors import UserError

    result, failure, text = None, None, None
    try:
        result = phase(*args)
    except Exception as error:  # any fault, not only a user's: its peers must not wait for it in the gather below
        failure, text = error, str(error) if isinstance(error, UserError) else (
            f"{type(error).__name__}: {' '.join(str(error).split())[:300]} (its traceback is in that node's log)")
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = world_gather((socket.gethostname(), text))
        failed = [(rank, host, text) for rank, (host, text) in enumerate(outcomes) if text is not None]
        if failed and failure is None:
            rank, host, text = failed[0]
            raise UserError(f"rank {rank} (on {host}) stopped: {text}")
    if failure is not None:
        raise failure
    return result


def content_digest(value) -> str:
    """A digest of what `value` holds: the numpy arrays of a flat store (tokenized examples, prompts) hashed in place,
    anything else pickled."""
    digest = hashlib.sha256()
    arrays = [item for item in vars(value).values() if isinstance(item, numpy.ndarray)] if hasattr(value, "__dict__") else []
    for array in arrays:
        digest.update(numpy.ascontiguousarray(array))
    if not arrays:
        digest.update(pickle.dumps(value))
    return digest.hexdigest()


def check_same_everywhere(config, inputs: dict) -> None:
    """Every rank of the world runs global rank 0's settings on the inputs rank 0 read (`inputs`: {key: what it loaded,
    or a digest of it}, compared by `content_digest`): each rank parses its own command line and `--config` file and
    reads its own `data.path` and frozen models, so a node's own copy that differs (node-local, stale) trained its ranks
    otherwise without a word.
    Collective; the same UserError on every rank, naming the rank, its host and what differs."""
    from config.cli import to_dict
    from config.errors import UserError

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    settings = {f"{section}.{key}": value for section, items in to_dict(config).items() for key, value in items.items()}
    everyone = world_gather((socket.gethostname(), settings, {key: content_digest(value) for key, value in inputs.items()}))
    _, settings, digests = everyone[0]
    for rank, (host, their_settings, their_digests) in enumerate(everyone):
        if changed := [key for key in settings if their_settings.get(key) != settings[key]]:
            raise UserError(
                f"Every rank must run global rank 0's settings, but rank {rank} on {host} was started with "
                f"{', '.join(f'`{key}={their_settings.get(key)!r}` (rank 0: {settings[key]!r})' for key in changed[:4])}"
                f"{', ...' if len(changed) > 4 else ''}. Start every node with the same command and the same `--config` "
                "file (one every node reads at the same path: docs/nodes.md).")
        if differing := [key for key in digests if their_digests.get(key) != digests[key]]:
            raise UserError(
                f"Every rank must train on what global rank 0 reads, but rank {rank} on {host} read other contents from "
                f"{', '.join(f'`{key}={settings.get(key)}`' for key in differing)} than rank 0 did (its node's own copy "
                "differs): its ranks would train otherwise without a word. Put the files on a file system every node "
                "mounts at the same path, or give every node the same copy (docs/nodes.md).")


def all_reduce_float(value: float, op, group=None) -> float:
    """One number reduced (`dist.ReduceOp.MAX`, `MIN`, `SUM`) over a process group (default: the whole world)."""
    return float(all_reduce(torch.tensor([value], dtype=torch.float64), group, op).item())


def all_reduce_int(value: int, op, group=None) -> int:
    """One integer reduced (`dist.ReduceOp.MAX`, `MIN`, `SUM`) over a process group (default: the whole world)."""
    return int(all_reduce(torch.tensor([value], dtype=torch.long), group, op).item())


def world_max(value: int) -> int:
    """The largest of one integer over every rank (what all ranks must agree on, such as a step's micro-batch count)."""
    return all_reduce_int(value, dist.ReduceOp.MAX)


def reduce_loss_over_data_parallel(losses_reduced: list[dict]) -> tuple[float, float]:
    """Global-batch (loss sum, token count) from the microbatch outputs, made known to every rank (`last_stage_sum`)."""
    totals = torch.zeros(2, dtype=torch.float64)
    for item in losses_reduced:
        totals += item["loss"].detach().to("cpu", torch.float64)
    loss_sum, tokens = last_stage_sum(totals.tolist())
    return loss_sum, tokens


def last_stage_sum(values: list[float]) -> list[float]:
    """A few numbers only the last pipeline stage holds (the losses of megatron-core's schedule), summed over its
    data-parallel ranks and made known to every stage, so rank 0 (first stage) can log them. Collective."""
    from megatron.core import parallel_state

    totals = torch.tensor(values, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        totals = all_reduce(totals, parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        totals = on_backend_device(totals)
        dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
        totals = totals.cpu()
    return totals.tolist()
