"""`trainer.sft` with the FusedAdam test double standing in for Transformer Engine (run under torchrun).

Usage: torchrun --nproc-per-node 2 tests/distributed/sft_with_fused_adam_double.py [trainer.sft arguments]
          [--then trainer.sft arguments ...]

Each `--then` starts another run in the same processes, after the one before it (a resume included): the imports and
torchrun's start-up are paid once.

Besides the run's metrics.jsonl, every rank writes `<train.out_dir>/precision_state.rank<R>.json`: the
dtypes the optimizer state and the DDP gradient buffers really had after the last step, read from the
policy `trainer.sft.main` returns.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts import fused_adam_double  # noqa: E402


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (possibly chained) optimizer."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.optimizer for part in parts]


def describe(chunks, optimizer) -> dict:
    """Distinct dtypes of the optimizer's parameters, state and decoupled gradients, and of the DDP gradient buffers."""
    found = {"optimizer_class": set(), "param": set(), "decoupled_grad": set(), "exp_avg": set(), "exp_avg_sq": set(),
             "master_param": set(), "grad_buffer": set(), "grad_buffer_data": set(), "state_tensors": 0}
    for inner in inner_optimizers(optimizer):
        found["optimizer_class"].add(type(inner).__name__)
        for group in inner.param_groups:
            for param in group["params"]:
                found["param"].add(dtype_name(param.dtype))
                if getattr(param, "decoupled_grad", None) is not None:
                    found["decoupled_grad"].add(dtype_name(param.decoupled_grad.dtype))
                for name, value in inner.state[param].items():
                    if name in ("exp_avg", "exp_avg_sq", "master_param"):
                        found[name].add(dtype_name(value.dtype))
                        found["state_tensors"] += 1
    for chunk in chunks:
        if chunk.ddp_config.use_megatron_fsdp:  # its gradient buffers are its own (`megatron_fsdp_main_grads_dtype`)
            continue
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            found["grad_buffer"].add(dtype_name(buffer.grad_dtype))
            found["grad_buffer_data"].add(dtype_name(buffer.grad_data.dtype))
    return {key: sorted(value) if isinstance(value, set) else value for key, value in found.items()}


def main(argv: list[str]) -> None:
    fused_adam_double.install()
    import torch.distributed as dist

    from config import cli
    from config.loops import SFTConfig
    from shared_launch import import_bridge, release_models  # beside this file (the script's directory is on sys.path)
    from trainer import sft

    runs = [[]]
    for word in argv:
        runs.append([]) if word == "--then" else runs[-1].append(word)
    import_bridge()
    dist.init_process_group("gloo")  # the runs' group: each loop keeps a group it did not create
    for run in runs:
        policy = sft.main(run)
        out_dir = cli.parse_args(SFTConfig, run, "trainer.sft")[0].train.out_dir
        if policy is not None:
            report = describe(policy.chunks, policy.optimizer)
            rank = int(os.environ.get("RANK", "0"))
            Path(out_dir, f"precision_state.rank{rank}.json").write_text(json.dumps(report, indent=1))
            print(f"[fused-adam double] rank {rank}: {report}", flush=True)
        del policy
        release_models()


if __name__ == "__main__":
    main(sys.argv[1:])
