"""Checkpoint throughput: our save/load of model + optimizer vs torch.save/torch.load of the same tensors,
in one process, same run, interleaved. Prints MB/s and both ratios for two sizes:
  tiny  the embedded default model (0.8M parameters, a 9.6 MB model + Adam checkpoint), where the fixed
        cost of a distributed-checkpointing save dominates;
  wide  the same architecture and tokenizer made wider (hidden 512, 4 layers, 11.9M parameters, a
        ~140 MB checkpoint), where the bytes dominate.
"ours" is the whole `ckpt.checkpoint.save` (megatron-core dist_checkpointing of model and optimizer,
fsync'ed, plus RNG and trainer state, atomic rename, `latest` pointer) and `_load_model_and_optimizer`
(read, copy into the model and optimizer). torch.save neither fsyncs nor renames.

Both sides run with one intra-op thread, as every torchrun worker does (torchrun sets OMP_NUM_THREADS=1):
on a 2-core machine shared with other jobs, torch's parallel tensor copies otherwise wait on descheduled
threads and the measured copy speed collapses (median save 199 ms vs 72 ms on the tiny model here).

Run: .venv/bin/python scripts/bench/bench_checkpoint.py [--repeats 11] [--sizes tiny,wide]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import transformers  # noqa: E402

from ckpt import checkpoint  # noqa: E402
from config import console  # noqa: E402
from config.loops import SFTConfig  # noqa: E402
from model import build, parallel  # noqa: E402

# The tiny model's shape family, wider: 11.9M parameters.
WIDE = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 4}


def wide_checkpoint(tiny: Path, directory: Path, shape: dict = WIDE) -> Path:
    """An HF checkpoint like the tiny model (same tokenizer), with `shape`'s dimensions, seeded weights."""
    config = transformers.AutoConfig.from_pretrained(tiny)
    config.update(shape)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(tiny).save_pretrained(directory)
    return directory


def tensors_of(chunks, optimizer) -> dict[str, torch.Tensor]:
    """The same data our checkpoint holds, as plain tensors: model parameters and Adam state."""
    tensors = {f"model.{name}": param.detach().clone() for name, param in chunks[0].module.named_parameters()}
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for index, state in enumerate(part.optimizer.state.values()):
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"optimizer.{index}.{key}"] = value.detach().clone()
    return tensors


def save_durably(tensors: dict, path: Path) -> None:
    """torch.save, then fsync: what a crash-safe torch.save costs (megatron-core's writer fsyncs every file)."""
    with open(path, "wb") as file:
        torch.save(tensors, file)
        file.flush()
        os.fsync(file.fileno())


def measure(model_path: Path, work: Path, repeats: int, config) -> dict:
    """Median seconds of ours and torch's save and load, interleaved so machine load hits both alike."""
    policy = build.build_policy(config, model_path, build.load_tokenizer(model_path))
    chunks, optimizer = policy.chunks, policy.optimizer
    checkpoint.materialise_optimizer_state(optimizer)  # Adam state exists, as after the first step
    tensors = tensors_of(chunks, optimizer)
    sharded = work / "ours" / checkpoint.checkpoint_name(1) / checkpoint.SHARDED_DIR
    operations = {
        "ours_save": lambda: checkpoint.save(work / "ours", 1, chunks, optimizer, {"step": 1}, 1, True),
        "torch_save": lambda: torch.save(tensors, work / "plain.pt"),
        "torch_save_fsync": lambda: save_durably(tensors, work / "durable.pt"),
        "ours_load": lambda: checkpoint.load_model_and_optimizer(chunks, optimizer, sharded),
        "torch_load": lambda: torch.load(work / "plain.pt"),
    }
    times = {name: [] for name in operations}
    for round_ in range(repeats + 1):  # the first round warms up (file cache, lazily built objects)
        for name, operation in operations.items():
            start = time.perf_counter()
            operation()
            if round_:
                times[name].append(time.perf_counter() - start)
    megabytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values()) / 1e6
    parameters = sum(param.numel() for param in chunks[0].module.parameters())
    return {"megabytes": megabytes, "parameters": parameters, **{name: statistics.median(value) for name, value in times.items()}}


def start_one_process():
    """A benchmark's process as a torchrun worker runs: one intra-op thread, logging, a process group; returns the
    default config, the tiny model's path (built on first use) and the runtime."""
    torch.set_num_threads(1)
    config = SFTConfig()
    console.setup(rank=0)
    return config, build.resolve_model_path(config), parallel.init_distributed(config.parallel, config.train.seed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--sizes", default="tiny,wide")
    args = parser.parse_args()
    config, tiny, runtime = start_one_process()
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        paths = {"tiny": tiny, "wide": work / "wide-model"}
        results = {}
        for size in args.sizes.split(","):
            if size == "wide":
                wide_checkpoint(tiny, paths["wide"])
            results[size] = measure(paths[size], work / size, args.repeats, config)
    finally:
        shutil.rmtree(work)
    print(f"model + Adam state, fp32, 1 process, 1 intra-op thread, median of {args.repeats} interleaved rounds")
    for size, result in results.items():
        megabytes = result["megabytes"]
        print(f"{size}: {result['parameters'] / 1e6:.1f}M parameters, {megabytes:.1f} MB")
        print(f"  save: ours {megabytes / result['ours_save']:8.1f} MB/s   torch.save {megabytes / result['torch_save']:8.1f} MB/s"
              f"   ratio {result['torch_save'] / result['ours_save']:.2f}   (torch.save + fsync "
              f"{megabytes / result['torch_save_fsync']:.1f} MB/s, ratio {result['torch_save_fsync'] / result['ours_save']:.2f})")
        print(f"  load: ours {megabytes / result['ours_load']:8.1f} MB/s   torch.load {megabytes / result['torch_load']:8.1f} MB/s"
              f"   ratio {result['torch_load'] / result['ours_load']:.2f}")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
