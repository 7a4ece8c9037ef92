"""Run by tests/test_precision_e2e.py in the shared launch (shared_launch.py, 2 processes): `broadcast_parameters`
syncs every model chunk.

Two small chunks stand in for virtual pipeline stages. Rank 1 perturbs both (the second one with an
expert-style parameter too, which is replicated over the expert-data-parallel group), then
`model.wrapping.broadcast_parameters(chunks)` runs. Every rank writes `<out>/rank<R>.json`: for each
chunk, whether its parameters were equal on all ranks before and after the call.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from config.sections import ParallelConfig
from model import parallel, wrapping


def make_chunk() -> torch.nn.Module:
    """A small two-layer stack; the global seed makes it identical on every rank."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def equal_on_all_ranks(chunk: torch.nn.Module) -> bool:
    """Whether every rank holds exactly rank 0's parameters (all_gather and compare)."""
    flat = torch.cat([param.detach().reshape(-1) for param in chunk.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def run(args) -> None:
    runtime = parallel.init_distributed(ParallelConfig(), seed=3)
    chunks = [make_chunk(), make_chunk()]
    # Expert weights take the other branch of broadcast_parameters (megatron marks them allreduce=False).
    chunks[1][2].bias.allreduce = False
    if runtime.rank == 1:
        with torch.no_grad():
            for index, chunk in enumerate(chunks):
                for param in chunk.parameters():
                    param.add_(1.0 + index)
    before = [equal_on_all_ranks(chunk) for chunk in chunks]
    wrapping.broadcast_parameters(chunks)
    after = [equal_on_all_ranks(chunk) for chunk in chunks]
    result = {"rank": runtime.rank, "world_size": runtime.world_size, "dp_size": runtime.dp_size,
              "equal_before": before, "equal_after": after}
    print(f"[sync chunks] rank {runtime.rank}: {result}", flush=True)
    Path(args.out, f"rank{runtime.rank}.json").write_text(json.dumps(result))
    parallel.shutdown(runtime)

