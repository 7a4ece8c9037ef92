"""SFT against this machine's fp32 matrix-multiply bound: how much of what the CPU can multiply a training step uses.

What it measures, in one process and one sitting, alternating: (1) the bound, the FLOP/s of large fp32 matrix products
(`torch.mm` of `--matmul-size` square matrices, the best of several) with `--threads` intra-op threads; (2) `torchrun
--nproc-per-node 1 -m trainer.sft` on the bundled arithmetic task with a 22.8M-parameter model of the embedded family
(hidden 512, 8 layers, 8 heads / 2 KV heads, MLP 1408, the default tokenizer), with the same threads. A step's model
FLOPs are `trainer.metrics.model_flops_per_token` (6 x matmul parameters + causal attention, the output layer counted
at every position although only response positions are projected: about 1% more than the work done) times the tokens
it fed, padding included (`tokens_per_s`). The ratio is the step's FLOP/s over the bound: 1.0 would be a step that
only multiplies matrices, as fast as the largest products go.

    .venv/bin/python scripts/bench/bench_sft_bound.py [--rounds 2] [--steps 12] [--threads 1] [--micro-batch 16]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from model import tiny  # noqa: E402
from trainer import metrics  # noqa: E402

SHAPE = {**tiny.MODEL_CONFIG, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 1408}
# The attention term's sequence length: the task's samples are 40-60 tokens, padded to at most 64 here; the term is
# about 1% of a step's FLOPs at this width.
ATTENTION_SEQ = 64


def matmul_flops(size: int, repeats: int = 5) -> float:
    """The best FLOP/s of `repeats` fp32 products of two `size` x `size` matrices (after one warm-up)."""
    left, right = torch.randn(size, size), torch.randn(size, size)
    torch.mm(left, right)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(left, right)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def sft_flops(model: Path, steps: int, micro_batch: int, work: Path, env: dict) -> tuple[float, float]:
    """(median model FLOP/s, median tokens/s) over an SFT run's steps after the first two."""
    out = work / "sft"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "1", "-m",
               "trainer.sft", f"--model.path={model}", f"--train.steps={steps}", f"--train.global_batch_size={micro_batch}",
               f"--train.micro_batch_size={micro_batch}", "--train.eval_samples=0", f"--train.out_dir={out}",
               "--train.overwrite_output_dir=true", "--ckpt.async_save=false"]
    with (work / "sft.log").open("w") as log:
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode:
            sys.exit(f"error: the SFT run failed; its log: {work / 'sft.log'}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "tokens_per_s" in row][2:]  # warm-up steps left out
    per_token = metrics.model_flops_per_token(json.loads((model / "config.json").read_text()), ATTENTION_SEQ)
    tokens_per_s = statistics.median(row["tokens_per_s"] for row in rows)
    return tokens_per_s * per_token, tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the bound and the SFT run")
    parser.add_argument("--steps", type=int, default=12, help="SFT steps per run (the first two are warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both (torchrun's default is 1)")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per step (one micro-batch)")
    parser.add_argument("--matmul-size", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory(prefix="bench-sft-bound-") as work:
        model = Path(work) / "model"
        tiny.build_checkpoint(model, SHAPE)
        parameters = parameter_count(model)
        bounds, steps, tokens = [], [], []
        for round_number in range(1, args.rounds + 1):
            bounds.append(matmul_flops(args.matmul_size))
            flops, per_second = sft_flops(model, args.steps, args.micro_batch, Path(work), env)
            steps.append(flops)
            tokens.append(per_second)
            bounds.append(matmul_flops(args.matmul_size))
            print(f"round {round_number}/{args.rounds}: matmul {bounds[-2] / 1e9:.1f} / {bounds[-1] / 1e9:.1f} GFLOP/s, "
                  f"SFT {flops / 1e9:.1f} GFLOP/s ({per_second:.0f} tokens/s)", flush=True)
    bound, step = statistics.median(bounds), statistics.median(steps)
    print(f"\nsummary: SFT at {parameters / 1e6:.1f}M parameters, {args.threads} thread(s): "
          f"{step / 1e9:.1f} GFLOP/s against a {args.matmul_size}^3 fp32 matmul bound of {bound / 1e9:.1f} GFLOP/s: "
          f"**{step / bound:.2f}** of the bound (medians; load average {os.getloadavg()[0]:.1f})")


def parameter_count(model: Path) -> int:
    """Parameters of the checkpoint (the tied embedding counted once)."""
    from safetensors import safe_open

    with safe_open(model / "model.safetensors", "pt") as tensors:
        return sum(torch.Size(tensors.get_slice(name).get_shape()).numel() for name in tensors.keys())


if __name__ == "__main__":
    main()
