"""Checkpoint throughput: our save/load of model + optimizer (megatron-core distributed checkpointing) vs
torch.save/torch.load of the same tensors, in one process, same run. Prints MB/s and both ratios.

Run: .venv/bin/python scripts/bench_checkpoint.py [--repeats 5]
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ckpt import checkpoint  # noqa: E402
from model import build, parallel  # noqa: E402
from trainer import common, precision  # noqa: E402
from trainer.config import SFTConfig  # noqa: E402


def tensors_of(chunks, optimizer) -> dict[str, torch.Tensor]:
    """The same data our checkpoint holds, as plain tensors: model parameters and Adam state."""
    tensors = {f"model.{name}": param.detach().clone() for name, param in chunks[0].module.named_parameters()}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for index, state in enumerate(part.optimizer.state.values()):
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"optimizer.{index}.{key}"] = value.detach().clone()
    return tensors


def median_seconds(function, repeats: int) -> float:
    """Median wall time of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = SFTConfig()
    common.setup_logging(True)
    path = build.resolve_model_path("tiny")
    parallel.init_distributed(1, 1, None, config.train.seed)
    optimizer_config = precision.optimizer_config(config)
    provider = build.configure_provider(build.auto_bridge(path), dtype="fp32", tp=1, pp=1, vpp=None, seq_length=128)
    chunks = build.build_chunks(provider, precision.ddp_config(config, optimizer_config, build.environment_ddp_defaults()))
    optimizer, _ = common.build_optimizer_and_schedule(chunks, optimizer_config, config)
    checkpoint._materialise_optimizer_state(optimizer)  # Adam state exists, as after the first step
    tensors = tensors_of(chunks, optimizer)
    megabytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values()) / 1e6
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        ours_save = median_seconds(lambda: checkpoint.save(work / "ours", 1, chunks, optimizer, {"step": 1}, 1, True), args.repeats)
        ours_load = median_seconds(lambda: checkpoint._load_model_and_optimizer(
            chunks, optimizer, work / "ours" / checkpoint.checkpoint_name(1) / checkpoint.SHARDED_DIR), args.repeats)
        torch_save = median_seconds(lambda: torch.save(tensors, work / "plain.pt"), args.repeats)
        torch_load = median_seconds(lambda: torch.load(work / "plain.pt"), args.repeats)
    finally:
        shutil.rmtree(work)
    print(f"model + optimizer state: {megabytes:.1f} MB (tiny model, fp32, 1 process), median of {args.repeats}")
    print(f"  save: ours {megabytes / ours_save:8.1f} MB/s   torch.save {megabytes / torch_save:8.1f} MB/s   "
          f"ratio {torch_save / ours_save:.2f}")
    print(f"  load: ours {megabytes / ours_load:8.1f} MB/s   torch.load {megabytes / torch_load:8.1f} MB/s   "
          f"ratio {torch_load / ours_load:.2f}")
    parallel.shutdown()


if __name__ == "__main__":
    main()
