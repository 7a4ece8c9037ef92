"""The held-out evaluation both loops run: greedy completions of held-out prompts, scored by the reward function.

`eval_accuracy` means one thing in both loops: the share of held-out prompts whose greedy completion the
reward function gives full marks. Beside it, `eval_format_rate` (answers in the rewarded `#### N` form) and
`eval_answer_accuracy` (the right number as the last number, in any form) say what moved.
"""

import logging

from model import collectives, sampling
from trainer import rollout as rollout_data

log = logging.getLogger(__name__)


def held_out_metrics(policy, prompts: list, reward, runtime, config, max_new_tokens: int,
                     episode_sampler=None) -> dict:
    """`eval_accuracy`, `eval_format_rate`, `eval_answer_accuracy` over every held-out prompt (empty when there are
    none, or the model cannot generate); greedy episodes of `episode_sampler` (a `trainer.rollout.Rollout`; default:
    single-turn), so GRPO with tools is evaluated with its tools (and `eval_tool_call_rate` added). Collective."""
    if not prompts or not policy.can_generate:
        return {}
    episode_sampler = episode_sampler or rollout_data.Rollout(policy.tokenizer, None, policy.engine.end_ids)
    # Every data-parallel rank scores an equal share (the set was trimmed to a multiple of the DP size), in
    # batches no larger than its share of a training batch, whose KV cache is known to fit.
    mine = prompts[runtime.dp_rank :: runtime.dp_size]
    batch = max(config.train.global_batch_size // runtime.dp_size, 1)
    episodes = []
    for start in range(0, len(mine), batch):
        greedy = sampling.Sampling(logprobs=False)  # nothing reads the sampler's log-probs here
        episodes += episode_sampler.run(policy.engine, mine[start : start + batch], samples=1,
                                        max_new_tokens=max_new_tokens, sampling=greedy)[0]
    scores = rollout_data.score(reward, episodes)
    local = {**scores.totals(), "with_calls": rollout_data.totals(episodes)["episodes_with_calls"]}
    totals = dict(zip(local, collectives.data_parallel_sum(list(local.values()))))
    row = {"eval_accuracy": totals["correct"] / len(prompts), "eval_format_rate": totals["in_format"] / len(prompts),
           "eval_answer_accuracy": totals["right_answer"] / len(prompts)}
    if episode_sampler.toolset is not None:
        row["eval_tool_call_rate"] = totals["with_calls"] / len(prompts)
    if totals["errors"]:  # the same on every rank: a reward failing on held-out answers alone scored 0 without a word
        row["eval_reward_errors"] = totals["errors"]
        failures = {kind: text for rank_failures in collectives.data_parallel_gather(scores.failures)
                    for kind, text in rank_failures.items()}
        if runtime.is_main:
            log.warning("held-out evaluation: the reward function failed on %d of the %d held-out completions, each "
                        "scored 0 in eval_accuracy; %s", int(totals["errors"]), len(prompts),
                        "; ".join(f"the first {kind} failure: {text}" for kind, text in failures.items()))
    return row
