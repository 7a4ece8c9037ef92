"""A GRPO-sized rollout at PP=2 against PP=1 on the same 2 processes, side by side in one run.

    .venv/bin/python scripts/bench/bench_pipeline_rollout.py                      # the default model, 3 rounds
    .venv/bin/python scripts/bench/bench_pipeline_rollout.py --model MODEL_DIR --prompts 32 --samples 8 --new-tokens 64

One torchrun launch of 2 processes builds the model at PP=1 (each rank a whole replica; both generate the batch, as two
data-parallel ranks do with their shares) and at PP=2 (the two ranks one replica's two stages: every prefill and
decode forward goes through stage 0, then stage 1, which samples and sends the ids back), and times
`model.generate.generate` of one batch (`--prompts` prompts x `--samples` completions, `--new-tokens` each, no end id so
every layout decodes the same number of steps), alternating the layouts `--rounds` times so a machine that slows down
mid-run slows both alike. The figure is each layout's median seconds per rollout; the ratio is PP=2's over PP=1's. The
completions are compared too: PP=2 must sample PP=1's tokens exactly (fp32).

What to expect: generation does not fill the pipeline (one forward at a time, as megatron-core's static-batching
inference does), so a stage waits while the other computes; PP=2 holds half the layers per rank, which is what it is
for, at about PP=1's time per rollout plus one send of the hidden states and one broadcast of the ids per step.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def worker(args) -> None:
    """Inside torchrun: both layouts in turn, `args.rounds` times; rank 0 prints the table."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from config.sections import ParallelConfig
    from model import generate, parallel, providers, wrapping
    from model.tiny import ensure_tiny_checkpoint

    path = ensure_tiny_checkpoint() if args.model == "tiny" else Path(args.model)
    bridge = providers.auto_bridge(path)
    vocab = bridge.hf_pretrained.config.vocab_size
    lengths = torch.randint(16, 48, (args.prompts,), generator=torch.Generator().manual_seed(0))
    prompts = [torch.randint(3, vocab, (int(length),), generator=torch.Generator().manual_seed(index)).tolist()
               for index, length in enumerate(lengths)]
    times, completions, first = {1: [], 2: []}, {}, None
    for _ in range(args.rounds):
        for pp in (1, 2):
            runtime = parallel.init_distributed(ParallelConfig(pp=pp), seed=0)
            first = first or runtime  # the one that created the process group
            provider = providers.configure_provider(bridge, dtype="fp32", tp=1, pp=pp, vpp=None,
                                                seq_length=64 + args.new_tokens)
            chunks = wrapping.build_chunks(provider)
            dist.barrier()
            start = time.perf_counter()
            completions[pp] = generate.generate(chunks, prompts, max_new_tokens=args.new_tokens, end_ids=(),
                                                vocab_size=vocab, samples=args.samples, temperature=1.0, seed=1)
            dist.barrier()
            times[pp].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        rows = args.prompts * args.samples
        baseline = statistics.median(times[1])
        print(f"rollout of {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, {args.model}, "
              f"2 processes, {args.rounds} rounds (median):")
        for pp, values in times.items():
            median = statistics.median(values)
            print(f"  PP={pp} {median:.3f} s  {rows * args.new_tokens / median:.0f} tokens/s  {median / baseline:.2f}x PP=1"
                  f"{'  (both ranks generate the batch)' if pp == 1 else '  (one replica over both ranks)'}")
        print(f"  PP=2 sampled PP=1's tokens exactly: {list(completions[1]) == list(completions[2])}")
    parallel.shutdown(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model.path: an HF checkpoint directory or tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc-per-node", "2", __file__, "--worker", f"--model={args.model}",
               f"--prompts={args.prompts}", f"--samples={args.samples}", f"--new-tokens={args.new_tokens}",
               f"--rounds={args.rounds}"]
    subprocess.run(command, cwd=REPO, check=True)


if __name__ == "__main__":
    main()
