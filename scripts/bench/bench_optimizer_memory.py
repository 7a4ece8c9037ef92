"""Bytes per parameter of gradient buffers and optimizer state, counted from the tensors megatron-core allocated.

Run: .venv/bin/python scripts/bench/bench_optimizer_memory.py [--model-path DIR] [--data-parallel-sizes 1,2]
It launches two sub-runs itself (`torchrun --nproc-per-node 1` and `2` with `--worker`), each of which
builds the tiny model once per variant exactly as trainer.sft does, takes one optimizer step (Adam
state is created lazily) and sums numel x element_size over:
  grads   DDP gradient buffers (`buffer.grad_data`) / Megatron-FSDP main-gradient buffers;
  master  fp32 copies the optimizer updates: the distributed optimizer's fp32 shards of bf16 params,
          FusedAdam's `master_param` state, Megatron-FSDP's main-weight buffer (the model's own fp32
          weights are not a second copy, so fp32 DDP has none);
  moments the optimizer's `exp_avg` and `exp_avg_sq` (local shards of DTensors).
Each figure is bytes on one rank divided by the model's parameter count, the unit of megatron-core's
distributed-optimizer table (docs: api-guide/dist_optimizer), which also adds the model weights (shown
separately here): at DP=d the distributed optimizer divides master + moments by d but keeps whole
gradient buffers; Megatron-FSDP (`optim_grads_params`) divides weights, gradients and state by d.
Buffers are padded for bucketing, so figures sit slightly above the ideal ones. The "grad dtype"
column is the dtype of the gradient buffers actually allocated. On a GPU a "peak GiB" column adds the
variant's high-water mark of allocated memory during its step (above what was allocated before it).

The precision-aware row runs on scripts/fused_adam_double.py, a TEST DOUBLE of Transformer Engine's
FusedAdam (TE needs CUDA): its state tensors have the dtypes and sizes TE 2.0's would have.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository's packages, also where the project is not installed (a GPU image)

from model.parallel import free_port  # noqa: E402

SAME_BATCH = ["--train.steps=1", "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.eval_samples=0"]
# name: (label in the table, trainer.sft arguments)
VARIANTS = {
    "fp32_ddp": ("fp32 DDP", ["--parallel.use_distributed_optimizer=false"]),
    "bf16_default": ("bf16, fp32 grads + optimizer state (default)", ["--model.dtype=bf16"]),
    "bf16_precision_aware": ("bf16 precision-aware, bf16 moments+grads [FusedAdam test double]", [
        "--model.dtype=bf16", "--optim.use_precision_aware_optimizer=true", "--optim.main_grads_dtype=bf16",
        "--optim.exp_avg_dtype=bf16", "--optim.exp_avg_sq_dtype=bf16"]),
    "fsdp_fp32": ("fp32 Megatron-FSDP (optim_grads_params)", ["--parallel.use_megatron_fsdp=true"]),
    "fsdp_bf16": ("bf16 Megatron-FSDP (optim_grads_params)", ["--parallel.use_megatron_fsdp=true", "--model.dtype=bf16"]),
}
USES_DOUBLE = {"bf16_precision_aware"}
RUNS_PER_DATA_PARALLEL_SIZE = {1: ["fp32_ddp", "bf16_default", "bf16_precision_aware"], 2: list(VARIANTS)}
CATEGORIES = ("weights", "grads", "master", "exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------- counting (worker side)


def local_bytes(tensor) -> int:
    """Bytes this rank holds for a tensor (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def storage_of(tensor) -> int:
    """Identity of the memory a tensor views."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


def count_bytes(chunks, optimizer) -> dict:
    """Bytes per category on this rank, read from the buffers and optimizer state that exist after a step."""
    counted = dict.fromkeys(CATEGORIES, 0)
    known_storages, grad_dtypes = set(), set()

    def add(category: str, tensor) -> None:
        if tensor is not None:
            counted[category] += local_bytes(tensor)
            known_storages.add(storage_of(tensor))
            if category == "grads":
                grad_dtypes.add(str(tensor.dtype).removeprefix("torch."))

    for chunk in chunks:
        fsdp_buffer = getattr(chunk, "param_and_grad_buffer", None)
        if chunk.ddp_config.use_megatron_fsdp:
            for group in fsdp_buffer.parameter_groups:
                for category, buffer in (("weights", group.model_weight_buffer), ("master", group.main_weight_buffer),
                                         ("grads", group.main_grad_buffer)):
                    add(category, getattr(buffer, "data", None))
            continue
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            add("grads", buffer.grad_data)
            if buffer.param_data is not None:
                add("weights", buffer.param_data)  # the distributed optimizer moves params into one buffer
            else:
                for param in buffer.params:
                    add("weights", param.data)
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                # An optimizer param that is not a view of a buffer counted above is an fp32 master copy.
                if storage_of(param) not in known_storages:
                    counted["master"] += local_bytes(param)
                for name in ("exp_avg", "exp_avg_sq", "master_param"):
                    if name in inner.state[param]:
                        counted["master" if name == "master_param" else name] += local_bytes(inner.state[param][name])
    return {**counted, "grad_dtype": "/".join(sorted(grad_dtypes))}


def measure(name: str, runtime, examples, tokenizer, model_path: str) -> dict:
    """Build one variant as trainer.sft does, take one step, count its bytes."""
    import torch

    from config import cli
    from config.loops import SFTConfig
    from data import sft as sft_data
    from model import build
    from scripts import fused_adam_double
    from trainer import metrics, sft

    if name in USES_DOUBLE:
        fused_adam_double.install()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated()
    try:
        config, _ = cli.parse_args(SFTConfig, [*SAME_BATCH, f"--model.path={model_path}", *VARIANTS[name][1]],
                                   "bench_optimizer_memory")
        config.validate(runtime.world_size)
        policy = build.build_policy(config, build.resolve_model_path(config), tokenizer)
        chunks, optimizer = policy.chunks, policy.optimizer
        schedule = sft_data.BatchSchedule(len(examples), config.train.global_batch_size, config.train.micro_batch_size,
                                          runtime.dp_rank, runtime.dp_size, config.train.seed)
        microbatches, seq_len = sft.collate_microbatches(examples, schedule.next_global_batch(), config,
                                                         tokenizer.pad_token_id, runtime.device)
        loss_sum, tokens, _, _ = sft.train_step(policy, microbatches, seq_len, metrics.StepTimer())
        parameters = sum(param.numel() for chunk in chunks for param in chunk.parameters())  # DTensors count globally
        counted = count_bytes(chunks, optimizer)
        inner = type(getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer).__name__
        row = {"variant": name, "dp": runtime.dp_size, "parameters": parameters, "optimizer": inner,
               "loss": loss_sum / max(tokens, 1), **counted}
        if torch.cuda.is_available():
            row["peak_gib"] = (torch.cuda.max_memory_allocated() - allocated_before) / 2**30
        return row
    finally:
        if name in USES_DOUBLE:
            fused_adam_double.uninstall()
        gc.collect()


def worker(names: list[str], out: Path, model_path: str) -> None:
    """Measure each named variant in this process group; rank 0 writes the rows (each rank's bytes are equal up to padding)."""
    import torch.distributed as dist
    import transformers

    from config import console
    from config.loops import SFTConfig
    from config.sections import ModelConfig, ParallelConfig
    from data import conversations as conversation_data, sft as sft_data
    from model import build, parallel

    console.setup(rank=1)
    path = build.resolve_model_path(SFTConfig(model=ModelConfig(path=model_path)))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    rows = conversation_data.load_rows("arithmetic")[:64]
    conversations, report = conversation_data.to_conversations(rows)
    examples = sft_data.build_examples(conversations, tokenizer, 128, report)
    runtime = parallel.init_distributed(ParallelConfig(), seed=1234)
    results = []
    for name in names:
        row = measure(name, runtime, examples, tokenizer, model_path)
        per_rank = [None] * runtime.world_size
        dist.all_gather_object(per_rank, row)
        # Report the rank holding the most (shards can differ by padding).
        results.append(max(per_rank, key=lambda item: sum(item[key] for key in CATEGORIES)))
    if runtime.is_main:
        out.write_text(json.dumps(results))
    parallel.shutdown(runtime)


# ---------------------------------------------------------------- driver



def table(rows: list[dict]) -> str:
    """Bytes per parameter, per rank, by category."""
    header = (f"{'variant':66s} {'DP':>2s} {'grad dtype':>10s} {'grads':>6s} {'master':>6s} {'exp_avg':>7s} {'exp_sq':>6s} "
              f"{'grads+state':>11s} {'+weights':>8s}" + (f" {'peak GiB':>8s}" if "peak_gib" in rows[0] else ""))
    lines = [header, "-" * len(header)]
    for row in rows:
        per = {key: row[key] / row["parameters"] for key in CATEGORIES}
        label = VARIANTS[row["variant"]][0]
        state = per["grads"] + per["master"] + per["exp_avg"] + per["exp_avg_sq"]
        lines.append(f"{label:66s} {row['dp']:>2d} {row['grad_dtype']:>10s} {per['grads']:6.2f} {per['master']:6.2f} {per['exp_avg']:7.2f} "
                     f"{per['exp_avg_sq']:6.2f} {state:11.2f} {state + per['weights']:8.2f}"
                     + (f" {row['peak_gib']:8.2f}" if "peak_gib" in row else ""))
    return "\n".join(lines)


def grads_and_state(row: dict) -> float:
    """Gradient buffers plus optimizer state, bytes per parameter."""
    return sum(row[key] for key in ("grads", "master", "exp_avg", "exp_avg_sq")) / row["parameters"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help="internal: measure --variants in this torchrun group")
    parser.add_argument("--variants", default="", help="internal: comma-separated variant names")
    parser.add_argument("--out", type=Path, help="internal: where the worker writes its rows")
    parser.add_argument("--model-path", default="tiny", help="model.path of the model to measure (default: tiny)")
    parser.add_argument("--data-parallel-sizes", default="1,2", help="comma-separated DP sizes to run (one process per rank)")
    args = parser.parse_args()
    if args.worker:
        worker(args.variants.split(","), args.out, args.model_path)
        return
    sizes = [int(size) for size in args.data_parallel_sizes.split(",")]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # this interpreter's torchrun, wherever it lives
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for data_parallel_size in sizes:
            names = RUNS_PER_DATA_PARALLEL_SIZE[data_parallel_size]
            out = Path(scratch) / f"dp{data_parallel_size}.json"
            command = [*torchrun, "--nproc-per-node", str(data_parallel_size), "--master-port", str(free_port()),
                       __file__, "--worker", f"--variants={','.join(names)}", f"--out={out}", f"--model-path={args.model_path}"]
            print(f"measuring at DP={data_parallel_size}: {', '.join(names)}", flush=True)
            process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=os.environ)
            if process.returncode != 0:
                sys.exit(f"{' '.join(command)} failed:\n{process.stdout[-3000:]}\n{process.stderr[-5000:]}")
            rows += json.loads(out.read_text())
    print(f"\nbytes per parameter, per rank (model {args.model_path}, {rows[0]['parameters']:,} parameters; "
          "one optimizer step taken)\n")
    print(table(rows))
    at_dp1 = {row["variant"]: row for row in rows if row["dp"] == 1}
    ratio = grads_and_state(at_dp1["bf16_precision_aware"]) / grads_and_state(at_dp1["bf16_default"])
    print(f"\nprecision-aware / default (grads + optimizer state, DP=1): {ratio:.3f}  (target <= 0.65)")
    print("inner optimizers: " + ", ".join(sorted({f"{row['variant']}: {row['optimizer']}" for row in rows})))


if __name__ == "__main__":
    main()
