"""Distributed start-up in one place: process group from torchrun's environment, megatron parallel state, seeding."""

import datetime
import logging
import os
import pickle
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from config.errors import UserError
from config.process import is_global_rank_zero
from model import cpu_compat, rules

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """Where this process sits: global rank, data-parallel coordinates, and its device."""

    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    device: torch.device
    created_process_group: bool  # False when an earlier phase of this process created it (GRPO's default start)

    @property
    def is_main(self) -> bool:
        """Global rank 0 writes files and prints (`config.process.is_global_rank_zero`)."""
        return is_global_rank_zero()


def free_port() -> int:
    """A free TCP port on this host (a single process started without torchrun; tests and benchmarks launching torchrun)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch (CPU and CUDA) and megatron's tensor-parallel RNG tracker."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Also seeds CUDA and gives each TP rank its own stream for dropout in TP regions.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def detect_environment(parallel, world_size: int) -> rules.Environment:
    """The machine as the settings rules see it: CUDA or not, the GPU's compute capability, the data-parallel size.

    Reading the capability initialises the CUDA runtime but creates no context, and CUDA reads
    CUDA_DEVICE_MAX_CONNECTIONS when a context is created, so this may run before `set_cuda_connections`.
    """
    cuda = torch.cuda.is_available()
    capability = tuple(torch.cuda.get_device_capability()) if cuda else None
    return rules.Environment(cuda=cuda, compute_capability=capability,
                             data_parallel_size=parallel.data_parallel_size(world_size))


def set_cuda_connections(parallel, environment: rules.Environment) -> None:
    """Set CUDA_DEVICE_MAX_CONNECTIONS as megatron-core's overlap needs it (`rules.cuda_device_max_connections`),
    before this process creates its CUDA context; a value the user exported wins."""
    wanted = rules.cuda_device_max_connections(parallel, environment)
    current = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if wanted is None or current == wanted:
        return
    if current is not None:
        log.info("keeping CUDA_DEVICE_MAX_CONNECTIONS=%s from the environment (the rule would set %s)", current, wanted)
        return
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = wanted


def init_distributed(parallel, seed: int) -> Runtime:
    """Join the process group torchrun describes (or a group of one), set up TP/PP/VPP/EP/ETP/DP for `parallel`, seed
    every RNG.

    Called again in the same process (GRPO's default start trains the default SFT first), it keeps the
    process group, so there is no second rendezvous, and lays out the model-parallel groups anew.
    """
    from megatron.core import parallel_state

    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_compat.activate()
    rank = int(os.environ.setdefault("RANK", "0"))
    world_size = int(os.environ.setdefault("WORLD_SIZE", "1"))
    local_rank = int(os.environ.setdefault("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # python -m trainer.sft without torchrun
        os.environ["MASTER_PORT"] = str(free_port())
    if use_cuda:
        # Before the first CUDA context (set_device creates it). When GRPO's default start calls this a second time
        # in one process, the context exists and the first phase's value stays.
        set_cuda_connections(parallel, detect_environment(parallel, world_size))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    created_process_group = not dist.is_initialized()
    if created_process_group:
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=parallel.timeout_minutes))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    vpp = parallel.vpp if parallel.vpp > 1 else None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=parallel.timeout_minutes,
    )
    seed_everything(seed)
    runtime = Runtime(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device,
        created_process_group=created_process_group,
    )
    if runtime.is_main:
        backend = "nccl on CUDA" if use_cuda else "gloo on CPU (CPU compatibility layer active)"
        log.info("distributed: %d processes, %s; TP=%d PP=%d VPP=%s EP=%d ETP=%d DP=%d (expert DP=%d)", world_size,
                 backend, parallel.tp, parallel.pp, vpp, parallel.ep, parallel.expert_tensor_parallel_size,
                 runtime.dp_size, parallel_state.get_expert_data_parallel_world_size())
    return runtime


def shutdown(runtime: Runtime) -> None:
    """Tear down megatron's parallel state, and the process group when `runtime`'s phase created it."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if runtime.created_process_group and dist.is_initialized():
        dist.destroy_process_group()


def unwrap(chunk):
    """The bare megatron-core model inside DDP/FSDP and Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


# ---------------------------------------------------------------- small collectives


def _on_backend_device(tensor: torch.Tensor) -> torch.Tensor:
    """NCCL needs CUDA tensors; gloo takes CPU tensors."""
    return tensor.cuda() if torch.cuda.is_available() else tensor


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce a small tensor over a process group, returning it on the CPU."""
    tensor = _on_backend_device(tensor)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.cpu()


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum a few Python numbers over a process group (default: the whole world)."""
    return _all_reduce(torch.tensor(values, dtype=torch.float64), group).tolist()


def fixed_microbatch_shape() -> bool:
    """Whether a step's micro-batches must share one shape: pipeline stages exchange activations of the size the
    schedule is given, so with more than one each micro-batch is padded to the step's longest row."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size() > 1


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


def all_reduce_float(value: float, op, group=None) -> float:
    """One number reduced (`dist.ReduceOp.MAX`, `MIN`, `SUM`) over a process group (default: the whole world)."""
    return float(_all_reduce(torch.tensor([value], dtype=torch.float64), group, op).item())


def all_reduce_int(value: int, op, group=None) -> int:
    """One integer reduced (`dist.ReduceOp.MAX`, `MIN`, `SUM`) over a process group (default: the whole world)."""
    return int(_all_reduce(torch.tensor([value], dtype=torch.long), group, op).item())


def world_max(value: int) -> int:
    """The largest of one integer over every rank (what all ranks must agree on, such as a step's micro-batch count)."""
    return all_reduce_int(value, dist.ReduceOp.MAX)


def model_parallel_shared(compute, *args):
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


@dataclass(frozen=True)
class PipelineStages:
    """This rank's place in its pipeline, for forwards outside megatron-core's schedule (generation): one forward at a
    time passes stage to stage (no microbatch pipelining), as megatron-core's own static-batching inference does.
    Each tensor-parallel rank talks to the same tensor-parallel rank of the next and previous stages."""

    first: bool
    last: bool
    group: object  # the pipeline group: one rank per stage, this rank's tensor-parallel rank
    previous_rank: int  # global ranks
    next_rank: int
    last_rank: int

    @classmethod
    def of_this_rank(cls) -> "PipelineStages | None":
        """The stages of megatron's parallel state; None at pipeline size 1."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return None
        return cls(parallel_state.is_pipeline_first_stage(ignore_virtual=True),
                   parallel_state.is_pipeline_last_stage(ignore_virtual=True),
                   parallel_state.get_pipeline_model_parallel_group(),
                   parallel_state.get_pipeline_model_parallel_prev_rank(),
                   parallel_state.get_pipeline_model_parallel_next_rank(),
                   parallel_state.get_pipeline_model_parallel_last_rank())

    def receive(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's output (its shape and dtype known to both sides)."""
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=self.previous_rank)
        return tensor

    def send(self, tensor: torch.Tensor) -> None:
        """This stage's output to the next stage."""
        dist.send(tensor.contiguous(), dst=self.next_rank)

    def from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's `tensor` on every stage (the others pass a tensor of its shape and dtype)."""
        dist.broadcast(tensor, src=self.last_rank, group=self.group)
        return tensor


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
        totals = _all_reduce(totals, parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        totals = _on_backend_device(totals)
        dist.broadcast(totals, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
        totals = totals.cpu()
    return totals.tolist()
