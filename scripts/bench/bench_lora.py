"""LoRA against full fine-tuning: trainable parameters and Adam state, and the peak memory of a GRPO step.

    .venv/bin/python scripts/bench/bench_lora.py                          # counts: the tiny model and a Qwen2.5-7B shape
    .venv/bin/python scripts/bench/bench_lora.py --memory outputs/sft/hf  # also peak resident memory, 2 GRPO steps each

Counts follow the adapters Megatron-Bridge's LoRA puts on megatron-core's fused layers (the default
`peft.target_modules`): an adapter on an `in -> out` layer is A (rank x in) and B (out x rank). Adam state in fp32 is
two moments, 8 bytes per trainable parameter (bf16 training adds a 4-byte fp32 main copy of each: 12 bytes).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QWEN25_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def counts(hf: dict, rank: int) -> dict:
    """Weights of the whole model (biases left out) and of its LoRA adapters (rank `rank` on qkv, proj, fc1, fc2)."""
    hidden, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hidden // hf["num_attention_heads"]
    qkv_out = head_dim * (hf["num_attention_heads"] + 2 * hf["num_key_value_heads"])
    shapes = {"linear_qkv": (hidden, qkv_out), "linear_proj": (head_dim * hf["num_attention_heads"], hidden),
              "linear_fc1": (hidden, 2 * inter), "linear_fc2": (inter, hidden)}
    per_layer = sum(fan_in * fan_out for fan_in, fan_out in shapes.values()) + 2 * hidden  # + the two norms
    embeddings = hf["vocab_size"] * hidden * (1 if hf.get("tie_word_embeddings") else 2)
    adapters = layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in shapes.values())
    return {"model": layers * per_layer + embeddings + hidden, "adapters": adapters}


def peak_memory_mib(model: str, extra: list[str]) -> float:
    """Largest resident set of one worker of a 2-process, 2-step GRPO run, measured by a fresh parent process
    (ru_maxrss of its waited-for descendants only ever grows, so each run gets its own)."""
    with tempfile.TemporaryDirectory() as out:
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "-m", "trainer.grpo",
                   f"--model.path={model}", "--train.steps=2", "--train.eval_samples=0", f"--train.out_dir={out}", *extra]
        probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
                 "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        result = subprocess.run([sys.executable, "-c", probe, *command], cwd=REPO, check=True, capture_output=True, text=True)
    return int(result.stdout.split()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--memory", metavar="MODEL", help="also measure a GRPO step's peak memory from this HF checkpoint")
    args = parser.parse_args()
    from model.tiny import ensure_tiny_checkpoint

    shapes = {"tiny": json.loads((ensure_tiny_checkpoint() / "config.json").read_text()), "Qwen2.5-7B shape": QWEN25_7B}
    for name, hf in shapes.items():
        count = counts(hf, args.rank)
        print(f"{name}, rank {args.rank}: trainable {count['adapters']:,} of {count['model']:,} parameters "
              f"({count['adapters'] / count['model']:.2%}); Adam state fp32 {8 * count['adapters'] / 2**20:,.1f} MiB "
              f"vs {8 * count['model'] / 2**20:,.1f} MiB full ({count['adapters'] / count['model']:.4f}x)")
    if args.memory:
        full = peak_memory_mib(args.memory, [])
        lora = peak_memory_mib(args.memory, ["--peft.method=lora", "--optim.lr=1e-3"])
        print(f"GRPO step (default batch, KL on) peak resident memory of the largest worker: full {full:,.0f} MiB, "
              f"LoRA {lora:,.0f} MiB (LoRA / full {lora / full:.3f})")


if __name__ == "__main__":
    main()
