"""Activation memory per token per layer: bytes saved for backward, per recompute setting and with/without sequence parallelism.

Run: .venv/bin/python scripts/bench/bench_activation_memory.py [--seq-len 1024] [--dtype bf16]
It launches itself under `torchrun --nproc-per-node 2` (`--worker`). Each variant builds, through the loops' seam
(`model.build.build_policy`), a random-weight model with Qwen2.5-0.5B's layer shape (hidden 896, 14 heads over 2
KV groups, MLP 4864; the tiny tokenizer's 512-row vocabulary instead of 151,936, which changes no layer) with 2 and
with 4 layers, and runs one training-mode forward of one sequence with labels. Every tensor autograd saves for
backward passes through `torch.autograd.graph.saved_tensors_hooks`; the bytes of the distinct storages they keep
alive, parameters excluded, are what that forward costs in activation memory on one rank. The 4-layer figure minus
the 2-layer figure, over 2 layers and over the sequence's tokens, is the cost of one layer per token (embedding,
final norm, output layer and loss cancel). Ratios are against `none` at TP=1 and against sequence parallelism off
at TP=2. The part sequence parallelism splits is the activations of the full hidden size ([seq, batch, hidden]:
norm inputs and outputs, residuals, the inputs of the column-parallel linears), which every TP rank otherwise holds
whole; the TP-sharded parts (attention heads, MLP) are split by TP with or without it.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository's packages, also where the project is not installed (a GPU image)

from model.parallel import free_port  # noqa: E402

LAYER_COUNTS = (2, 4)
# name: (label, arguments beyond the shared ones, what its ratio is taken against)
VARIANTS = {
    "none": ("TP=1, no recompute", [], None),
    "selective": ("TP=1, selective: core_attn", ["--model.recompute=selective"], "none"),
    "selective_mlp": ("TP=1, selective: core_attn,mlp",
                      ["--model.recompute=selective", "--model.recompute_modules=[core_attn,mlp]"], "none"),
    "full": ("TP=1, full (uniform, 1 layer)", ["--model.recompute=full"], "none"),
    "local_none": ("TP=1, local attention, no recompute", ["--model.attention=local"], None),
    "local_selective": ("TP=1, local attention, selective: core_attn",
                        ["--model.attention=local", "--model.recompute=selective"], "local_none"),
    "tp2": ("TP=2, sequence parallelism off", ["--parallel.tp=2", "--parallel.sequence_parallel=false"], None),
    "tp2_sp": ("TP=2, sequence parallelism on", ["--parallel.tp=2"], "tp2"),
    "tp2_sp_selective": ("TP=2, sequence parallelism on, selective: core_attn,mlp",
                         ["--parallel.tp=2", "--model.recompute=selective", "--model.recompute_modules=[core_attn,mlp]"], "tp2"),
    "tp2_sp_full": ("TP=2, sequence parallelism on, full recompute", ["--parallel.tp=2", "--model.recompute=full"], "tp2"),
}


# ---------------------------------------------------------------- measuring (worker side)


def saved_bytes(model, batch: dict, hidden_size: int, parameter_storages: set) -> dict:
    """Bytes of the distinct storages autograd keeps for backward over one forward, and the hidden-sized part of them."""
    import torch

    storages = {}  # data pointer -> (bytes, whether a view of it is a [tokens, ..., hidden] activation)

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            hidden = tensor.shape[-1:] == (hidden_size,) and tensor.numel() == batch["rank_tokens"] * hidden_size
            storages[storage.data_ptr()] = (storage.nbytes(), hidden or storages.get(storage.data_ptr(), (0, False))[1])
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        per_token_loss = model(input_ids=batch["tokens"], position_ids=batch["positions"], attention_mask=None,
                               labels=batch["labels"])  # [batch, seq]
    del per_token_loss
    return {"total": sum(nbytes for nbytes, _ in storages.values()),
            "hidden_sized": sum(nbytes for nbytes, hidden in storages.values() if hidden)}


def measure(name: str, checkpoints: dict, seq_len: int, dtype: str, tokenizer) -> dict:
    """Bytes per token per layer of one variant: (4-layer forward - 2-layer forward) / 2 layers / tokens."""
    import torch

    from config import cli
    from config.loops import SFTConfig
    from model import build, parallel

    figures = {}
    for layers, checkpoint in checkpoints.items():
        config, _ = cli.parse_args(SFTConfig, [f"--model.path={checkpoint}", f"--model.dtype={dtype}",
                                               f"--data.max_seq_len={seq_len}", *VARIANTS[name][1]], "bench")
        config.validate(int(os.environ["WORLD_SIZE"]))
        parallel.init_distributed(config.parallel, config.train.seed)
        policy = build.build_policy(config, Path(checkpoint), tokenizer, trainable=False)
        model = policy.chunks[0].train()
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, len(tokenizer), (1, seq_len + 1), generator=generator)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "positions": torch.arange(seq_len).unsqueeze(0),
                 "rank_tokens": seq_len // config.parallel.sequence_multiple}
        parameter_storages = {param.untyped_storage().data_ptr() for param in model.parameters()}
        figures[layers] = saved_bytes(model, batch, policy.hf_config["hidden_size"], parameter_storages)
        del policy, model
    small, large = (figures[count] for count in LAYER_COUNTS)
    per_layer_token = (LAYER_COUNTS[1] - LAYER_COUNTS[0]) * seq_len
    return {key: (large[key] - small[key]) / per_layer_token for key in ("total", "hidden_sized")}


def worker(out: Path, seq_len: int, dtype: str) -> None:
    """Build the checkpoints (rank 0), measure every variant in this torchrun group, rank 0 writes the figures."""
    import torch
    import transformers

    from config.process import is_global_rank_zero
    from config.sections import ParallelConfig
    from model import parallel, tiny

    parallel.init_distributed(ParallelConfig(), seed=0)
    checkpoints = {layers: out / f"layers{layers}" for layers in LAYER_COUNTS}
    if is_global_rank_zero():
        for layers, directory in checkpoints.items():
            tiny.build_checkpoint(directory, {**tiny.QWEN2_0P5B_CONFIG, "num_hidden_layers": layers, "dtype": "float32"})
    torch.distributed.barrier()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[LAYER_COUNTS[0]])
    rows = {name: measure(name, checkpoints, seq_len, dtype, tokenizer) for name in VARIANTS}
    if is_global_rank_zero():
        (out / "figures.json").write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- the table (launcher side)




def table(rows: dict, seq_len: int, dtype: str) -> str:
    """Bytes per token per layer and the ratios, one line per variant."""
    lines = [f"Activation memory per token per layer, one rank, {dtype}, sequence {seq_len}, Qwen2.5-0.5B layer shape:",
             f"{'variant':<58} {'bytes':>8} {'ratio':>7} {'hidden-sized part':>18} {'its ratio':>10}"]
    for name, (label, _, baseline) in VARIANTS.items():
        row = rows[name]
        ratio = f"{row['total'] / rows[baseline]['total']:.3f}" if baseline else "1"
        # The split by sequence parallelism is the TP=2 rows' story (at TP=1 the attention output is hidden-sized too).
        shows_part = name.startswith("tp2")
        part = f"{row['hidden_sized']:.0f}" if shows_part else ""
        part_ratio = f"{row['hidden_sized'] / rows[baseline]['hidden_sized']:.3f}" if shows_part and baseline else ""
        lines.append(f"{label:<58} {row['total']:>8.0f} {ratio:>7} {part:>18} {part_ratio:>10}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--worker", action="store_true", help="internal: measure in this torchrun group")
    parser.add_argument("--out", help="internal: the worker's scratch directory")
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.out), args.seq_len, args.dtype)
        return
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                   str(Path(__file__).resolve()), "--worker", "--out", scratch, "--seq-len", str(args.seq_len),
                   "--dtype", args.dtype]
        process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=os.environ)
        if process.returncode != 0:
            sys.exit(f"worker failed ({process.returncode}):\n{process.stdout[-4000:]}\n{process.stderr[-8000:]}")
        rows = json.loads((Path(scratch) / "figures.json").read_text())
    print(table(rows, args.seq_len, args.dtype))


if __name__ == "__main__":
    main()
