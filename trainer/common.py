"""Pieces both loops share: logging on rank 0, optimizer and schedule, one optimizer step, metrics."""

import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("trainer")

# bf16 dense peak FLOP/s by GPU name, for the MFU estimate.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


def setup_logging(is_main: bool) -> None:
    """Our loggers print on rank 0 only; other libraries' INFO chatter is silenced."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    # Deprecation and "X is not installed, falling back" notices from the stack are not actionable here.
    warnings.filterwarnings("ignore", module=r"(megatron|transformers|torch|modelopt)\b")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("trainer", "model", "data", "ckpt"):
        logging.getLogger(name).setLevel(logging.INFO if is_main else logging.WARNING)
    for noisy in ("megatron", "megatron.core", "megatron.bridge", "transformers", "datasets", "py.warnings"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def checkpoint_dir(config) -> Path:
    """`ckpt.dir`, defaulting to `<train.out_dir>/checkpoints`."""
    return Path(config.ckpt.dir or Path(config.train.out_dir) / "checkpoints")


def build_optimizer_and_schedule(chunks: list, optimizer_config, config):
    """megatron-core optimizer over every chunk and its warmup + cosine LR schedule of `train.steps` steps."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(optimizer_config, chunks)
    warmup = min(config.optim.warmup_steps, max(config.train.steps - 1, 0))
    schedule = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=config.optim.lr,
        min_lr=config.optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=config.train.steps,
        lr_decay_style="cosine",
        start_wd=config.optim.weight_decay,
        end_wd=config.optim.weight_decay,
        wd_incr_steps=config.train.steps,
        wd_incr_style="constant",
    )
    return optimizer, schedule


def reduce_loss_over_data_parallel(losses_reduced: list[dict]) -> tuple[float, float]:
    """Global-batch (loss sum, token count) from the microbatch outputs, made known to every rank.

    Only the last pipeline stage holds losses: it sums over data-parallel ranks and then
    broadcasts along the pipeline so rank 0 (first stage) can log it.
    """
    from megatron.core import parallel_state

    totals = torch.zeros(2, dtype=torch.float64)
    for item in losses_reduced:
        totals += item["loss"].detach().to("cpu", torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        totals = _all_reduce(totals, parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        totals = _broadcast(totals, parallel_state.get_pipeline_model_parallel_last_rank(),
                            parallel_state.get_pipeline_model_parallel_group())
    return totals[0].item(), totals[1].item()


def _on_backend_device(tensor: torch.Tensor) -> torch.Tensor:
    """NCCL needs CUDA tensors; gloo takes CPU tensors."""
    return tensor.cuda() if torch.cuda.is_available() else tensor


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum a small tensor over a process group, returning it on the CPU."""
    tensor = _on_backend_device(tensor)
    dist.all_reduce(tensor, group=group)
    return tensor.cpu()


def _broadcast(tensor: torch.Tensor, source: int, group) -> torch.Tensor:
    """Broadcast a small tensor from a global rank within a group, returning it on the CPU."""
    tensor = _on_backend_device(tensor)
    dist.broadcast(tensor, src=source, group=group)
    return tensor.cpu()


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum a few Python numbers over a process group (default: the whole world)."""
    return _all_reduce(torch.tensor(values, dtype=torch.float64), group).tolist()


def model_flops_per_token(hf_config: dict, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x matmul parameters plus causal attention scores."""
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hidden // heads
    intermediate, vocab = hf_config["intermediate_size"], hf_config["vocab_size"]
    attention = hidden * head_dim * (heads * 2 + kv_heads * 2)  # q, o, k, v projections
    mlp = 3 * hidden * intermediate  # gate, up, down
    matmul_parameters = layers * (attention + mlp) + hidden * vocab
    # QK^T and attention x V: 2 matmuls, causal halves them, x3 for forward + backward.
    attention_scores = 3 * layers * 2 * 2 * seq_length * hidden / 2
    return 6 * matmul_parameters + attention_scores


def peak_flops() -> float | None:
    """The bf16 dense peak of this GPU, or None (CPU, or a GPU not in the table)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


class MetricsWriter:
    """Rank 0's metrics.jsonl (one object per step) and its console progress bar with ETA."""

    def __init__(self, out_dir: Path, is_main: bool, total_steps: int, start_step: int, log_interval: int):
        self.is_main, self.log_interval = is_main, log_interval
        self.file = None
        self.progress = None
        if is_main:
            from tqdm import tqdm

            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / "metrics.jsonl"
            # A resumed run continues the file from its checkpoint's step; rows a crashed run wrote past
            # that step are replaced by the rerun's. A fresh run starts a new file.
            kept = [line for line in (path.read_text().splitlines() if path.exists() and start_step else [])
                    if json.loads(line)["step"] <= start_step]
            path.write_text("".join(line + "\n" for line in kept))
            self.file = open(path, "a")
            self.progress = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                                 dynamic_ncols=True, file=sys.stderr, disable=not sys.stderr.isatty())

    def write(self, row: dict) -> None:
        """Append one row; print a concise console line every `log_interval` steps and on eval rows."""
        if not self.is_main:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.progress is not None and "loss" in row:
            self.progress.update(1)
            self.progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
        if row["step"] % self.log_interval == 0 or "eval_loss" in row or "loss" not in row:
            shown = {key: value for key, value in row.items() if key != "step"}
            text = " ".join(f"{key}={_short(value)}" for key, value in shown.items())
            (self.progress.write if self.progress is not None else print)(f"step {row['step']}: {text}")

    def close(self) -> None:
        """Flush and close the file and the bar."""
        if self.is_main:
            self.file.close()
            self.progress.close()


def _short(value):
    """Compact number formatting for console lines."""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return value


class StepTimer:
    """Wall time of one step, synchronising the GPU so queued kernels count."""

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start


def export_final_model(bridge, chunks: list, tokenizer, out_dir: Path, is_main: bool) -> None:
    """Write the trained model and its tokenizer to `<out_dir>/hf` as a Hugging Face checkpoint. Collective."""
    from model import build

    build.export_hf(bridge, chunks, out_dir / "hf")
    if is_main:
        tokenizer.save_pretrained(out_dir / "hf")
        log.info("saved the model as a Hugging Face checkpoint in %s", out_dir / "hf")


def to_device(batch: dict, device) -> dict:
    """Move a collated batch's tensors to the training device."""
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
