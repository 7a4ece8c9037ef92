"""What a GRPO step reports: its metrics.jsonl row (the update's loss figures, throughput, and the global figures of
every completion sampled for it) and the few episodes shown in samples.jsonl."""

import logging

import torch

from model import collectives
from trainer import metrics, rollout
from trainer.grpo_sampling import StepBatch

SAMPLES_PER_LOG = 4

log = logging.getLogger(__name__)


def step_row(step: int, policy, runtime, config, step_batch: StepBatch, update: dict, timer: metrics.StepTimer) -> dict:
    """The step's metrics row: loss, learning rate, gradient norm and throughput first, then the step's rollouts' global
    figures (`rollout_figures`), the step's phases (`phase_figures`), then the update's other figures (KL, entropy, clip
    fraction). Collective."""
    # Counted only where `say_no_group_kept` reads it (the same on every rank: the sums stay matched).
    graded = {"graded_groups": graded_groups(step_batch, config.grpo)} if config.grpo.filters_by_accuracy() else {}
    totals = {**rollout_totals(step_batch), **graded, **timer.phases}
    global_totals = dict(zip(totals, collectives.data_parallel_sum(list(totals.values()))))
    row = {"step": step, "loss": update["loss"], "lr": update["lr"],
           "grad_norm": update["grad_norm"], "tokens_per_s": global_totals["all_tokens"] / timer.seconds,
           "step_time_s": timer.seconds, **rollout_figures(global_totals, step_batch, config, runtime),
           **phase_figures(global_totals, runtime, samplers(config, runtime)),
           **(async_figures(step, global_totals, timer, runtime) if step_batch.version is not None else {})}
    if update.get("rollout_rejected_share") == 1.0:
        say_all_rejected(step, config.grpo, update["rollout_is_ratio_mean"])
    if update["entropy"] is None:
        say_nothing_trained(step, config.grpo, row["truncated_rate"])
    say_no_group_kept(step, config.grpo, global_totals, len(step_batch.rounds))
    return {**row, **{key: value for key, value in update.items() if key not in ("loss", "lr", "grad_norm")}}


def say_all_rejected(step: int, grpo, ratio_mean: float) -> None:
    """A step whose rollout rejection left every token out of the loss trained on nothing but its KL and entropy terms:
    said each time, with the likely cause (the metric alone, `rollout_rejected_share` 1, is easy to miss)."""
    truncated = grpo.top_k > 0 or grpo.top_p < 1.0
    log.warning("step %d: `grpo.rollout_correction=%s` left every trained token out of the loss (pi_old / pi_sampler "
                "outside [1/%g, %g]; its mean %.3g): the step learned nothing from its rewards. %s", step,
                grpo.rollout_correction, grpo.rollout_correction_cap, grpo.rollout_correction_cap, ratio_mean,
                f"With `grpo.top_k={grpo.top_k}` / `grpo.top_p={grpo.top_p:g}` the sampler's log-probs are those of "
                "the truncated distribution, above the whole vocabulary's the loss reads: the ratio sits near the kept "
                "mass. Use `--grpo.rollout_correction tis`, raise `--grpo.rollout_correction_cap`, or sample without them."
                if truncated else "Raise `--grpo.rollout_correction_cap` or use `--grpo.rollout_correction tis`.")


def say_nothing_trained(step: int, grpo, truncated_rate: float) -> None:
    """A step whose batch held no trained token (its token means are None in its row, not 0): said each time, with
    the likely cause."""
    log.warning("step %d trained on no token: %s", step,
                f"all its completions were cut at `grpo.max_new_tokens={grpo.max_new_tokens}` (truncated_rate "
                f"{truncated_rate:g}) and `grpo.mask_truncated` leaves those out of the loss. Raise "
                "`--grpo.max_new_tokens` or set `--grpo.mask_truncated false`." if grpo.mask_truncated and truncated_rate == 1
                else "no completion has a token the policy sampled left in the loss.")


def graded_groups(step_batch: StepBatch, grpo) -> int:
    """This rank's groups of the step (all rounds) whose reward varies apart from the shaping (format bonus, overlong
    penalty): the reward function's score with an environment's, and a reward model's, as weighed."""
    count = 0
    for sampling_round in step_batch.rounds:
        bonus = grpo.format_bonus * torch.tensor(sampling_round.scores.in_format, dtype=torch.float64)
        values = grpo.reward_weight * (torch.tensor(sampling_round.scores.rewards, dtype=torch.float64) - bonus)
        if sampling_round.model_scores is not None:
            values = values + grpo.reward_model_weight * sampling_round.model_scores.double()
        grouped = values.view(len(sampling_round.kept), -1)  # [groups, samples]
        count += int((grouped.amax(dim=1) != grouped.amin(dim=1)).sum())
    return count


def say_no_group_kept(step: int, grpo, total: dict, rounds: int) -> None:
    """A step of dynamic sampling by accuracy that kept no group because no completion was correct, while rewards
    varied: a reward function whose top score is below full marks (partial credit on a 0-0.5 scale) marks nothing
    correct, so every group was dropped and the step trained at advantage 0 (loss 0, grad_norm 0), every step, with no
    word but `kept_group_rate=0`. Said each time, with the cause (`total`: the step's global sums)."""
    if not grpo.filters_by_accuracy():
        return
    if total["kept_groups"] or total["correct"] or not total["graded_groups"]:
        return
    log.warning("step %d trained on no group's reward: `grpo.dynamic_sampling` keeps the groups whose accuracy varies "
                "(`grpo.filter_metric=accuracy`), and no completion of its %d sampling rounds was correct (a reward of "
                "1.0 or more, or `(reward, True)`) while the rewards of %d groups varied: every group was dropped and "
                "trained at advantage 0. A reward function whose top score is below 1.0 marks no completion correct: "
                "return `(reward, correct)` from `grpo.reward=%s`, give full marks as 1.0, or set "
                "`--grpo.filter_metric=reward`.", step, rounds, int(total["graded_groups"]), grpo.reward)


def samplers(config, runtime) -> int:
    """How many processes sample side by side: the data-parallel ranks, or the rollout processes (each sampling the
    batches of several trainer ranks one after another): the rollout phases' sums over batches divide by it."""
    return config.grpo.rollout_processes or runtime.dp_size


def phase_figures(total: dict, runtime, sampling: int) -> dict:
    """Where the step's seconds went besides generating (`rollout_time_s`): scoring (`reward_time_s`), pi_old's
    forward (`pi_old_time_s`, 0 unless it is recomputed), the KL reference's (`reference_time_s`, 0 without KL), the
    distillation teacher's (`teacher_time_s`, only with `grpo.teacher`), the
    update (`update_time_s`: forwards, backwards, optimizer steps) and the wait for the data-parallel ranks' slowest
    rollout (`rank_wait_time_s`), means over data-parallel ranks as `rollout_time_s` (what is left of `step_time_s`:
    collating the micro-batches; scoring and sampling as the `sampling` processes that did them saw them); on a GPU also this process's
    peak allocated memory (`peak_memory_gib`). The loop adds `eval_time_s` and `checkpoint_time_s` (rank 0's, after
    the step's clock stops)."""
    return {"reward_time_s": total["reward_seconds"] / sampling,
            **{name: total[name] / runtime.dp_size for name in ("pi_old_time_s", "reference_time_s", "update_time_s",
                                                                "rank_wait_time_s")},
            **({"teacher_time_s": total["teacher_time_s"] / runtime.dp_size} if "teacher_time_s" in total else {}),
            **metrics.peak_memory_gib()}


def async_figures(step: int, total: dict, timer: metrics.StepTimer, runtime) -> dict:
    """Asynchronous GRPO's figures (`trainer.grpo_async`): how many updates behind the sampling policy was
    (`staleness`: every token of a step's batch, on every rank, comes from one policy version, `sampled_by(step)`, so
    its mean and its maximum are this one number), the trainers' wait for batches (`rollout_wait_time_s`) and their share of the step
    (`trainer_idle_share`), the weights' push (`weight_sync_time_s`), and the rollout processes' waits (for the trainers
    to take the last step's batches, and for the update that samples this one) as a share of their period
    (`rollout_idle_share`, verl's `rollouter/idle_ratio`)."""
    dp = runtime.dp_size
    waiting, busy = total["sampler_idle_s"], total["seconds"] + total["reward_seconds"]
    return {"staleness": step - 1 - total["version"] / dp,
            "rollout_wait_time_s": total.get("rollout_wait_time_s", 0.0) / dp,
            "weight_sync_time_s": total.get("weight_sync_time_s", 0.0) / dp,
            "trainer_idle_share": total.get("rollout_wait_time_s", 0.0) / dp / timer.seconds,
            "rollout_idle_share": waiting / max(waiting + busy, 1e-9)}


def rollout_totals(step_batch: StepBatch) -> dict:
    """This rank's sums over every episode sampled for the step (all rounds), and the batch's group and token counts."""
    totals = {"count": 0, "reward": 0.0, "correct": 0, "errors": 0, "in_format": 0, "right_answer": 0,
              "truncated": 0, "completion_tokens": 0, "sampled_tokens": 0, "penalty": 0.0, "groups": 0,
              "tool_seconds": 0.0, "model_score": 0.0, **dict.fromkeys(rollout.totals([]), 0.0)}
    for sampling_round in step_batch.rounds:
        for key, value in (*sampling_round.scores.totals().items(), *rollout.totals(sampling_round.episodes).items()):
            totals[key] += value
        totals["count"] += len(sampling_round.episodes)
        totals["truncated"] += sum(sampling_round.truncated)
        totals["completion_tokens"] += sum(len(episode.ids) for episode in sampling_round.episodes)
        totals["sampled_tokens"] += sum(sum(episode.sampled) for episode in sampling_round.episodes)
        totals["penalty"] += sampling_round.penalty
        totals["groups"] += len(sampling_round.kept)
        totals["tool_seconds"] += sampling_round.tool_seconds
        if sampling_round.model_scores is not None:
            totals["model_score"] += float(sampling_round.model_scores.sum())
    return {**totals, "zero_groups": step_batch.zero_advantage_groups, "kept_groups": step_batch.kept_groups,
            "seconds": step_batch.seconds, "reward_seconds": step_batch.reward_seconds,
            "version": step_batch.version or 0, "sampler_idle_s": step_batch.sampler_idle_s,
            "all_tokens": sum(len(example.input_ids) for example in step_batch.examples)}


def rollout_figures(total: dict, step_batch: StepBatch, config, runtime) -> dict:
    """Reward, accuracy, answer-form and length figures of every completion sampled for the step, and the batch's
    zero-advantage groups (with dynamic sampling, its rounds and kept share too), from the global `total`."""
    count = total["count"]
    figures = {"reward_mean": total["reward"] / count, "accuracy": total["correct"] / count,
               "format_rate": total["in_format"] / count, "answer_accuracy": total["right_answer"] / count,
               "response_len": total["completion_tokens"] / count,
               "rollout_tokens_per_s": total["completion_tokens"] / (total["seconds"] / samplers(config, runtime)),
               "rollout_time_s": total["seconds"] / samplers(config, runtime), "reward_errors": int(total["errors"]),
               "zero_advantage_groups": int(total["zero_groups"]),
               "truncated_rate": total["truncated"] / count}
    if config.grpo.tools or config.grpo.environment:
        figures.update(tool_metrics(total, count, samplers(config, runtime)))
    if config.grpo.overlong_buffer:
        figures["overlong_penalty"] = total["penalty"] / count
    if config.grpo.reward_model:  # `reward_mean` stays the reward function's
        figures["reward_model_score"] = total["model_score"] / count
    if config.grpo.dynamic_sampling:
        figures["sampling_rounds"] = len(step_batch.rounds)
        figures["kept_group_rate"] = total["kept_groups"] / total["groups"]
    return figures


def tool_metrics(total: dict, count: float, sampling: int) -> dict:
    """With tools: per-episode turns and calls, the share of episodes that called a tool, the failures' counts, the
    sampled share of the episodes' tokens and the seconds spent in tools (per sampling process, like rollout_time_s)."""
    return {"turns_per_episode": total["turns"] / count, "tool_calls_per_episode": total["tool_calls"] / count,
            "tool_call_rate": total["episodes_with_calls"] / count, "tool_errors": int(total["tool_errors"]),
            "tool_parse_errors": int(total["parse_errors"]), "tool_timeouts": int(total["tool_timeouts"]),
            "tool_timeout_ends": int(total["timeout_ends"]), "unknown_tools": int(total["unknown_tools"]),
            "max_turns_reached": int(total["max_turns_reached"]), "out_of_room": int(total["out_of_room"]),
            "truncated_tool_responses": int(total["truncated_tool_responses"]),
            "prompts_too_long": int(total["prompts_too_long"]),
            "sampled_token_share": total["sampled_tokens"] / max(total["completion_tokens"], 1),
            "tool_time_s": total["tool_seconds"] / sampling}


def sample_rows(step_batch: StepBatch, tokenizer, n_samples: int, toolset) -> list[dict]:
    """A few of this rank's first-round episodes for samples.jsonl: the first of each prompt, then the second, ...;
    each with its reward (the reward function's, with an environment's and the format bonus), a reward model's score
    where one scores, and its group advantage (before dynamic sampling's selection and a teacher's per-token term);
    with a toolset each also as its trajectory, in runs of what
    the policy sampled and what was appended."""
    first_round = step_batch.rounds[0]
    order = sorted(range(len(first_round.episodes)), key=lambda index: (index % n_samples, index // n_samples))
    shown = []
    for index in order[:SAMPLES_PER_LOG]:
        episode = first_round.episodes[index]
        shown.append({"prompt": tokenizer.decode(episode.prompt_ids, skip_special_tokens=True).strip(),
                      "completion": episode.answer, "reward": first_round.scores.rewards[index],
                      **({} if first_round.model_scores is None else
                         {"reward_model_score": float(first_round.model_scores[index])}),
                      "advantage": float(first_round.advantages.view(-1)[index]), "reference": episode.prompt.reference})
        if toolset is not None:
            shown[-1].update(turns=episode.counts["turns"], tool_calls=episode.counts["tool_calls"],
                             trajectory=rollout.trajectory(tokenizer, episode))
    return shown
