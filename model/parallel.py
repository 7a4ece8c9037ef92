"""Distributed start-up in one place: process group from torchrun's environment, megatron parallel state, seeding;
the few facts of the layout the loops ask (`unwrap`, `fixed_microbatch_shape`). Collectives: `model.collectives`;
user code once per model replica: `model.replica`; hops between pipeline stages: `model.pipeline`."""

import dataclasses
import datetime
import logging
import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from config.errors import UserError
from config.process import is_global_rank_zero, meet_peers_at_startup
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
    link: object = None  # asynchronous GRPO: the `model.link.Link` to the other side (this process's world is its side)

    @property
    def is_rollout(self) -> bool:
        """A rollout process of asynchronous GRPO (`grpo.rollout_processes`): it samples, the others train."""
        return self.link is not None and self.link.is_rollout

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


def use_local_gpu(parallel, world_size: int) -> torch.device:
    """This process's device: on CUDA its node-local GPU (torchrun's LOCAL_RANK) made the current one, with
    CUDA_DEVICE_MAX_CONNECTIONS set first (`set_cuda_connections`: binding the GPU creates the CUDA context); the CPU
    elsewhere. Before any user code is imported (GRPO's reward, tools, environment), so a module that puts a model on
    "cuda" at import lands on this rank's GPU, not every rank's of a node on its first. Called again (by
    `init_distributed`), it changes nothing."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= gpus:  # CUDA's `invalid device ordinal` otherwise; NCCL refuses two processes on one GPU
        processes = os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise UserError(f"Each process needs a GPU of its own, and torchrun started {processes} processes on this node "
                        f"(`torchrun --nproc-per-node`), and it has {gpus} GPUs visible (CUDA_VISIBLE_DEVICES={visible}): "
                        f"this process, local rank {local_rank}, has none. Start at most {gpus} processes per node, or "
                        "make more GPUs visible.")
    set_cuda_connections(parallel, detect_environment(parallel, world_size))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def rollout_layout(parallel):
    """A rollout process's layout (asynchronous GRPO): the whole model on one process, forward only."""
    return dataclasses.replace(parallel, tp=1, pp=1, vpp=1, ep=1, etp=0, use_megatron_fsdp=False,
                               use_distributed_optimizer=False)


def _join_side(backend: str, rank: int, world_size: int, rollout_processes: int, timeout):
    """Asynchronous GRPO: this process's default group is its side's (trainers: global ranks 0..T-1; rollout
    processes: the last `rollout_processes`), each with its own megatron-core parallel state, and the `model.link.Link`
    joins the two sides."""
    from model import link

    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store = dist.PrefixStore(link.store_prefix(), store)
    trainers = world_size - rollout_processes
    rollout = rank >= trainers
    dist.init_process_group(backend, store=dist.PrefixStore("rollout/" if rollout else "trainers/", store),
                            rank=rank - trainers if rollout else rank, world_size=rollout_processes if rollout else trainers,
                            timeout=timeout)
    return link.Link(store, rank, world_size, trainers)


def init_distributed(parallel, seed: int, rollout_processes: int = 0) -> Runtime:
    """Join the process group torchrun describes (or a group of one), set up TP/PP/VPP/EP/ETP/DP for `parallel`, seed
    every RNG. With `rollout_processes` (asynchronous GRPO) each side is its own world (`_join_side`); a rollout
    process lays out `rollout_layout(parallel)`.

    Called again in the same process (GRPO's default start trains the default SFT first), it keeps the
    process group, so there is no second rendezvous, and lays out the model-parallel groups anew.
    """
    created_process_group = not dist.is_initialized()
    if created_process_group:  # a rank that stopped before this point ends the launch now, with its paragraph
        meet_peers_at_startup(parallel.timeout_minutes * 60)
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
    # When GRPO (which binds the GPU before importing user code) or its default start calls this a second time in one
    # process, the context exists and the first call's CUDA_DEVICE_MAX_CONNECTIONS stays.
    device = use_local_gpu(parallel, world_size)
    if rollout_processes and not created_process_group:
        raise UserError(f"`grpo.rollout_processes={rollout_processes}` gives the trainers and the rollout processes a "
                        "default process group each, and this process already has one (a program that calls "
                        "`trainer.grpo.main` inside its own process group): start asynchronous GRPO with torchrun "
                        "directly, or set `--grpo.rollout_processes=0`.")
    backend, timeout = "nccl" if use_cuda else "gloo", datetime.timedelta(minutes=parallel.timeout_minutes)
    side_link = None
    if created_process_group and rollout_processes:
        side_link = _join_side(backend, rank, world_size, rollout_processes, timeout)
        parallel = rollout_layout(parallel) if side_link.is_rollout else parallel
    elif created_process_group:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
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
        link=side_link,
    )
    if runtime.is_main:
        backend = "nccl on CUDA" if use_cuda else "gloo on CPU (CPU compatibility layer active)"
        if side_link is not None:
            backend += (f"; {side_link.trainers} of them train, the last {side_link.rollouts} only sample (each a whole "
                        "replica of the policy), joined by gloo")
        log.info("distributed: %d process%s, %s; TP=%d PP=%d VPP=%s EP=%d ETP=%d DP=%d (expert DP=%d)", world_size,
                 "" if world_size == 1 else "es", backend, parallel.tp, parallel.pp, vpp, parallel.ep,
                 parallel.expert_tensor_parallel_size, runtime.dp_size, parallel_state.get_expert_data_parallel_world_size())
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




def fixed_microbatch_shape() -> bool:
    """Whether a step's micro-batches must share one shape: pipeline stages exchange activations of the size the
    schedule is given, so with more than one each micro-batch is padded to the step's longest row."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size() > 1


