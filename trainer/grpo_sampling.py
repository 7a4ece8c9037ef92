"""A GRPO step's batch: which prompts it samples, its rounds of scored episodes, their groups' advantages, dynamic
sampling's choice of groups, and what a failing reward function does to the run (`trainer/grpo.py` states the rules)."""

import contextlib
import dataclasses
import functools
import hashlib
import time

import numpy
import torch

from config.errors import AgreedStop
from data import batches, prompts as prompt_data, rewards
from model import collectives
from model.sampling import Sampling
from trainer import grpo_math, rollout
from trainer.metrics import log


# ---------------------------------------------------------------- prompts and seeds


def step_prompt_indices(num_prompts: int, prompts_per_step: int, step: int, seed: int) -> list[int]:
    """Indices of step `step`'s prompts: a seeded shuffle per epoch, a pure function of the step (so resume is exact)."""
    indices = []
    for position in range((step - 1) * prompts_per_step, step * prompts_per_step):
        epoch, offset = divmod(position, num_prompts)
        indices.append(int(epoch_order(num_prompts, seed + epoch)[offset]))
    return indices


def repeated_prompts_note(num_prompts: int, config) -> str:
    """The start-up warning for a prompt set smaller than one step's prompts (`step_prompt_indices` then wraps within
    the step, so a step's groups repeat prompts: with 1 prompt and 8 a step, one prompt 8 times); empty otherwise."""
    per_step = config.train.global_batch_size // config.grpo.n_samples
    if not num_prompts or num_prompts >= per_step:  # none: refused where the set is read
        return ""
    return (f"`data.path={config.data.path}` gives {num_prompts} usable prompts, fewer than the {per_step} each step "
            f"takes (`train.global_batch_size={config.train.global_batch_size}` / `grpo.n_samples={config.grpo.n_samples}`): "
            f"each step samples the same prompts over again, about {per_step / num_prompts:.3g} groups of each, so a "
            f"step's {per_step} groups are not {per_step} prompts. Add prompts, or lower `--train.global_batch_size` to "
            f"at most {num_prompts * config.grpo.n_samples} completions.")


@functools.lru_cache(maxsize=2)  # this epoch's and the next (a step may cross into it)
def epoch_order(num_prompts: int, seed: int) -> numpy.ndarray:
    """A seeded permutation of the prompt indices (read-only), drawn once per epoch rather than at every step: the
    whole set is shuffled, which grows with the set while a step takes a few prompts."""
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed)).numpy()
    order.setflags(write=False)
    return order


class PromptSetRecord:
    """What a checkpoint notes of the prompt set (`step_prompt_indices` draws each step's prompts by position from a
    shuffle of its size): a resume on another set is said, as SFT's `BatchSchedule` says of its examples."""

    def __init__(self, prompts):
        self.count, self.contents = len(prompts), collectives.content_digest(prompts)

    def state_dict(self) -> dict:
        return {"examples": self.count, "contents": self.contents}

    def load_state_dict(self, state: dict | None) -> None:
        if note := batches.changed_data_note("prompts", state or {}, self.count, self.contents):
            log.info(note)


def rollout_seed(seed: int, step: int, dp_rank: int, round_index: int = 0) -> int:
    """Sampling seed of one step's generation round on one data-parallel rank (tensor- and pipeline-parallel ranks
    share it, as generation requires); round 0 is every step's, later rounds are dynamic sampling's."""
    suffix = f":{round_index}" if round_index else ""
    digest = hashlib.sha256(f"rollout:{seed}:{step}:{dp_rank}{suffix}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def extra_prompt_indices(num_prompts: int, count: int, seed: int, step: int, round_index: int,
                         used: list[int]) -> list[int]:
    """Dynamic sampling's `count` prompts for an extra round of a step: a seeded order, a pure function of (seed, step,
    round), with the prompts `used` by the step's earlier rounds last, so none trains twice in a step while the set
    has others; a set smaller than `count` wraps, as round 0 does across epochs, so every rank gets its share."""
    generator = torch.Generator().manual_seed(rollout_seed(seed, step, -1, round_index))
    order = torch.randperm(num_prompts, generator=generator).numpy()  # [prompts]
    taken = numpy.zeros(num_prompts, bool)
    taken[used] = True
    order = numpy.concatenate([order[~taken[order]], order[taken[order]]])  # unused first, each part in drawn order
    return [int(order[position % num_prompts]) for position in range(count)]


def round_prompts(prompts: prompt_data.PromptSet, config, step: int, round_index: int, runtime) -> list[prompt_data.Prompt]:
    """This rank's distinct prompts of one round: the step's share of the epoch's shuffle (round 0), or a seeded
    draw (dynamic sampling's extra rounds); pure functions of (train.seed, step, round), so resume is exact."""
    per_rank = config.train.global_batch_size // config.grpo.n_samples // runtime.dp_size
    count, seed = per_rank * runtime.dp_size, config.train.seed
    indices = step_prompt_indices(len(prompts), count, step, seed)
    used = list(indices)
    for earlier_round in range(1, round_index + 1):  # the step's earlier rounds on every rank: pure functions, recomputed
        indices = extra_prompt_indices(len(prompts), count, seed, step, earlier_round, used)
        used += indices
    return [prompts[index] for index in indices[runtime.dp_rank * per_rank : (runtime.dp_rank + 1) * per_rank]]


# ---------------------------------------------------------------- rounds and the step's batch


@dataclasses.dataclass
class Round:
    """One generation round on this rank: groups of `grpo.n_samples` consecutive episodes, scored."""

    episodes: list[rollout.Episode]
    truncated: list[bool]  # cut at grpo.max_new_tokens (no end id)
    scores: rewards.Scores
    penalty: float  # the overlong penalties' sum (0 without grpo.overlong_buffer)
    advantages: torch.Tensor  # [groups, samples]
    equal: torch.Tensor  # [groups]: all rewards of the group alike (zero advantage)
    kept: torch.Tensor  # [groups]: dynamic sampling keeps the group (it varies in grpo.filter_metric)
    seconds: float  # generating (tools included)
    tool_seconds: float
    reward_seconds: float  # scoring: the reward function (and a reward model), the scores' broadcast, advantages
    model_scores: torch.Tensor | None = None  # [episodes]: `grpo.reward_model`'s scores (None: no reward model)


@dataclasses.dataclass
class StepBatch:
    """One step's rollouts on this rank: the batch it trains on (groups of `grpo.n_samples` consecutive rows) and
    every round sampled for it (with dynamic sampling, more than one, and groups left out of the batch)."""

    examples: list[batches.Example]  # prompt + completion ids; the loss mask covers the trained completion tokens
    advantages: torch.Tensor  # [completions]
    zero_advantage_groups: int  # in the batch
    kept_groups: int  # in the batch, groups dynamic sampling keeps (all of them but the fill-ins)
    rounds: list[Round]
    sampler_logprobs: list[list[float]]  # per example, the sampler's log-prob of each input id (0: prompt, appended)
    routes: list | None  # Mixture-of-Experts: per example, [input ids, layers, top-k] experts of its rollout
    skipped_groups: int = 0  # groups whose prompt an environment's reset text made too long (none of them trains)
    version: int | None = None  # asynchronous GRPO: the policy that sampled it, the one after this many steps
    sampler_idle_s: float = 0.0  # asynchronous GRPO: the rollout process's waits before sampling it (`serve`)
    route_layers: list[int] | None = None  # Mixture-of-Experts: the layer number of each layer `routes` holds
    stop_requested: bool = False  # asynchronous GRPO: its rollout process had a stop signal (SIGTERM/SIGINT)

    @property
    def seconds(self) -> float:
        """Time spent generating this step's completions."""
        return sum(sampling_round.seconds for sampling_round in self.rounds)

    @property
    def reward_seconds(self) -> float:
        """Time spent scoring this step's completions."""
        return sum(sampling_round.reward_seconds for sampling_round in self.rounds)


def sample_round(policy, episode_sampler, prompts: list[prompt_data.Prompt], config, step: int, round_index: int,
                 runtime, reward, reward_model=None) -> Round:
    """Sample `grpo.n_samples` episodes of each prompt, score them (`grpo.reward_weight` x the reward function's score
    and the environment's reward, plus `grpo.reward_model_weight` x a reward model's, plus the format bonus and the
    overlong penalty, which are shaping and never weighed) and compute group advantages."""
    grpo = config.grpo
    sampling = Sampling(grpo.temperature, grpo.top_p, grpo.top_k,
                                 rollout_seed(config.train.seed, step, runtime.dp_rank, round_index))
    start = time.perf_counter()
    episodes, tool_seconds = episode_sampler.run(policy.engine, prompts, samples=grpo.n_samples,
                                                 max_new_tokens=grpo.max_new_tokens, sampling=sampling,
                                                 record_routes=bool(policy.routes))
    seconds = time.perf_counter() - start
    scores = rollout.score(reward, episodes, grpo.format_bonus)
    model_scores = None if reward_model is None else reward_model.score(episodes)  # [episodes]
    if model_scores is not None:  # a skipped prompt's episodes score 0 here too, as `rollout.score` gives them
        model_scores = model_scores.masked_fill(torch.tensor([episode.skipped for episode in episodes]), 0.0)
        model_scores = finite_model_scores(model_scores, scores, episodes, grpo.reward_model)
    shaped, penalty = shaped_rewards(scores, model_scores, episodes, grpo)
    advantages, equal = grpo_math.group_advantages(shaped.view(-1, grpo.n_samples), grpo.baseline, grpo.scale_rewards)
    kept = kept_groups(shaped, scores.correct, equal, grpo.filter_metric)
    truncated = [policy.engine.truncated(episode.ids, grpo.max_new_tokens) for episode in episodes]
    return Round(episodes, truncated, scores, penalty, advantages, equal, kept, seconds, tool_seconds,
                 time.perf_counter() - start - seconds, model_scores)


# The prefix of a reward model's failure kinds among a step's reward failures (`finite_model_scores`).
REWARD_MODEL_FAILURE = "reward model "


def finite_model_scores(model_scores: torch.Tensor, scores: rewards.Scores, episodes: list[rollout.Episode],
                        path: str) -> torch.Tensor:
    """The reward model's scores ([episodes]) with each that is not a finite number (weights saved NaN, a bf16
    overflow) taken as 0 and counted in `scores` as a failure of that episode's reward (`reward_errors`), as a reward
    function's NaN is: trained on, one NaN made every advantage of its group NaN, then the update's gradients."""
    finite = torch.isfinite(model_scores)
    for index in (~finite).nonzero().flatten().tolist():
        shown = rewards.shown_completion(episodes[index].answer)
        scores.fail(index, REWARD_MODEL_FAILURE + "non-finite score",
                    f"`grpo.reward_model={path}` scored {float(model_scores[index])} (on the completion {shown!r})")
    return model_scores.where(finite, 0.0)


def shaped_rewards(scores: rewards.Scores, model_scores: torch.Tensor | None, episodes: list[rollout.Episode],
                   grpo) -> tuple[torch.Tensor, float]:
    """Each episode's reward as trained on ([episodes]) and the overlong penalties' sum: `grpo.reward_weight` x the
    reward function's score with the environment's, plus `grpo.reward_model_weight` x the reward model's, plus the
    format bonus and the overlong penalty, shaping that no weight scales (a bonus under `reward_weight=0` still pays)."""
    # fp64, as the rewards came (`grpo_math.group_advantages` reads them so): fp32 would round 1e6 + 0.1 to 1e6 + 0.125.
    shaped = grpo.reward_weight * torch.tensor(scores.rewards, dtype=torch.float64)
    if grpo.format_bonus and grpo.reward_weight != 1:  # the scores hold the bonus: take it back out of the weight
        formatted = [in_format and not episode.skipped for in_format, episode in zip(scores.in_format, episodes)]
        shaped = shaped + (1 - grpo.reward_weight) * grpo.format_bonus * torch.tensor(formatted, dtype=torch.float32)
    if model_scores is not None:
        shaped = shaped + grpo.reward_model_weight * model_scores
    penalty = 0.0
    if grpo.overlong_buffer:  # the budget bounds the whole episode, so its length counts every token after the prompt
        penalties = grpo_math.overlong_penalty(torch.tensor([len(episode.ids) for episode in episodes]),
                                               grpo.max_new_tokens, grpo.overlong_buffer, grpo.overlong_penalty)
        shaped, penalty = shaped + penalties, float(penalties.sum())
    return shaped, penalty


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
    rounds ran out, the first groups dropped (trained with advantage 0, `collect_rollouts`). With one round of `wanted`
    groups that is every group, in order."""
    groups = [(round_index, group) for round_index, sampling_round in enumerate(rounds)
              for group in range(len(sampling_round.kept))]
    kept = [(round_index, group) for round_index, group in groups if rounds[round_index].kept[group]]
    dropped = [(round_index, group) for round_index, group in groups if not rounds[round_index].kept[group]]
    return sorted(kept[:wanted] + dropped[: max(0, wanted - len(kept))])


def trained_advantages(sampling_round: Round, group: int, dynamic_sampling: bool) -> torch.Tensor:
    """A selected group's advantages [samples]: 0 for a group dynamic sampling dropped that fills a short batch (only
    the KL term, and a teacher's per-token term, train on it): a variation in what the filter ignores, the format
    bonus or the overlong penalty, is not the signal the filter asked for."""
    if dynamic_sampling and not sampling_round.kept[group]:
        return torch.zeros_like(sampling_round.advantages[group])
    return sampling_round.advantages[group]


def collect_rollouts(policy, episode_sampler, prompts, config, step, runtime, reward, reward_model=None,
                     timer=None) -> StepBatch:
    """This rank's batch of the step: one round of rollouts, or with `grpo.dynamic_sampling` as many rounds (at most
    `grpo.max_sampling_rounds`) as the data-parallel ranks need to fill their batches with groups that carry signal.

    Every rank runs every round (the ranks agree on the count, one all-reduce per round), so generation's
    collectives under Megatron-FSDP stay matched. That all-reduce is where a rank whose round ended first waits for
    the others: timed as the step's `rank_wait` phase (`timer`, a `trainer.metrics.StepTimer`; None: not timed)."""
    grpo = config.grpo
    wanted = config.train.global_batch_size // grpo.n_samples // runtime.dp_size
    rounds = [sample_round(policy, episode_sampler, round_prompts(prompts, config, step, 0, runtime), config, step, 0,
                           runtime, reward, reward_model)]
    while grpo.dynamic_sampling and len(rounds) < grpo.max_sampling_rounds:
        short = max(0, wanted - sum(int(sampling_round.kept.sum()) for sampling_round in rounds))
        with timer.phase("rank_wait") if timer is not None else contextlib.nullcontext():
            short_anywhere = collectives.data_parallel_sum([short])[0]
        if short_anywhere == 0:
            break
        round_index = len(rounds)
        rounds.append(sample_round(policy, episode_sampler, round_prompts(prompts, config, step, round_index, runtime),
                                   config, step, round_index, runtime, reward, reward_model))
    examples, advantages, zero_advantage_count, kept_count, sampler_logprobs, routes = [], [], 0, 0, [], []
    skipped_count = 0  # groups whose prompt an environment's reset text made too long (none of them trains)
    for round_index, group in select_groups(rounds, wanted):
        sampling_round = rounds[round_index]
        trained = trained_advantages(sampling_round, group, grpo.dynamic_sampling)
        zero_advantage_count += int(sampling_round.equal[group] or not trained.any())
        kept_count += int(sampling_round.kept[group])
        skipped_count += int(sampling_round.episodes[group * grpo.n_samples].skipped)
        advantages.append(trained)
        for row in range(group * grpo.n_samples, (group + 1) * grpo.n_samples):
            episode = sampling_round.episodes[row]
            trained = 0 if grpo.mask_truncated and sampling_round.truncated[row] else 1
            # Only sampled tokens are trained: appended ones (tool messages) have mask 0, so no term of the loss
            # sees them and every normaliser that counts tokens counts sampled ones.
            examples.append(batches.Example(episode.prompt_ids + episode.ids,
                                            [0] * len(episode.prompt_ids) + [trained * flag for flag in episode.sampled]))
            sampler_logprobs.append([0.0] * len(episode.prompt_ids) + episode.logprobs)
            routes.append(episode.routes)
    return StepBatch(examples, torch.cat(advantages), zero_advantage_count, kept_count, rounds, sampler_logprobs,
                     routes if policy.routes else None, skipped_count,
                     route_layers=policy.routes.layer_numbers if policy.routes else None)


class LocalRollouts:
    """The colocated loop's batches: each step's sampled by this process's policy when the step begins, and checked
    (`refuse_a_batch_of_skipped_prompts`). The interface asynchronous GRPO's `trainer.grpo_async.RemoteRollouts`
    shares: `checkpoint_parts()`, `begin(start)`, `take(step, timer)`, `after_update(step, timer)`, `close()`."""

    def __init__(self, policy, episode_sampler, prompts, config, runtime, reward, reward_model=None):
        self.policy, self.episode_sampler, self.prompts = policy, episode_sampler, prompts
        self.config, self.runtime, self.reward, self.reward_model = config, runtime, reward, reward_model

    def checkpoint_parts(self) -> dict:
        return {}  # nothing sampled ahead

    def begin(self, start: int) -> None:
        pass

    def take(self, step: int, timer) -> StepBatch:
        step_batch = collect_rollouts(self.policy, self.episode_sampler, self.prompts, self.config, step, self.runtime,
                                      self.reward, self.reward_model, timer)
        refuse_a_batch_of_skipped_prompts(step_batch, self.config, step)
        return step_batch

    def after_update(self, step: int, timer) -> None:
        pass

    def close(self) -> None:
        pass


def refuse_a_batch_of_skipped_prompts(step_batch: StepBatch, config, step: int) -> None:
    """Stop the run with a paragraph when every group of the step's batch, over the data-parallel ranks, was skipped:
    each prompt grew past the prompt budget with its environment's reset text (`trainer.rollout`), nothing is left to
    train, and every step would log loss 0 from here on. Collective over the data-parallel group (one small
    all-reduce)."""
    if not config.grpo.environment:  # only an environment's reset text makes a prompt too long during a run
        return
    groups = len(step_batch.advantages) // config.grpo.n_samples
    skipped, groups = collectives.data_parallel_sum([step_batch.skipped_groups, groups])
    if groups and skipped == groups:
        budget = config.data.max_seq_len - config.grpo.max_new_tokens
        raise AgreedStop(f"Step {step} has nothing to train: all {int(groups)} groups of its batch were skipped. With "
                        f"the environment's reset text no prompt fits the prompt budget of {budget} tokens "
                        f"(`data.max_seq_len={config.data.max_seq_len}` - `grpo.max_new_tokens={config.grpo.max_new_tokens}`; "
                        "each skipped prompt is counted in prompts_too_long), so every step would log loss=0. Raise "
                        "`--data.max_seq_len`, or shorten what the environment's reset returns.")


# ---------------------------------------------------------------- reward failures


class RewardFailures:
    """What the reward function (and an environment's `reward()`) failed on, said: the first failure of each kind
    (exception type) once, with the function, the exception and the completion; and a step on which it failed on every completion stops the run with
    a paragraph (every reward would be 0: a flat curve, nothing learned), unless `grpo.tolerate_reward_errors`."""

    def __init__(self, config, runtime):
        self.config, self.runtime, self.reported = config, runtime, set()

    def check(self, step_batch: StepBatch, step: int, timer) -> None:
        """Collective over data-parallel ranks (one small all-reduce; a gather only in a step where a score failed).
        The step's first collective after sampling (with dynamic sampling, after its rounds' own), where a rank whose
        rollouts ended first waits for the others: timed as the step's `rank_wait` phase (`timer`, a
        `trainer.metrics.StepTimer`)."""
        local_errors = sum(sampling_round.scores.errors for sampling_round in step_batch.rounds)
        local_count = sum(len(sampling_round.episodes) for sampling_round in step_batch.rounds)
        with timer.phase("rank_wait"):
            errors, count = collectives.data_parallel_sum([local_errors, local_count])
        if errors == 0:
            return
        failures = {}
        local_failures = {kind: text for sampling_round in step_batch.rounds
                          for kind, text in sampling_round.scores.failures.items()}
        for rank_failures in collectives.data_parallel_gather(local_failures):
            for kind, text in rank_failures.items():
                failures.setdefault(kind, text)
        grpo = self.config.grpo
        environment = [kind.startswith(rollout.ENVIRONMENT_FAILURE) for kind in failures]
        judged = [kind.startswith(REWARD_MODEL_FAILURE) for kind in failures]
        parts = [f"`grpo.reward={grpo.reward}`"] + (["the environment's `reward()`"] if any(environment) else []) + (
            [f"the reward model `grpo.reward_model={grpo.reward_model}`"] if any(judged) else [])
        what = f"the reward ({' plus '.join(parts)})" if len(parts) > 1 else f"the reward function {parts[0]}"
        if errors == count and not grpo.tolerate_reward_errors:  # every data-parallel rank raises it here
            by_function = [not (env or model) for env, model in zip(environment, judged)]
            advice = "; ".join(([] if not any(by_function) else ["A reward function takes (completion, reference) strings "
                                                                 "and returns a number (1.0: full marks)"]) + (
                [f"an environment's `reward()` returns a number or `(reward, correct)` within `grpo.reward_timeout` "
                 f"({grpo.reward_timeout:g} s; 0: no limit)"] if any(environment) else []) + (
                ["a reward model's scores must be finite numbers: check its weights (a reward model exported from a "
                 "diverged run holds NaN), or score in fp32 (`--model.dtype=fp32`, which the reward model runs in as the policy does)"] if any(judged) else []))
            raise AgreedStop(
                f"{what[0].upper()}{what[1:]} failed on every one of the {int(count)} completions of step {step}, so "
                f"every reward would be 0 and the run would learn nothing: {'; '.join(failures.values())}. "
                f"{advice[0].upper()}{advice[1:]}; fix it, or set `--grpo.tolerate_reward_errors=true` to train on "
                "anyway.")
        for kind in sorted(set(failures) - self.reported):
            if self.runtime.is_main:
                log.warning("step %d: %s failed on %d of %d completions, each scored 0; the first "
                            "%s failure: %s (said once per kind of failure; `reward_errors` counts them every step)",
                            step, what, int(errors), int(count), kind, failures[kind])
            self.reported.add(kind)
