"""Asynchronous checkpoint saves: how long the training loop is blocked by an asynchronous save, against a
synchronous save of the same state, in one run, on a model of 113M parameters (the tiny model's architecture and
tokenizer made wider and deeper: a 1.8 GB model + Adam checkpoint).

  sync   `ckpt.checkpoint.save` as with `ckpt.async_save=false`: the loop waits for the whole write.
  async  the same call with megatron-core's asynchronous saving (`BackgroundSaves`, as `ckpt.async_save=true`): the
         loop is blocked while the save is planned and its writer forked, then at each later step for the poll that
         asks whether every rank's writer has finished, and once for the publish (index, rename, `latest`).
Between the polls the loop runs "steps": every parameter and Adam moment is updated in place (so every page the
forked writer still reads is copied on write, the fork's real memory cost) and a fixed number of matrix products.
Their time with a writer running beside them against without is printed too: on a machine with few cores the writer
takes CPU from training, which the blocked time does not show.

Both sides run with one intra-op thread, as every torchrun worker does. Prints medians of --repeats interleaved
rounds and the ratio blocked/sync (target: at most 0.2).

Run: .venv/bin/python scripts/bench/bench_async_save.py [--repeats 3]
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_checkpoint import start_one_process, wide_checkpoint  # noqa: E402
from ckpt import checkpoint  # noqa: E402
from model import build, parallel  # noqa: E402

# 113M parameters: 10 layers of hidden 1024 (16 query heads, 4 key/value heads, MLP 2816).
LARGE = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4,
         "num_hidden_layers": 10}
STEP_MATMULS = 300  # of 256 x 256: about 0.3 s on one core here


def a_step(tensors: list, work: torch.Tensor) -> float:
    """One stand-in training step: touch every tensor in place, then STEP_MATMULS matrix products; its seconds."""
    started = time.perf_counter()
    with torch.no_grad():
        for tensor in tensors:
            tensor.mul_(1.0)
        for _ in range(STEP_MATMULS):
            work @ work
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config, tiny, runtime = start_one_process()
    work_dir = Path(tempfile.mkdtemp(prefix="bench-async-save-"))
    try:
        model_path = wide_checkpoint(tiny, work_dir / "model", LARGE)
        policy = build.build_policy(config, model_path, build.load_tokenizer(model_path))
        chunks, optimizer = policy.chunks, policy.optimizer
        checkpoint.materialise_optimizer_state(optimizer)  # Adam state exists, as after the first step
        parameters = sum(param.numel() for param in chunks[0].parameters())
        tensors = [param for param in chunks[0].parameters()] + [
            value for part in getattr(optimizer, "chained_optimizers", [optimizer])
            for state in part.optimizer.state.values() for value in state.values() if torch.is_tensor(value) and value.dim()]
        work = torch.randn(256, 256)
        background = checkpoint.BackgroundSaves()
        times = {"sync": [], "async_blocked": [], "async_total": [], "step_alone": [], "step_beside_writer": []}
        for round_ in range(args.repeats):
            directory = work_dir / f"round{round_}"
            started = time.perf_counter()
            checkpoint.save(directory / "sync", 1, chunks, optimizer, {"step": 1}, 1, True)
            times["sync"].append(time.perf_counter() - started)
            times["step_alone"] += [a_step(tensors, work) for _ in range(2)]

            started = time.perf_counter()
            checkpoint.save(directory / "async", 1, chunks, optimizer, {"step": 1}, 1, True, background=background)
            blocked = time.perf_counter() - started
            while background.pending():
                times["step_beside_writer"].append(a_step(tensors, work))
                polled = time.perf_counter()
                background.finish(wait=False)
                blocked += time.perf_counter() - polled
            times["async_total"].append(time.perf_counter() - started)
            times["async_blocked"].append(blocked)
            megabytes = checkpoint.tree_bytes(directory / "async" / checkpoint.checkpoint_name(1)) / 1e6
            shutil.rmtree(directory)
    finally:
        shutil.rmtree(work_dir)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"{parameters / 1e6:.0f}M parameters, fp32 model + Adam state, a {megabytes:.0f} MB checkpoint; 1 process, "
          f"1 intra-op thread; medians of {args.repeats} interleaved rounds")
    print(f"  sync save:           loop blocked {median['sync']:6.2f} s")
    print(f"  async save:          loop blocked {median['async_blocked']:6.2f} s  (published after {median['async_total']:.2f} s)")
    print(f"  blocked / sync:      {median['async_blocked'] / median['sync']:.3f}   (target <= 0.2)")
    print(f"  a stand-in step:     alone {median['step_alone']:.2f} s, beside the writer {median['step_beside_writer']:.2f} s "
          f"({len(times['step_beside_writer'])} steps beside it)")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
