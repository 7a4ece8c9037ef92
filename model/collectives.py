"""The few small collectives the loops use: sums, maxima and gathers of a handful of Python numbers over the
data-parallel group or the world, and the last pipeline stage's loss figures made known to every stage."""

import logging

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
    raised on every rank (this rank's own, else the first failing rank's, named with its host), so none goes on into a
    collective that a peer stopped before (a data file bad on one node only: gloo's peer failed with `Connection reset
    by peer`, NCCL's would have waited out `parallel.timeout_minutes`). Collective; returns `phase`'s result."""
    import socket

    from config.errors import UserError

    result, failure = None, None
    try:
        result = phase(*args)
    except UserError as error:
        failure = error
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcomes = world_gather((socket.gethostname(), None if failure is None else str(failure)))
        failed = [(rank, host, text) for rank, (host, text) in enumerate(outcomes) if text is not None]
        if failed and failure is None:
            rank, host, text = failed[0]
            raise UserError(f"rank {rank} (on {host}) stopped: {text}")
    if failure is not None:
        raise failure
    return result


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
