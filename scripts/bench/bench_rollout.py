"""Rollout throughput: our megatron-core generation (model.generate) vs transformers `generate`, in one process.

Same checkpoint, prompts, batch and lengths (every row generates exactly --new-tokens tokens: EOS is
ignored by both), sampling at temperature 1. `--group N` samples N completions of each of batch / N
distinct prompts, as a GRPO step does (`samples=N` here, `num_return_sequences=N` in transformers). The
prompts are the bundled arithmetic task's (26-33 tokens), or GSM8K's questions with `--prompts gsm8k`
(read from ../shared/data/gsm8k). The two run in alternating rounds (one warm-up each first), so a busy
machine slows both alike; prints the median generated tokens/s of each and their ratio (ours with the sampler's
log-probs, as GRPO's rollouts, and without, as held-out evaluation).

    .venv/bin/python scripts/bench/bench_rollout.py [--model tiny|HF_DIR] [--batch 64] [--group 1] [--new-tokens 32]
        [--prompts arithmetic|gsm8k] [--rounds 7] [--dtype fp32|bf16]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.loops import SFTConfig  # noqa: E402
from config.sections import DataConfig, ModelConfig  # noqa: E402
from data.arithmetic import EVAL_SEED, generate_problems  # noqa: E402
from model import build, generate, parallel  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GSM8K_TEST = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


def synchronize() -> None:
    """Wait for queued GPU work so the clock measures it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tokens_per_second(run, batch: int, new_tokens: int) -> float:
    """Generated tokens per second of one call of `run()`."""
    synchronize()
    start = time.perf_counter()
    run()
    synchronize()
    return batch * new_tokens / (time.perf_counter() - start)


def main() -> None:
    """Load transformers first (it must load before megatron's parallel state exists), then ours; time them in turns."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="`tiny` or an HF checkpoint directory (e.g. outputs/sft/hf)")
    parser.add_argument("--batch", type=int, default=64, help="completions per call")
    parser.add_argument("--group", type=int, default=1, help="completions per distinct prompt (divides --batch)")
    parser.add_argument("--prompts", choices=["arithmetic", "gsm8k"], default="arithmetic")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if torch.cuda.is_available() else "fp32")
    args = parser.parse_args()
    if args.batch % args.group:
        parser.error(f"--group {args.group} must divide --batch {args.batch}")

    path = build.resolve_model_path(SFTConfig(model=ModelConfig(path=args.model)))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    distinct = args.batch // args.group
    if args.prompts == "gsm8k":
        rows = [json.loads(line) for line in open(GSM8K_TEST)][:distinct]
    else:
        rows = generate_problems(distinct, EVAL_SEED)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                             tokenize=False) for row in rows]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    device = "cuda" if torch.cuda.is_available() else "cpu"

    # transformers 5.12 leaves Qwen2's rotary inv_freq uninitialised when loaded after initialize_model_parallel.
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).to(device).eval()
    tokenizer.padding_side = "left"  # batched transformers generation needs prompts aligned at the right
    padded = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(device)

    @torch.no_grad()
    def run_transformers():
        reference.generate(**padded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, pad_token_id=tokenizer.pad_token_id,
                           num_return_sequences=args.group)

    config = SFTConfig(model=ModelConfig(dtype=args.dtype), data=DataConfig(max_seq_len=max(map(len, prompt_ids)) + args.new_tokens))
    runtime = parallel.init_distributed(config.parallel, seed=0)
    policy = build.build_policy(config, path, tokenizer, trainable=False)

    def run_ours(with_logprobs: bool = True):
        # end_ids=() never matches a token, so every row runs the full length, as with min_new_tokens above.
        generate.generate(policy.chunks, prompt_ids, samples=args.group, max_new_tokens=args.new_tokens, end_ids=(),
                          vocab_size=policy.vocab_size, temperature=1.0, seed=0, with_logprobs=with_logprobs)

    def run_ours_without_logprobs():
        run_ours(with_logprobs=False)

    run_transformers(), run_ours(), run_ours_without_logprobs()  # warm-up
    theirs, ours, bare = [], [], []
    for _ in range(args.rounds):
        theirs.append(tokens_per_second(run_transformers, args.batch, args.new_tokens))
        ours.append(tokens_per_second(run_ours, args.batch, args.new_tokens))
        bare.append(tokens_per_second(run_ours_without_logprobs, args.batch, args.new_tokens))
    theirs, ours, bare = statistics.median(theirs), statistics.median(ours), statistics.median(bare)
    lengths = sorted(map(len, prompt_ids))
    print(f"model {args.model} ({args.dtype}, {device}), batch {args.batch} = {distinct} {args.prompts} prompts x "
          f"{args.group}, prompts of {lengths[0]}-{lengths[-1]} tokens, {args.new_tokens} new tokens per row, median of "
          f"{args.rounds} alternating rounds")
    print(f"transformers generate: {theirs:10.0f} tokens/s")
    print(f"model.generate:        {ours:10.0f} tokens/s (with the sampler's log-probs, as GRPO's rollouts)")
    print(f"  without log-probs:   {bare:10.0f} tokens/s (as held-out evaluation; transformers computes none either)")
    print(f"ratio ours / transformers: {ours / theirs:.2f} ({bare / theirs:.2f} without log-probs)")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
