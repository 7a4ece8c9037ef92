"""Trainer overhead: one SFT step through our loop vs a bare megatron-core forward/backward/optimizer step.

Same model, optimizer and batch, same process; the two are interleaved and the medians compared.
Run: .venv/bin/python scripts/bench/bench_sft_overhead.py [--steps 30]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config import console  # noqa: E402
from config.loops import SFTConfig  # noqa: E402
from data import conversations as conversation_data, sft as sft_data  # noqa: E402
from model import build, parallel  # noqa: E402
from trainer import metrics, sft  # noqa: E402


def bare_step(chunks, optimizer, microbatches) -> None:
    """The minimum megatron-core needs for one step: forward/backward each microbatch, grad sync, optimizer step."""
    (model,) = chunks
    model.zero_grad_buffer()
    optimizer.zero_grad()
    total_tokens = sum(batch["loss_mask"].sum() for batch in microbatches)
    for batch in microbatches:
        per_token_loss = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                               labels=batch["labels"])
        ((per_token_loss * batch["loss_mask"]).sum() / total_tokens).backward()
    model.finish_grad_sync()
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    config = SFTConfig()
    console.setup(rank=0)
    path = build.resolve_model_path(config)
    tokenizer = build.load_tokenizer(path)
    rows = conversation_data.load_rows("arithmetic")[: config.train.global_batch_size]
    conversations, report = conversation_data.to_conversations(rows)
    examples = sft_data.build_examples(conversations, tokenizer, config.data.max_seq_len, report)
    runtime = parallel.init_distributed(config.parallel, config.train.seed)
    policy = build.build_policy(config, path, tokenizer)
    micro = config.train.micro_batch_size
    indices = [list(range(start, start + micro)) for start in range(0, len(examples), micro)]

    def ours():
        microbatches, seq_len = sft.collate_microbatches(examples, indices, config, tokenizer.pad_token_id, runtime.device)
        sft.train_step(policy, microbatches, seq_len, metrics.StepTimer())
        policy.global_tokens(sum(batch["tokens"].numel() for batch in microbatches))

    fixed, _ = sft.collate_microbatches(examples, indices, config, tokenizer.pad_token_id, runtime.device)
    timings = {"ours": [], "bare": []}
    steps = {"ours": ours, "bare": lambda: bare_step(policy.chunks, policy.optimizer, fixed)}
    for name in steps:  # warm-up
        steps[name]()
    for _ in range(args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            timings[name].append(time.perf_counter() - start)
    ours_median, bare_median = statistics.median(timings["ours"]), statistics.median(timings["bare"])
    print(f"SFT step, tiny model, global batch {config.train.global_batch_size} x micro {micro}, {args.steps} interleaved steps")
    print(f"  our loop (collate + pipeline schedule + optimizer + schedule + metrics): median {ours_median * 1e3:.1f} ms")
    print(f"  bare megatron-core forward/backward/optimizer step:                      median {bare_median * 1e3:.1f} ms")
    print(f"  overhead ratio ours/bare: {ours_median / bare_median:.3f}")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
