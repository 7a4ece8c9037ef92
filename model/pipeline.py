"""A forward's hops between pipeline stages outside megatron-core's schedule (generation): `PipelineStages`."""

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist


log = logging.getLogger(__name__)



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
