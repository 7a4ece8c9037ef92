"""Multi-turn rollout cost: a 3-turn rollout against a single-turn one with the same number of sampled tokens, in one process.

Every row samples `--turn-tokens` tokens a turn. Single-turn: one call sampling 3 x that per row. Multi-turn: one call
whose rows, after each of their first two turns, are given `--appended` tokens (a tool message and its glue) through
`continue_rows` and go on in the same KV cache. Re-prefill, for comparison: what a loop that generates each turn anew
costs, three calls, each prefilling the prompt and everything before (earlier turns and tool messages). The turns end
where the script says (every token is an end id, and the hook lets a row sample on with nothing appended until its turn
is full), so they sample exactly the same number of tokens; that hook is called at every sampled token, where a real
rollout calls it once a turn, so single-turn through the same hook is timed too, and the 3-turn rollout is also
compared with it. They run in alternating rounds after a warm-up each; prints the median seconds of each and the ratios.

    .venv/bin/python scripts/bench/bench_tool_rollout.py [--model tiny|HF_DIR] [--batch 64] [--turn-tokens 32] [--appended 24]
        [--rounds 5]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.loops import SFTConfig  # noqa: E402
from config.sections import DataConfig, ModelConfig  # noqa: E402
from data.arithmetic import EVAL_SEED, generate_problems  # noqa: E402
from model import build, generate, parallel  # noqa: E402

TURNS = 3


def seconds(run) -> float:
    """Wall seconds of one call of `run()`."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="`tiny` or an HF checkpoint directory")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--turn-tokens", type=int, default=32, help="tokens sampled per turn")
    parser.add_argument("--appended", type=int, default=24, help="tokens given after each of the first two turns")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    path = build.resolve_model_path(SFTConfig(model=ModelConfig(path=args.model)))
    tokenizer = build.load_tokenizer(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                             tokenize=True) for row in generate_problems(args.batch, EVAL_SEED)]
    prompts = [prompt if isinstance(prompt, list) else prompt["input_ids"] for prompt in prompts]
    sampled = TURNS * args.turn_tokens
    budget = sampled + (TURNS - 1) * args.appended
    config = SFTConfig(data=DataConfig(max_seq_len=max(map(len, prompts)) + budget))
    runtime = parallel.init_distributed(config.parallel, seed=0)
    policy = build.build_policy(config, path, tokenizer, trainable=False)
    every_id = tuple(range(policy.vocab_size))
    given = [3 + index % 50 for index in range(args.appended)]  # stands in for a rendered tool message
    common = dict(vocab_size=policy.vocab_size, temperature=1.0, seed=0)

    def single_turn():
        generate.generate(policy.chunks, prompts, max_new_tokens=sampled, end_ids=(), **common)

    def multi_turn(turns: int = TURNS):
        turns_done = {}

        def continue_rows(requests):
            appended = []
            for row, completion, _ in requests:
                own = len(completion) - args.appended * turns_done.get(row, 0)  # tokens this row sampled
                if own == sampled:
                    appended.append(None)
                elif own % (sampled // turns):
                    appended.append([])  # mid-turn: sample on
                else:
                    turns_done[row] = turns_done.get(row, 0) + 1
                    appended.append(given)
            return appended

        length = sampled + (turns - 1) * args.appended
        completions = generate.generate(policy.chunks, prompts, max_new_tokens=length, end_ids=every_id,
                                        continue_rows=continue_rows, **common)
        assert all(len(completion) == length for completion in completions), "every row samples `sampled` tokens"

    def re_prefill():
        history = [list(prompt) for prompt in prompts]
        for turn in range(TURNS):
            completions = generate.generate(policy.chunks, history, max_new_tokens=args.turn_tokens, end_ids=(), **common)
            history = [row + completion + (given if turn < TURNS - 1 else []) for row, completion in zip(history, completions)]

    # The script's own turn-keeping (a hook call for every sampled token, where a real rollout has one a turn), alone.
    runs = {"single-turn": single_turn, "single-turn, via the hook": lambda: multi_turn(1),
            "3-turn, one KV cache": multi_turn, "3-turn, re-prefilled": re_prefill}
    for run in runs.values():
        run()  # warm-up
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(seconds(run))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"model {args.model}, {args.batch} rows, {TURNS} turns of {args.turn_tokens} sampled tokens, "
          f"{args.appended} tokens given after each of the first {TURNS - 1}; median of {args.rounds} alternating rounds")
    for name, value in medians.items():
        print(f"{name:26s} {value:7.3f} s   {value / medians['single-turn']:.2f}x single-turn")
    print(f"3-turn over single-turn, both via the hook: {medians['3-turn, one KV cache'] / medians['single-turn, via the hook']:.2f}x")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
