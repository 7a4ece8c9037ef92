"""Rollouts under Megatron-FSDP: parameters gathered once a generation call (`wrapping.parameters_gathered_once`, what
`Engine.generate` does) against once a token (every forward gathering and freeing each layer, as before), in one launch.

Both sample the same prompts with the same seed, so the completions and their log-probs must be identical: the script
checks it, then times both in alternating rounds (a warm-up each first) and prints the median generated tokens/s of
each and their ratio. Run under torchrun (the data-parallel ranks shard the parameters):

    .venv/bin/torchrun --nproc-per-node 2 scripts/bench/bench_fsdp_rollout.py [--model tiny|HF_DIR] [--batch 16]
        [--group 4] [--new-tokens 96] [--rounds 5]
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.loops import SFTConfig  # noqa: E402
from config.sections import DataConfig, ModelConfig, ParallelConfig  # noqa: E402
from data.arithmetic import EVAL_SEED, generate_problems  # noqa: E402
from model import build, generate, parallel  # noqa: E402
from model.sampling import Sampling  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="`tiny` or an HF checkpoint directory (e.g. outputs/sft/hf)")
    parser.add_argument("--batch", type=int, default=16, help="completions per call on each rank")
    parser.add_argument("--group", type=int, default=4, help="completions per distinct prompt (divides --batch)")
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens every completion runs to (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    config = SFTConfig(model=ModelConfig(path=args.model, dtype="fp32"), data=DataConfig(max_seq_len=256),
                       parallel=ParallelConfig(use_megatron_fsdp=True))
    runtime = parallel.init_distributed(config.parallel, seed=0)
    path = build.resolve_model_path(config)
    tokenizer = build.load_tokenizer(path)
    policy = build.build_policy(config, path, tokenizer)
    engine = generate.Engine(policy.chunks, policy.vocab_size, (), policy.engine.group, policy.engine.data_parallel_group)
    problems = generate_problems(args.batch // args.group, seed=EVAL_SEED + runtime.dp_rank)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": problem["question"]}], add_generation_prompt=True,
                                           tokenize=False) for problem in problems]
    prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    sampling = Sampling(temperature=1.0, seed=3)

    def sample(once: bool):
        held = contextlib.nullcontext() if once else mock.patch.object(generate, "parameters_gathered_once",
                                                                         lambda *args: contextlib.nullcontext())
        with held:
            return engine.generate(prompts, max_new_tokens=args.new_tokens, samples=args.group, sampling=sampling)

    once, per_token = sample(True), sample(False)  # also the warm-up of each
    identical = [list(row) for row in once] == [list(row) for row in per_token] and once.logprobs == per_token.logprobs
    rates = {True: [], False: []}
    for _ in range(args.rounds):
        for gathered_once in (True, False):
            start = time.perf_counter()
            sample(gathered_once)
            rates[gathered_once].append(args.batch * args.new_tokens / (time.perf_counter() - start))
    if runtime.rank == 0:
        fast, slow = statistics.median(rates[True]), statistics.median(rates[False])
        print(f"Megatron-FSDP rollouts, {runtime.dp_size} ranks, {args.batch} completions x {args.new_tokens} tokens a "
              f"rank: gathered once a call {fast:.0f} tokens/s, once a token {slow:.0f} tokens/s: {fast / slow:.2f}x "
              f"(medians of {args.rounds} alternating rounds); completions and log-probs identical: {identical}")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
