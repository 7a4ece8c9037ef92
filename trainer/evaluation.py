"""The held-out evaluation both loops run: greedy completions of held-out prompts, scored by the reward function.

`eval_accuracy` means one thing in both loops: the share of held-out prompts whose greedy completion the
reward function gives full marks. Beside it, `eval_format_rate` (answers in the rewarded `#### N` form) and
`eval_answer_accuracy` (the right number as the last number, in any form) say what moved.
"""

from data import rewards
from model import parallel


def held_out_metrics(policy, prompts: list, reward, runtime, config, max_new_tokens: int) -> dict:
    """`eval_accuracy`, `eval_format_rate`, `eval_answer_accuracy` over every held-out prompt (empty when there are
    none, or the model cannot generate). Collective."""
    if not prompts or not policy.can_generate:
        return {}
    # Every data-parallel rank scores an equal share (the set was trimmed to a multiple of the DP size), in
    # batches no larger than its share of a training batch, whose KV cache is known to fit.
    mine = prompts[runtime.dp_rank :: runtime.dp_size]
    batch = max(config.train.global_batch_size // runtime.dp_size, 1)
    completions = []
    for start in range(0, len(mine), batch):
        completions += policy.generator.generate([prompt.ids for prompt in mine[start : start + batch]],
                                                 max_new_tokens=max_new_tokens)
    scores = rewards.score(reward, policy.tokenizer.batch_decode(completions, skip_special_tokens=True),
                           [prompt.reference for prompt in mine])
    totals = dict(zip(scores.totals(), parallel.data_parallel_sum(list(scores.totals().values()))))
    return {"eval_accuracy": totals["correct"] / len(prompts), "eval_format_rate": totals["in_format"] / len(prompts),
            "eval_answer_accuracy": totals["right_answer"] / len(prompts)}
