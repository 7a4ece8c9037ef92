"""What the loops report: logging on rank 0, metrics.jsonl and the console line, step time, MFU."""

import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path

import torch

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
    for name in ("trainer", "config", "model", "data", "ckpt"):
        logging.getLogger(name).setLevel(logging.INFO if is_main else logging.WARNING)
    for noisy in ("megatron", "megatron.core", "megatron.bridge", "transformers", "datasets", "py.warnings"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


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

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
