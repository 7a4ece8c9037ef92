"""GRPO: `torchrun --nproc-per-node N -m trainer.grpo [--config FILE] [--key=value ...]`.

The variant, exactly (defaults in brackets):
- Rollouts: each step takes `train.global_batch_size / grpo.n_samples` prompts (a seeded shuffle per epoch);
  every data-parallel rank samples `grpo.n_samples` [8] completions for each of its share from the current
  policy (`grpo.temperature` [1.0], `grpo.top_p`, `grpo.top_k`, at most `grpo.max_new_tokens`, stopping at
  any end id the model declares: the tokenizer's EOS and generation_config's) with megatron-core's KV cache.
  The seed of step s on data-parallel rank d is derived from (train.seed, s, d) and the prompt order from
  (train.seed, s), so a run, and a resume, is reproducible.
- Tools (`grpo.tools`, `grpo.environment`): an episode is then several turns, the tool messages between them appended
  as token ids into the same KV cache and left out of the loss (mask 0); the reward scores the last turn, plus the
  environment's own reward. `trainer/rollout.py` states the rules; `max_new_tokens` bounds the whole episode.
- Reward: `grpo.reward(completion, reference)` [arithmetic] plus `grpo.format_bonus` [0] for a `#### N`
  answer, computed on the first rank of each tensor-parallel group and sent to the others; a reward function that
  raises (or returns no finite number) scores 0 and is counted (`reward_errors`), its first failure of each kind
  logged with the completion; failing on every completion of a step stops the run with a paragraph, unless
  `grpo.tolerate_reward_errors`. With `grpo.overlong_buffer`
  N > 0 (DAPO), a completion longer than max_new_tokens - N loses reward linearly, `grpo.overlong_penalty` at the
  budget.
- Dynamic sampling (`grpo.dynamic_sampling`, DAPO): groups whose accuracy (the reward function's full marks;
  `grpo.filter_metric=reward`: the shaped reward) is all equal are dropped and another round of prompts is sampled,
  at most `grpo.max_sampling_rounds` [4] rounds a step, until each rank's share of the batch is groups kept (a batch
  still short is filled with dropped groups). Extra rounds draw their prompts and seeds from (train.seed, step,
  round, DP rank), prompts the step has not used first, wrapping around a small set; every rank runs every round.
- Advantage, one per completion, shared by its tokens: A = (r - b) / (std + 1e-4) within the prompt's
  group, b the group mean [GRPO] or the mean of the other completions (`grpo.baseline=leave_one_out`,
  RLOO); `grpo.scale_rewards=false` drops the std division (Dr. GRPO). All-equal groups get A = 0 exactly.
- Loss per completion token: the PPO clipped surrogate max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A)
  [0.2, 0.28: DAPO's clip-higher] with r = pi / pi_old per token, or per completion as
  exp(mean log ratio) (`grpo.importance_ratio=sequence`, GSPO), log-ratio clamped to +-20, bounded by
  -dual_clip A for A < 0 [3.0], plus kl_coef [0.01] x KL(pi || pi_ref) (estimator k3 [or k1]; pi_ref the
  starting model: a frozen copy, built only when kl_coef > 0, or with LoRA the policy with its adapters
  switched off), minus `grpo.entropy_coef` [0] x the token's entropy (at 0 it is only logged, computed a few rows
  at a time without gradient). pi_old is the policy's own log-prob, recomputed forward-only in eval mode (no
  dropout, as the rollouts were sampled) when the rollouts serve several updates (ppo_epochs x mini_batches > 1);
  with one update per step it is the policy's log-prob detached (r = 1 in value, the same numbers without the
  extra pass). `grpo.mask_truncated` leaves completions cut at the
  budget out of the loss. Log-probs and entropy use the vocab-parallel logits / temperature, never gathering
  the vocabulary.
- Aggregation: the token mean over the whole global batch [token_mean, as DAPO], the mean over completions of
  each one's token mean (`seq_mean_token_mean`, the original GRPO paper), or each completion's token sum over
  the budget max_new_tokens, averaged over completions (`seq_mean_token_sum_norm`, Dr. GRPO).
- Update: `grpo.ppo_epochs` [1] passes over the rollouts, each split into `grpo.mini_batches` [1] optimizer
  steps; the learning-rate schedule advances once per GRPO step. `grad_norm` is the mean over the step's updates
  (`grad_norm_max` the largest, with several).
- Named recipes (`--config grpo|dapo|dr_grpo|gspo|rloo`) set these keys as the papers do: `recipes/`.

parse -> validate -> build -> resume -> loop -> save. With no arguments it starts from the default SFT's
output `outputs/sft/hf`, running that SFT first, in the same process group, when it is missing.
Resume: a checkpoint holds model, optimizer, LR schedule and step; prompt order and sampling seeds are pure
functions of (train.seed, step), so N steps + resume + N steps repeat 2N straight steps exactly.
"""

import dataclasses
import functools
import hashlib
import os
import time

import torch

from ckpt import checkpoint
from config import cli, process
from config.errors import UserError
from config.sections import GRPOConfig
from data import batches, prompts as prompt_data, rewards, tools as tool_data
from model import build, generate, parallel
from trainer import default_start, evaluation, grpo_math, metrics, rollout as rollout_data
from trainer.metrics import log


# ---------------------------------------------------------------- prompts


def step_prompt_indices(num_prompts: int, prompts_per_step: int, step: int, seed: int) -> list[int]:
    """Indices of step `step`'s prompts: a seeded shuffle per epoch, a pure function of the step (so resume is exact)."""
    orders, indices = {}, []
    for position in range((step - 1) * prompts_per_step, step * prompts_per_step):
        epoch, offset = divmod(position, num_prompts)
        if epoch not in orders:
            orders[epoch] = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        indices.append(orders[epoch][offset])
    return indices


def rollout_seed(seed: int, step: int, dp_rank: int, round_index: int = 0) -> int:
    """Sampling seed of one step's generation round on one data-parallel rank (tensor-parallel ranks share it, as
    generation requires); round 0 is every step's, later rounds are dynamic sampling's."""
    suffix = f":{round_index}" if round_index else ""
    digest = hashlib.sha256(f"rollout:{seed}:{step}:{dp_rank}{suffix}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def extra_prompt_indices(num_prompts: int, count: int, seed: int, step: int, round_index: int,
                         used: list[int]) -> list[int]:
    """Dynamic sampling's `count` prompts for an extra round of a step: a seeded order, a pure function of (seed, step,
    round), with the prompts `used` by the step's earlier rounds last, so none trains twice in a step while the set
    has others; a set smaller than `count` wraps, as round 0 does across epochs, so every rank gets its share."""
    generator = torch.Generator().manual_seed(rollout_seed(seed, step, -1, round_index))
    order = torch.randperm(num_prompts, generator=generator).tolist()
    taken = set(used)
    order = [index for index in order if index not in taken] + [index for index in order if index in taken]
    return [order[position % num_prompts] for position in range(count)]


# ---------------------------------------------------------------- rollouts


@dataclasses.dataclass
class Round:
    """One generation round on this rank: groups of `grpo.n_samples` consecutive episodes, scored."""

    episodes: list[rollout_data.Episode]
    truncated: list[bool]  # cut at grpo.max_new_tokens (no end id)
    scores: rewards.Scores
    penalty: float  # the overlong penalties' sum (0 without grpo.overlong_buffer)
    advantages: torch.Tensor  # [groups, samples]
    equal: torch.Tensor  # [groups]: all rewards of the group alike (zero advantage)
    kept: torch.Tensor  # [groups]: dynamic sampling keeps the group (it varies in grpo.filter_metric)
    seconds: float  # generating (tools included)
    tool_seconds: float


@dataclasses.dataclass
class Rollouts:
    """One step's rollouts on this rank: the batch it trains on (groups of `grpo.n_samples` consecutive rows) and
    every round sampled for it (with dynamic sampling, more than one, and groups left out of the batch)."""

    examples: list[batches.Example]  # prompt + completion ids; the loss mask covers the trained completion tokens
    advantages: torch.Tensor  # [completions]
    zero_advantage_groups: int  # in the batch
    kept_groups: int  # in the batch, groups dynamic sampling keeps (all of them but the fill-ins)
    rounds: list[Round]

    @property
    def seconds(self) -> float:
        """Time spent generating this step's completions."""
        return sum(sampled.seconds for sampled in self.rounds)


SAMPLES_PER_LOG = 4


def samples(rollouts: Rollouts, tokenizer, n_samples: int, with_tools: bool) -> list[dict]:
    """A few of this rank's first-round episodes for samples.jsonl: the first of each prompt, then the second, ...;
    with tools each also as its trajectory, in runs of what the policy sampled and what was appended."""
    first = rollouts.rounds[0]
    order = sorted(range(len(first.episodes)), key=lambda index: (index % n_samples, index // n_samples))
    shown = []
    for index in order[:SAMPLES_PER_LOG]:
        episode = first.episodes[index]
        shown.append({"prompt": tokenizer.decode(episode.prompt_ids, skip_special_tokens=True).strip(),
                      "completion": episode.answer, "reward": first.scores.rewards[index],
                      "reference": episode.prompt.reference})
        if with_tools:
            shown[-1].update(turns=episode.counts["turns"], tool_calls=episode.counts["tool_calls"],
                             trajectory=rollout_data.trajectory(tokenizer, episode))
    return shown


def round_prompts(prompts, config, step: int, round_index: int, runtime) -> list[prompt_data.Prompt]:
    """This rank's distinct prompts of one round: the step's share of the epoch's shuffle (round 0), or a seeded
    draw (dynamic sampling's extra rounds); pure functions of (train.seed, step, round), so resume is exact."""
    per_rank = config.train.global_batch_size // config.grpo.n_samples // runtime.dp_size
    count, seed = per_rank * runtime.dp_size, config.train.seed
    indices = step_prompt_indices(len(prompts), count, step, seed)
    used = list(indices)
    for number in range(1, round_index + 1):  # the step's earlier rounds on every rank: pure functions, recomputed
        indices = extra_prompt_indices(len(prompts), count, seed, step, number, used)
        used += indices
    return [prompts[index] for index in indices[runtime.dp_rank * per_rank : (runtime.dp_rank + 1) * per_rank]]


def sample_round(policy, rollout, distinct: list[prompt_data.Prompt], config, step: int, round_index: int, runtime,
                 reward) -> Round:
    """Sample `grpo.n_samples` episodes of each prompt, score them (reward, overlong penalty) and compute group advantages."""
    grpo = config.grpo
    sampling = generate.Sampling(grpo.temperature, grpo.top_p, grpo.top_k,
                                 rollout_seed(config.train.seed, step, runtime.dp_rank, round_index))
    start = time.perf_counter()
    episodes, tool_seconds = rollout.run(policy.generator, distinct, samples=grpo.n_samples,
                                         max_new_tokens=grpo.max_new_tokens, sampling=sampling)
    seconds = time.perf_counter() - start
    scores = rollout_data.score(reward, episodes, grpo.format_bonus)
    shaped = torch.tensor(scores.rewards, dtype=torch.float32)  # [episodes]
    penalty = 0.0
    if grpo.overlong_buffer:  # the budget bounds the whole episode, so its length counts every token after the prompt
        penalties = grpo_math.overlong_penalty(torch.tensor([len(episode.ids) for episode in episodes]),
                                               grpo.max_new_tokens, grpo.overlong_buffer, grpo.overlong_penalty)
        shaped, penalty = shaped + penalties, float(penalties.sum())
    advantages, equal = grpo_math.group_advantages(shaped.view(-1, grpo.n_samples), grpo.baseline, grpo.scale_rewards)
    kept = kept_groups(shaped, scores.correct, equal, grpo.filter_metric)
    truncated = [policy.generator.truncated(episode.ids, grpo.max_new_tokens) for episode in episodes]
    return Round(episodes, truncated, scores, penalty, advantages, equal, kept, seconds, tool_seconds)


def kept_groups(shaped: torch.Tensor, correct: list[bool], equal: torch.Tensor, metric: str) -> torch.Tensor:
    """Which groups dynamic sampling keeps: those whose accuracy varies (DAPO: all right or all wrong teaches
    nothing), not those that differ only in the shaping (overlong penalty, format bonus); `metric=reward` keeps those
    whose shaped reward varies. A group of equal rewards (zero advantage) is never kept."""
    # shaped: [episodes]; equal: [groups]
    values = shaped if metric == "reward" else torch.tensor(correct, dtype=torch.float32)
    grouped = values.view(equal.numel(), -1)  # [groups, samples]
    return (grouped.amax(dim=1) != grouped.amin(dim=1)) & ~equal  # [groups]


def select_groups(rounds: list[Round], wanted: int) -> list[tuple[int, int]]:
    """(round, group) of this rank's batch, in sampling order: the first `wanted` groups kept, then, only if the
    rounds ran out, the first groups dropped. With one round of `wanted` groups that is every group, in order."""
    groups = [(number, group) for number, sampled in enumerate(rounds) for group in range(len(sampled.kept))]
    kept = [(number, group) for number, group in groups if rounds[number].kept[group]]
    dropped = [(number, group) for number, group in groups if not rounds[number].kept[group]]
    return sorted(kept[:wanted] + dropped[: max(0, wanted - len(kept))])


def collect_rollouts(policy, rollout, prompts, config, step, runtime, reward) -> Rollouts:
    """This rank's batch of the step: one round of rollouts, or with `grpo.dynamic_sampling` as many rounds (at most
    `grpo.max_sampling_rounds`) as the data-parallel ranks need to fill their batches with groups that carry signal.

    Every rank runs every round (the ranks agree on the count, one all-reduce per round), so generation's
    collectives under Megatron-FSDP stay matched."""
    grpo = config.grpo
    wanted = config.train.global_batch_size // grpo.n_samples // runtime.dp_size
    rounds = [sample_round(policy, rollout, round_prompts(prompts, config, step, 0, runtime), config, step, 0, runtime, reward)]
    while grpo.dynamic_sampling and len(rounds) < grpo.max_sampling_rounds:
        short = max(0, wanted - sum(int(sampled.kept.sum()) for sampled in rounds))
        if parallel.data_parallel_sum([short])[0] == 0:
            break
        number = len(rounds)
        rounds.append(sample_round(policy, rollout, round_prompts(prompts, config, step, number, runtime), config, step,
                                   number, runtime, reward))
    examples, advantages, zero_groups, kept_groups = [], [], 0, 0
    for number, group in select_groups(rounds, wanted):
        sampled = rounds[number]
        zero_groups += int(sampled.equal[group])
        kept_groups += int(sampled.kept[group])
        advantages.append(sampled.advantages[group])
        for row in range(group * grpo.n_samples, (group + 1) * grpo.n_samples):
            episode = sampled.episodes[row]
            trained = 0 if grpo.mask_truncated and sampled.truncated[row] else 1
            # Only sampled tokens are trained: appended ones (tool messages) have mask 0, so no term of the loss
            # sees them and every normaliser that counts tokens counts sampled ones.
            examples.append(batches.Example(episode.prompt_ids + episode.ids,
                                            [0] * len(episode.prompt_ids) + [trained * flag for flag in episode.sampled]))
    return Rollouts(examples, torch.cat(advantages), zero_groups, kept_groups, rounds)


def rollout_metrics(rollouts: Rollouts, config, runtime) -> dict:
    """Global (all data-parallel ranks) reward, accuracy, answer-form and length figures of every completion sampled
    for the step, and the batch's zero-advantage groups (with dynamic sampling, its rounds and kept share too)."""
    sampled = {"count": 0, "reward": 0.0, "correct": 0, "errors": 0, "in_format": 0, "right_answer": 0,
               "truncated": 0, "completion_tokens": 0, "sampled_tokens": 0, "penalty": 0.0, "groups": 0,
               "tool_seconds": 0.0, **dict.fromkeys(rollout_data.totals([]), 0.0)}
    for sampled_round in rollouts.rounds:
        for key, value in (*sampled_round.scores.totals().items(), *rollout_data.totals(sampled_round.episodes).items()):
            sampled[key] += value
        sampled["count"] += len(sampled_round.episodes)
        sampled["truncated"] += sum(sampled_round.truncated)
        sampled["completion_tokens"] += sum(len(episode.ids) for episode in sampled_round.episodes)
        sampled["sampled_tokens"] += sum(sum(episode.sampled) for episode in sampled_round.episodes)
        sampled["penalty"] += sampled_round.penalty
        sampled["groups"] += len(sampled_round.kept)
        sampled["tool_seconds"] += sampled_round.tool_seconds
    local = {**sampled, "zero_groups": rollouts.zero_advantage_groups, "kept_groups": rollouts.kept_groups,
             "seconds": rollouts.seconds,
             "all_tokens": sum(len(example.input_ids) for example in rollouts.examples)}
    total = dict(zip(local, parallel.data_parallel_sum(list(local.values()))))
    count = total["count"]
    row = {"reward_mean": total["reward"] / count, "accuracy": total["correct"] / count,
           "format_rate": total["in_format"] / count, "answer_accuracy": total["right_answer"] / count,
           "response_len": total["completion_tokens"] / count,
           "rollout_tokens_per_s": total["completion_tokens"] / rollouts.seconds,
           "rollout_time_s": total["seconds"] / runtime.dp_size, "reward_errors": int(total["errors"]),
           "zero_advantage_groups": int(total["zero_groups"]),
           "truncated_rate": total["truncated"] / count, "sequence_tokens": total["all_tokens"]}
    if config.grpo.tools or config.grpo.environment:
        row.update(tool_metrics(total, count, runtime))
    if config.grpo.overlong_buffer:
        row["overlong_penalty"] = total["penalty"] / count
    if config.grpo.dynamic_sampling:
        row["sampling_rounds"] = len(rollouts.rounds)
        row["kept_group_rate"] = total["kept_groups"] / total["groups"]
    return row


def tool_metrics(total: dict, count: float, runtime) -> dict:
    """With tools: per-episode turns and calls, the share of episodes that called a tool, the failures' counts, the
    sampled share of the episodes' tokens and the seconds spent in tools (per rank, like rollout_time_s)."""
    return {"turns_per_episode": total["turns"] / count, "tool_calls_per_episode": total["tool_calls"] / count,
            "tool_call_rate": total["episodes_with_calls"] / count, "tool_errors": int(total["tool_errors"]),
            "tool_parse_errors": int(total["parse_errors"]), "tool_timeouts": int(total["tool_timeouts"]),
            "tool_timeout_ends": int(total["timeout_ends"]), "unknown_tools": int(total["unknown_tools"]),
            "max_turns_reached": int(total["max_turns_reached"]), "out_of_room": int(total["out_of_room"]),
            "truncated_tool_responses": int(total["truncated_tool_responses"]),
            "prompts_too_long": int(total["prompts_too_long"]),
            "sampled_token_share": total["sampled_tokens"] / max(total["completion_tokens"], 1),
            "tool_time_s": total["tool_seconds"] / runtime.dp_size}


class RewardFailures:
    """What the reward function failed on, said: the first failure of each kind (exception type) once, with the
    function, the exception and the completion; and a step on which it failed on every completion stops the run with
    a paragraph (every reward would be 0: a flat curve, nothing learned), unless `grpo.tolerate_reward_errors`."""

    def __init__(self, config, runtime):
        self.config, self.runtime, self.reported = config, runtime, set()

    def check(self, rollouts: Rollouts, step: int) -> None:
        """Collective over data-parallel ranks (one small all-reduce; a gather only in a step where a score failed)."""
        local_errors = sum(sampled.scores.errors for sampled in rollouts.rounds)
        local_count = sum(len(sampled.episodes) for sampled in rollouts.rounds)
        errors, count = parallel.data_parallel_sum([local_errors, local_count])
        if errors == 0:
            return
        failures = {}
        for rank_failures in parallel.data_parallel_gather(
                {kind: text for sampled in rollouts.rounds for kind, text in sampled.scores.failures.items()}):
            for kind, text in rank_failures.items():
                failures.setdefault(kind, text)
        if errors == count and not self.config.grpo.tolerate_reward_errors:
            raise UserError(
                f"The reward function `grpo.reward={self.config.grpo.reward}` failed on every one of the {int(count)} "
                f"completions of step {step}, so every reward would be 0 and the run would learn nothing: "
                f"{'; '.join(failures.values())}. A reward function takes (completion, reference) strings and returns "
                "a number (1.0: full marks); fix it, or set `--grpo.tolerate_reward_errors=true` to train on anyway.")
        for kind in sorted(set(failures) - self.reported):
            if self.runtime.is_main:
                log.warning("step %d: the reward function failed on %d of %d completions, each scored 0; the first "
                            "%s failure: %s (said once per kind of failure; `reward_errors` counts them every step)",
                            step, int(errors), int(count), kind, failures[kind])
            self.reported.add(kind)


# ---------------------------------------------------------------- log-probs and loss


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The loss's knobs, fixed at start-up (each named choice picked once, from its table in `rl.grpo_math`)."""

    temperature: float
    clip_low: float
    clip_high: float
    dual_clip: float
    kl_coef: float
    kl_estimator: object
    importance_ratio: object
    entropy_coef: float
    aggregation: object
    budget: int  # grpo.max_new_tokens, the constant normaliser's

    @classmethod
    def from_config(cls, grpo) -> "LossSettings":
        """The `grpo` section's loss settings, with the named functions looked up."""
        return cls(grpo.temperature, grpo.clip_low, grpo.clip_high, grpo.dual_clip, grpo.kl_coef,
                   grpo_math.KL_ESTIMATORS[grpo.kl_estimator], grpo_math.IMPORTANCE_RATIOS[grpo.importance_ratio],
                   grpo.entropy_coef, grpo_math.LOSS_AGGREGATIONS[grpo.loss_aggregation], grpo.max_new_tokens)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of `labels` under softmax(logits / temperature) from vocab-parallel logits, without gathering the vocabulary."""
    from megatron.core import tensor_parallel

    # logits: [batch, seq, vocab shard]; labels: [batch, seq]. Dividing makes a copy, which the
    # cross entropy then shifts in place, so the model's own output stays intact.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits / temperature, labels)  # [batch, seq]


@torch.no_grad()
def forward_logprobs(chunks, batch: dict, temperature: float) -> torch.Tensor:
    """Per-token log-probs of a collated batch's labels under a model, forward only and in eval mode: pi_old and pi_ref
    are the policy that sampled (dropout off, as in generation), not a random dropout draw of it."""
    with build.eval_mode(chunks[0]) as model:
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
        return token_logprobs(logits, batch["labels"], temperature)  # [batch, seq]


def policy_loss(batch: dict, settings: LossSettings, logits: torch.Tensor):
    """(loss sum, count, report) of one microbatch: clipped surrogate, KL penalty and entropy bonus; megatron-core
    divides by the global count."""
    from megatron.core import parallel_state

    mask = batch["loss_mask"]  # [batch, seq]
    group = parallel_state.get_tensor_model_parallel_group()
    # A few rows at a time, in the backward too (the entropy bonus): no full-vocabulary temporaries beyond a chunk.
    if settings.entropy_coef > 0:
        entropy = grpo_math.chunked_entropy(logits, settings.temperature, group)  # [batch, seq]
    else:
        with torch.no_grad():  # logged, not optimised
            entropy = grpo_math.chunked_entropy(logits, settings.temperature, group)  # [batch, seq]
    logprobs = token_logprobs(logits, batch["labels"], settings.temperature)  # [batch, seq]
    # With one update per step pi_old is the policy itself: its own log-probs, detached (the same values a
    # separate forward-only pass gives, without the pass).
    old_logprobs = logprobs.detach() if batch["old_logprobs"] is None else batch["old_logprobs"]  # [batch, seq]
    log_ratio = settings.importance_ratio(logprobs, old_logprobs, mask)  # [batch, seq]
    per_token, clipped = grpo_math.clipped_policy_loss(log_ratio, batch["advantages"], settings.clip_low,
                                                       settings.clip_high, settings.dual_clip)
    kl = torch.zeros_like(logprobs) if batch["ref_logprobs"] is None else settings.kl_estimator(logprobs, batch["ref_logprobs"])
    per_token = per_token + settings.kl_coef * kl
    if settings.entropy_coef > 0:
        per_token = per_token - settings.entropy_coef * entropy
    loss_sum, count = settings.aggregation(per_token, mask, settings.budget)
    stats = torch.stack([(kl * mask).sum(), (entropy * mask).sum(), (clipped * mask).sum(), mask.sum()]).detach()
    return loss_sum, count.to(torch.int), {"loss": torch.stack([loss_sum.detach(), count.detach()]), "stats": stats}


def forward_step(settings: LossSettings, data_iterator, model):
    """One microbatch through the policy; the vocab-parallel logits [batch, seq, vocab shard] go to the loss."""
    batch = next(data_iterator)
    logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
    return logits, functools.partial(policy_loss, batch, settings)


# ---------------------------------------------------------------- update


class KLReference:
    """pi_ref of the KL penalty, the starting model: a frozen copy of it, or with LoRA the policy with its adapters
    switched off (which is the starting model exactly, so no copy is built)."""

    def __init__(self, policy):
        self.policy = policy
        self.copy = policy.frozen_copy() if policy.lora is None else None
        log.info("KL reference: %s", "a frozen copy of the starting model" if self.copy is not None
                 else "the policy with its LoRA adapters switched off (no copy built)")

    def logprobs(self, batch: dict, temperature: float) -> torch.Tensor:
        """Per-token log-probs of a collated batch's labels under pi_ref, forward only."""
        if self.copy is not None:
            return forward_logprobs(self.copy, batch, temperature)
        with self.policy.adapters_disabled():
            return forward_logprobs(self.policy.chunks, batch, temperature)


def build_microbatches(rollouts: Rollouts, policy, reference, config, device) -> tuple[list[dict], int]:
    """This rank's rollouts as padded microbatches with advantages, old log-probs (policy) and reference log-probs."""
    micro, temperature = config.train.micro_batch_size, config.grpo.temperature
    recompute_old = config.grpo.ppo_epochs * config.grpo.mini_batches > 1
    seq_len = batches.padded_length(rollouts.examples, config.data.max_seq_len, config.parallel.sequence_multiple)
    microbatches = []
    for start in range(0, len(rollouts.examples), micro):
        batch = batches.collate(rollouts.examples[start : start + micro], seq_len, policy.tokenizer.pad_token_id)
        batch = batches.to_device(batch, device)
        batch["advantages"] = rollouts.advantages[start : start + micro, None].to(device)  # [micro, 1]
        # pi_old only differs from the policy being optimised once an update has happened within the step.
        batch["old_logprobs"] = forward_logprobs(policy.chunks, batch, temperature) if recompute_old else None  # [micro, seq]
        batch["ref_logprobs"] = None if reference is None else reference.logprobs(batch, temperature)
        microbatches.append(batch)
    return microbatches, seq_len


def update_policy(policy, microbatches: list[dict], seq_len: int, config, settings: LossSettings) -> dict:
    """`grpo.ppo_epochs` passes over the microbatches, `grpo.mini_batches` optimizer steps each; global loss figures."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    per_update = len(microbatches) // config.grpo.mini_batches
    totals = torch.zeros(6, dtype=torch.float64)  # loss sum, loss count, kl, entropy, clipped, tokens
    grad_norms = []
    for _ in range(config.grpo.ppo_epochs):
        for start in range(0, len(microbatches), per_update):
            for chunk in policy.chunks:
                chunk.zero_grad_buffer()
            policy.optimizer.zero_grad()
            outputs = get_forward_backward_func()(
                forward_step_func=functools.partial(forward_step, settings), data_iterator=iter(microbatches[start : start + per_update]),
                model=policy.chunks, num_microbatches=per_update, seq_length=seq_len,
                micro_batch_size=config.train.micro_batch_size, forward_only=False)
            _, grad_norm, _ = policy.optimizer.step()
            grad_norms.append(float(grad_norm or 0.0))
            for output in outputs:
                totals += torch.cat([output["loss"], output["stats"]]).detach().to("cpu", torch.float64)
    loss_sum, count, kl, entropy, clipped, tokens = parallel.data_parallel_sum(totals.tolist())
    # The step's several updates each have their gradient norm: the mean is logged, and the largest beside it.
    return {"loss": loss_sum / max(count, 1), "grad_norm": sum(grad_norms) / len(grad_norms),
            **({"grad_norm_max": max(grad_norms)} if len(grad_norms) > 1 else {}),
            "kl": kl / max(tokens, 1) if settings.kl_coef > 0 else None,
            "entropy": entropy / max(tokens, 1), "clip_frac": clipped / max(tokens, 1)}


# ---------------------------------------------------------------- main


def main(argv: list[str]):
    """Parse -> validate -> build -> resume -> loop -> save; returns the trained policy (None when nothing was left to do)."""
    # ---- parse, and every check that needs no model (the default SFT's too, before it runs)
    startup = metrics.StartupTimes()
    config, resume = cli.parse_args(GRPOConfig, argv, "trainer.grpo")
    checkpoint.catch_stop_signals()  # a stop signal from here on (the default SFT included) is honoured at a step's end
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(world_size)
    if config.starts_from_default_sft():
        default_start.validate(world_size, config.model.path)
    metrics.setup_logging(process.is_global_rank_zero())
    checkpoint.check_output_dir(config, resume, process.is_global_rank_zero())
    reward = rewards.get_reward(config.grpo.reward)
    toolset = tool_data.Toolset.from_config(config.grpo)  # the user's tool modules imported before any model is built
    startup.mark("config")
    runtime = parallel.init_distributed(config.parallel, config.train.seed)
    checkpoint.check_shared_directories(config)
    startup.mark("process group")
    if config.starts_from_default_sft():
        if not default_start.train_default_sft(config):  # that SFT stopped on a signal and saved: a rerun resumes it
            parallel.shutdown(runtime)
            return None
        startup.mark("the default SFT run")
    model_path = build.resolve_model_path(config)
    checkpointer = checkpoint.Checkpointer(config, resume, model_path)
    if checkpointer.finished():
        return None
    tokenizer = build.load_tokenizer(model_path)
    end_ids = generate.end_token_ids(model_path, tokenizer)
    if toolset is not None:
        tool_data.check_template(tokenizer, toolset.schemas, tool_data.end_texts(tokenizer, end_ids))
    rollout = rollout_data.Rollout.from_config(config, tokenizer, toolset, end_ids)
    load = functools.partial(prompt_data.load_prompts, config.data, tokenizer, max_new_tokens=config.grpo.max_new_tokens,
                             tools=rollout.schemas or None)
    train_prompts = load(config.data.path, "train")
    tool_data.check_filter_reads_accuracy(toolset, config.grpo, train_prompts[0].row)
    eval_prompts = prompt_data.trim_for_data_parallel(prompt_data.held_out_split(config.data, load) or [],
                                                      config.train.eval_samples, config.parallel.data_parallel_size(world_size))
    startup.mark("tokenizer and data")

    # ---- build
    policy = build.build_policy(config, model_path, tokenizer, on_phase=startup.mark)
    reference = KLReference(policy) if config.grpo.kl_coef > 0 else None
    settings = LossSettings.from_config(config.grpo)
    reward_failures = RewardFailures(config, runtime)
    startup.mark("reference model")

    # ---- resume
    checkpointer.track(policy, lr_schedule=policy.lr_schedule)
    start_step = checkpointer.resume()
    startup.mark("resume")

    # ---- loop, and save (checkpoints when due; after the last step also the model as an HF checkpoint)
    evaluate = functools.partial(evaluation.held_out_metrics, policy, eval_prompts, reward, runtime, config,
                                 max_new_tokens=config.grpo.max_new_tokens, rollout=rollout)
    with metrics.MetricsWriter(config, runtime.is_main, start_step) as writer:
        startup.mark("loggers")
        if start_step == 0 and (baseline := evaluate()):
            writer.write({"step": 0, **baseline})  # the starting policy: the figure the run is judged against
            startup.mark("baseline evaluation")
        startup.report()
        for step in range(start_step + 1, config.train.steps + 1):
            with metrics.StepTimer() as timer:
                rollouts = collect_rollouts(policy, rollout, train_prompts, config, step, runtime, reward)
                reward_failures.check(rollouts, step)
                microbatches, seq_len = build_microbatches(rollouts, policy, reference, config, runtime.device)
                update = update_policy(policy, microbatches, seq_len, config, settings)
                policy.lr_schedule.step(increment=1)
            sampled = rollout_metrics(rollouts, config, runtime)
            row = {"step": step, "loss": update.pop("loss"), "lr": policy.optimizer.param_groups[0]["lr"],
                   "grad_norm": update.pop("grad_norm"), "tokens_per_s": sampled.pop("sequence_tokens") / timer.seconds,
                   "step_time_s": timer.seconds, **sampled, **update}
            if config.train.evaluates_at(step):
                row.update(evaluate())
            writer.write(row)
            if config.train.logs_at(step):
                writer.write_samples(step, samples(rollouts, policy.tokenizer, config.grpo.n_samples, toolset is not None))
            if checkpointer.maybe_save_or_export(step, timer.seconds):
                break
    checkpointer.export_if_already_finished(start_step)
    rollout.close()
    parallel.shutdown(runtime)
    return policy


if __name__ == "__main__":
    cli.run_cli(main)
