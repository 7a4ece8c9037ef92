"""GRPO: `torchrun --nproc-per-node N -m trainer.grpo [--config FILE] [--key=value ...]`.

The variant, exactly (defaults in brackets):
- Rollouts: each step takes `train.global_batch_size / grpo.n_samples` prompts (a seeded shuffle per epoch);
  every data-parallel rank samples `grpo.n_samples` [8] completions for each of its share from the current
  policy (`grpo.temperature` [1.0], `grpo.top_p`, `grpo.top_k`, at most `grpo.max_new_tokens`, stopping at
  any end id the model declares: the tokenizer's EOS and generation_config's) with megatron-core's KV cache; with
  pipeline stages each forward passes stage to stage and the last stage samples for all (`model/generate.py`).
  The seed of step s on data-parallel rank d is derived from (train.seed, s, d) and the prompt order from
  (train.seed, s), so a run, and a resume, is reproducible.
- Asynchronous (`grpo.rollout_processes` N > 0): the last N processes sample (whole replicas, sent the weights
  after every update) while the others train; step s is sampled by the policy after step s-1-`grpo.max_staleness`
  with the same prompts and seeds, so runs repeat and resume exactly (`trainer/grpo_async.py`).
- Tools (`grpo.tools`, `grpo.environment`): an episode is then several turns, the tool messages between them appended
  as token ids into the same KV cache and left out of the loss (mask 0); the reward scores the last turn, plus the
  environment's own reward. `trainer/rollout.py` states the rules; `max_new_tokens` bounds the whole episode.
- Reward: `grpo.reward(completion, reference)` [arithmetic] plus `grpo.format_bonus` [0] for a `#### N`
  answer, computed on the first rank of each model-parallel group (tensor and pipeline ranks) and sent to the
  others; a reward function that raises (or returns no finite number) scores 0 and is counted (`reward_errors`),
  its first failure of each kind logged with the completion; failing on every completion of a step stops the run
  with a paragraph, unless `grpo.tolerate_reward_errors`. With `grpo.overlong_buffer` N > 0 (DAPO), a completion
  longer than max_new_tokens - N loses reward linearly, `grpo.overlong_penalty` at the budget.
- Dynamic sampling (`grpo.dynamic_sampling`, DAPO): groups whose accuracy (the reward function's full marks;
  `grpo.filter_metric=reward`: the shaped reward) is all equal are dropped and another round of prompts is sampled,
  at most `grpo.max_sampling_rounds` [4] rounds a step, until each rank's share of the batch is groups kept (a batch
  still short is filled with dropped groups). Extra rounds draw their prompts and seeds from (train.seed, step,
  round, DP rank), prompts the step has not used first, wrapping around a small set; every rank runs every round.
- Reward: `grpo.reward_weight` [1] x the reward function's score (+ an environment's reward), plus with a reward
  model (`grpo.reward_model`) `grpo.reward_model_weight` [1] x its score of the conversation (`trainer.reward_model`),
  plus the format bonus and the overlong penalty, which no weight scales (`grpo_sampling.shaped_rewards`).
- Advantage, one per completion, shared by its tokens: A = (r - b) / (std + 1e-4) within the prompt's
  group, b the group mean [GRPO] or the mean of the other completions (`grpo.baseline=leave_one_out`,
  RLOO); `grpo.scale_rewards=false` drops the std division (Dr. GRPO). All-equal groups get A = 0 exactly.
  With a teacher (`grpo.teacher`, on-policy distillation) each trained token's advantage is A plus
  `grpo.teacher_coef` [1] x (log pi_teacher - log pi_old) of that token (`trainer.grpo_update.Teacher`);
  `grpo.reward_weight=0` makes the teacher's term the whole signal (with a format bonus or overlong penalty beside it).
- Loss per completion token: the PPO clipped surrogate max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A)
  [0.2, 0.28: DAPO's clip-higher] with r = pi / pi_old per token, or per completion as
  exp(mean log ratio) (`grpo.importance_ratio=sequence`, GSPO), log-ratio clamped to +-20, bounded by
  -dual_clip A for A < 0 [3.0], plus kl_coef [0.01] x KL(pi || pi_ref) (estimator k3 [or k2, k1]; pi_ref the
  starting model: a frozen copy, built only when kl_coef > 0, or with LoRA the policy with its adapters
  switched off), minus `grpo.entropy_coef` [0] x the token's entropy (at 0 it is only logged, computed a few rows
  at a time without gradient). pi_old is the policy's own log-prob, recomputed forward-only in eval mode (no
  dropout, as the rollouts were sampled) when the rollouts serve several updates (ppo_epochs x mini_batches > 1)
  or LoRA's dropout is on (`peft.dropout` > 0: r is then the dropout draw's ratio to it); otherwise, with one update
  per step, it is the policy's log-prob detached (r = 1 in value, the same numbers without the extra pass).
  `grpo.mask_truncated` leaves completions cut at the budget out of the loss. The training forwards lay each group out as one row, its prompt once (`grpo.share_prompts`
  [true], `model.shared_prefix`): the same log-probs and gradients, up to the order of float sums. Log-probs and entropy use the vocab-parallel logits / temperature, never gathering
  the vocabulary.
- Aggregation: the token mean over the whole global batch [token_mean, as DAPO], the mean over completions of
  each one's token mean (`seq_mean_token_mean`, the original GRPO paper), or each completion's token sum over
  the budget max_new_tokens, averaged over completions (`seq_mean_token_sum_norm`, Dr. GRPO).
- Update: `grpo.ppo_epochs` [1] passes over the rollouts, each split into `grpo.mini_batches` [1] optimizer
  steps; the learning-rate schedule advances once per GRPO step (not when fp16's loss scale skipped all its updates).
  `grad_norm` is the mean over the step's applied updates (`grad_norm_max` the largest, with several).
- Named recipes (`--config grpo|dapo|dr_grpo|gspo|rloo`) set these keys as the papers do: `recipes/`.

Words: a completion is what the policy writes after a prompt; an episode is one sample of a prompt, its completion
or, with tools, its trajectory (the turns and the tool messages appended between them, kept as token ids); a group is
the `grpo.n_samples` episodes of one prompt, whose rewards give their advantages; a round is one generation pass over
a set of prompts (a step has one, or with dynamic sampling up to `grpo.max_sampling_rounds`); the step's batch is the
groups it trains on. The episode sampler (`trainer.rollout.Rollout`) turns prompts into episodes through the policy's
generation engine (`model.generate.Engine`), running the tools of each episode (`data.tools.EpisodeTools`).
`trainer/grpo_sampling.py` samples and scores the batch, `trainer/grpo_update.py` computes the loss and steps the
optimizer, `trainer/grpo_metrics.py` builds the rows metrics.jsonl and samples.jsonl get.

parse -> validate -> build -> resume -> loop -> save. With no arguments it starts from the default SFT's
output `outputs/sft/hf`, running that SFT first, in the same process group, when it is missing.
Resume: a checkpoint holds model, optimizer, LR schedule and step; prompt order and sampling seeds are pure
functions of (train.seed, step), so N steps + resume + N steps repeat 2N straight steps exactly.
"""

import dataclasses
import functools
import os
from pathlib import Path

from ckpt import checkpoint
from config import cli, console, process
from config.loops import GRPOConfig
from data import prompts as prompt_data, rewards, tool_text, tools as tool_data
from model import build, collectives, generate, parallel
from trainer import default_start, evaluation, grpo_async, metrics, rollout
from trainer.grpo_metrics import sample_rows, step_row
from trainer.grpo_sampling import LocalRollouts, PromptSetRecord, RewardFailures, repeated_prompts_note
from trainer.grpo_update import FrozenModels, LossSettings, build_microbatches, check_teacher_tokenizer, update_policy


def validated_world_size(config) -> int:
    """The number of processes that train (all but `grpo.rollout_processes`), once the config (and the default SFT's,
    when that runs first) passed every check that needs no model."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(world_size)
    # The trainers' turns (rollouts, or with rollout processes the held-out evaluation) wait on collectives; a rollout
    # process's wait on the link is its own (`model.link.WAIT`).
    tool_data.check_turn_fits_collective_timeout(config, world_size - config.grpo.rollout_processes)
    if config.starts_from_default_sft():
        sft = default_start.validate(world_size, config.model.path, config.data)
        default_start.check_outputs_apart(config, sft, "GRPO")
    else:
        default_start.say_earlier_start(config.model.path)
    return world_size - config.grpo.rollout_processes


def load_user_code(config, world_size: int) -> tuple:
    """(reward function, toolset or None): a user's reward, tool and environment modules, imported before any model
    is built, with this process's GPU already bound (`parallel.use_local_gpu`: a module may put a model on "cuda" at
    import)."""
    parallel.use_local_gpu(config.parallel, world_size)
    reward = rewards.get_reward(config.grpo.reward, config.grpo.reward_timeout, config.grpo.tool_workers)
    return reward, tool_data.Toolset.from_config(config.grpo)


def train_default_sft_first(config, startup, rejoin: bool = True) -> bool:
    """Run the default SFT (GRPO's bundled start) in this process group; False when it stopped on a signal and saved."""
    if finished := default_start.train_default_sft(config, rejoin):
        startup.mark("the default SFT run")
    return finished


def default_sft_before_the_split(config, startup) -> bool:
    """Asynchronous GRPO from a bundled start that does not exist yet: its SFT runs first, on every process, in a
    process group of its own (the trainers' and the rollout processes' groups are made after it); False when it stopped
    on a signal and saved."""
    if not (config.grpo.rollout_processes and config.starts_from_default_sft()):
        return True
    return train_default_sft_first(config, startup, rejoin=False)


def load_tokenizer_and_prompts(config, model_path, toolset, world_size: int) -> tuple:
    """(tokenizer, episode sampler, train prompts, held-out prompts), the chat template checked against the tools."""
    tokenizer = build.load_tokenizer(model_path, template_variables=config.data.chat_template_kwargs)
    check_teacher_tokenizer(config, tokenizer)
    if config.grpo.reward_model:  # its tokenizer's checks now, before any model is built (RewardModel loads it again)
        build.load_tokenizer(Path(config.grpo.reward_model), "grpo.reward_model")
    end_ids = generate.end_token_ids(model_path, tokenizer)
    if toolset is not None:
        tool_text.check_template(tokenizer, toolset.schemas, tool_text.end_texts(tokenizer, end_ids))
    episode_sampler = rollout.Rollout.from_config(config, tokenizer, toolset, end_ids)
    load = functools.partial(prompt_data.load_prompts, config.data, tokenizer, max_new_tokens=config.grpo.max_new_tokens,
                             tools=episode_sampler.schemas or None,
                             cache_dir=process.cache_dir() if config.data.cache else None)
    train_prompts = load(config.data.path, config.data.train_split)
    if note := repeated_prompts_note(len(train_prompts), config):
        metrics.log.warning(note)
    rewards.check_references_graded(config.grpo, train_prompts, config.data.path)
    tool_data.check_offered_tools_run(toolset, train_prompts, config.data.path)
    tool_data.check_filter_reads_accuracy(toolset, config.grpo, train_prompts[0].row)
    eval_prompts = prompt_data.trim_for_data_parallel(prompt_data.held_out_split(config.data, load) or [],
                                                      config.train.eval_samples, config.parallel.data_parallel_size(world_size),
                                                      prompt_data.held_out_source(config.data))
    rewards.check_references_graded(config.grpo, eval_prompts, prompt_data.held_out_source(config.data), held_out=True)
    tool_data.check_offered_tools_run(toolset, eval_prompts, config.data.eval_path or config.data.path)
    return tokenizer, episode_sampler, train_prompts, eval_prompts


def load_inputs(config, model_path, toolset, world_size: int, checkpointer) -> tuple:
    """`load_tokenizer_and_prompts` on every trainer, its user errors every trainer's (`collectives.agreed`: the
    process group is up), and the same settings, prompts and frozen models (the KL reference, reward model and teacher,
    which no rank receives from another as the policy's weights are: the digests the checkpointer read) on every one
    (`collectives.check_same_everywhere`)."""
    loaded = collectives.agreed(load_tokenizer_and_prompts, config, model_path, toolset, world_size)
    collectives.check_same_everywhere(config, {"data.path": loaded[2], **checkpointer.fingerprint["inputs"]})
    return loaded


def close_workers(episode_sampler, reward) -> None:
    """Stop the worker processes of the tools and of a `module:function` reward."""
    episode_sampler.close()
    rewards.close(reward)


def run_rollout_process(config, runtime, reward, toolset) -> None:
    """A rollout process of asynchronous GRPO: the tokenizer, the prompts and a whole forward-only replica of the
    policy, then sampling for the trainers until they end (`trainer.grpo_async.serve`)."""
    model_path = build.resolve_model_path(config)
    tokenizer, episode_sampler, train_prompts, _ = load_tokenizer_and_prompts(config, model_path, toolset,
                                                                              runtime.link.trainers)
    replica_config = dataclasses.replace(config, parallel=parallel.rollout_layout(config.parallel))
    replica = build.build_policy(replica_config, model_path, tokenizer, trainable=False)
    try:
        grpo_async.serve(config, runtime, replica, episode_sampler, train_prompts, reward)
    finally:
        close_workers(episode_sampler, reward)
        parallel.shutdown(runtime)


def join_as_trainer(config, startup, reward, toolset):
    """The process group, and the default SFT when GRPO starts from it and it is missing (with rollout processes, before
    the two sides split; otherwise in the same group); a rollout process runs its loop here. This trainer's runtime, or
    None: a rollout process that served its run, or a default SFT that stopped on a signal (saved: a rerun resumes it)."""
    if not default_sft_before_the_split(config, startup):
        return None
    runtime = parallel.init_distributed(config.parallel, config.train.seed, config.grpo.rollout_processes)
    if runtime.is_rollout:
        return run_rollout_process(config, runtime, reward, toolset)
    checkpoint.check_shared_directories(config)
    startup.mark("process group")
    if config.starts_from_default_sft() and not train_default_sft_first(config, startup):
        parallel.shutdown(runtime)
        return None
    return runtime


def rollouts_for(config, runtime, policy, episode_sampler, train_prompts, reward, frozen):
    """Where the step's batches come from: this process's policy (colocated, scored by `frozen`'s reward model when
    there is one), or the rollout processes."""
    if runtime.link is None:
        return LocalRollouts(policy, episode_sampler, train_prompts, config, runtime, reward, frozen.reward_model)
    return grpo_async.RemoteRollouts(config, runtime, policy)


def main(argv: list[str]):
    """Parse -> validate -> build -> resume -> loop -> save; returns the trained policy (None when nothing was left to do)."""
    # ---- parse, and every check that needs no model (the default SFT's too, before it runs)
    startup = metrics.StartupTimes()
    console.setup()  # first: a check below may warn, once (rank 0), or per rank where it is that rank's own
    config, resume = cli.parse_args(GRPOConfig, argv, "trainer.grpo")
    checkpoint.catch_stop_signals()  # a stop signal from here on (the default SFT included) is honoured at a step's end
    world_size = validated_world_size(config)
    checkpoint.check_output_dir(config, resume, process.is_global_rank_zero())
    reward, toolset = load_user_code(config, world_size)
    startup.mark("config")
    if (runtime := join_as_trainer(config, startup, reward, toolset)) is None:
        return None  # a rollout process that served its run, or a default SFT stopped on a signal
    model_path = collectives.agreed(build.resolve_model_path, config)
    checkpointer = collectives.agreed(checkpoint.Checkpointer, config, resume, model_path)
    if checkpointer.finished():
        return grpo_async.end_without_steps(runtime)
    tokenizer, episode_sampler, train_prompts, eval_prompts = load_inputs(config, model_path, toolset, world_size,
                                                                            checkpointer)
    startup.mark("tokenizer and data")

    # ---- build
    policy = build.build_policy(config, model_path, tokenizer, on_phase=startup.mark)
    frozen = FrozenModels.for_run(config, policy)  # the KL reference, the reward model, the distillation teacher
    settings = LossSettings.for_run(config, policy, frozen.teacher)
    reward_failures = RewardFailures(config, runtime)
    rollouts = rollouts_for(config, runtime, policy, episode_sampler, train_prompts, reward, frozen)
    startup.mark("reference model")

    # ---- resume
    checkpointer.track(policy, lr_schedule=policy.lr_schedule, prompts=PromptSetRecord(train_prompts),
                       **rollouts.checkpoint_parts())
    start_step = checkpointer.resume()
    rollouts.begin(start_step)
    startup.mark("resume")

    # ---- loop, and save (checkpoints when due; after the last step also the model as an HF checkpoint)
    evaluate = functools.partial(evaluation.held_out_metrics, policy, eval_prompts, reward, runtime, config,
                                 max_new_tokens=config.grpo.max_new_tokens, episode_sampler=episode_sampler)
    with metrics.MetricsWriter(config, runtime.is_main, start_step) as writer, checkpointer.kept_on_agreed_stop():
        startup.mark("loggers")
        if start_step == 0 and (baseline := evaluate()):
            writer.write({"step": 0, **baseline})  # the starting policy: the figure the run is judged against
            startup.mark("baseline evaluation")
        startup.report()
        for step in range(start_step + 1, config.train.steps + 1):
            with metrics.StepTimer() as timer:
                step_batch = rollouts.take(step, timer)
                reward_failures.check(step_batch, step, timer)
                microbatches, seq_len = build_microbatches(step_batch, policy, frozen, config, settings, runtime.device, timer)
                update = update_policy(policy, microbatches, seq_len, config, settings, timer)
                rollouts.after_update(step, timer)
            row = step_row(step, policy, runtime, config, step_batch, update, timer)
            metrics.stop_if_diverged(row, writer, checkpointer)  # NaN or infinite gradients: nothing more is saved
            if config.train.evaluates_at(step) and eval_prompts:
                row.update(metrics.timed("eval", evaluate, into=row))
            stop = metrics.timed("checkpoint", checkpointer.maybe_save_or_export, step, row, into=row)
            writer.write(row)
            if config.train.logs_at(step):
                writer.write_samples(step, sample_rows(step_batch, policy.tokenizer, config.grpo.n_samples, toolset))
            if stop:
                break
    rollouts.close()
    checkpointer.export_if_already_finished(start_step)
    close_workers(episode_sampler, reward)
    parallel.shutdown(runtime)
    return policy


if __name__ == "__main__":
    cli.run_cli(main)
