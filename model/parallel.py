"""Distributed start-up in one place: process group from torchrun's environment, megatron parallel state, seeding."""

import logging
import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from model import cpu_compat

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

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files and prints."""
        return self.rank == 0


def _free_port() -> int:
    """A free TCP port on this host, for a single process started without torchrun."""
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


def init_distributed(tp: int, pp: int, vpp: int | None, seed: int) -> Runtime:
    """Join the process group torchrun describes (or a group of one), set up TP/PP/VPP/DP, seed every RNG."""
    from megatron.core import parallel_state

    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        cpu_compat.activate()
    rank = int(os.environ.setdefault("RANK", "0"))
    world_size = int(os.environ.setdefault("WORLD_SIZE", "1"))
    local_rank = int(os.environ.setdefault("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # python -m trainer.sft without torchrun
        os.environ["MASTER_PORT"] = str(_free_port())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    seed_everything(seed)
    runtime = Runtime(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device,
    )
    if runtime.is_main:
        backend = "nccl on CUDA" if use_cuda else "gloo on CPU (CPU compatibility layer active)"
        log.info("distributed: %d processes, %s; TP=%d PP=%d VPP=%s DP=%d", world_size, backend, tp, pp, vpp, runtime.dp_size)
    return runtime


def shutdown() -> None:
    """Tear down megatron's parallel state and the process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
