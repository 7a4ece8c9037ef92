"""GRPO: `torchrun --nproc-per-node N -m trainer.grpo [--config FILE] [--key=value ...]`.

The variant, exactly (defaults in brackets):
- Rollouts: each step takes `train.global_batch_size / grpo.n_samples` prompts (a seeded shuffle per epoch);
  every data-parallel rank samples `grpo.n_samples` [8] completions for each of its share from the current
  policy (`grpo.temperature` [1.0], `grpo.top_p`, `grpo.top_k`, at most `grpo.max_new_tokens`, stopping at
  EOS) with megatron-core's KV cache. The seed of step s on data-parallel rank d is derived from
  (train.seed, s, d) and the prompt order from (train.seed, s), so a run, and a resume, is reproducible.
- Reward: `grpo.reward(completion, reference)` [arithmetic] plus `grpo.format_bonus` [0] for a `#### N`
  answer; a reward function that raises scores 0 and is counted (`reward_errors`).
- Advantage, one per completion, shared by its tokens: A = (r - b) / (std + 1e-4) within the prompt's
  group, b the group mean [GRPO] or the mean of the other completions (`grpo.baseline=leave_one_out`,
  RLOO); `grpo.scale_rewards=false` drops the std division (Dr. GRPO). All-equal groups get A = 0 exactly.
- Loss per completion token: the PPO clipped surrogate max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A)
  [0.2, 0.28: DAPO's clip-higher] with r = pi / pi_old (log-ratio clamped to +-20), bounded by
  -dual_clip A for A < 0 [3.0], plus kl_coef [0.01] x KL(pi || pi_ref) as a loss term (estimator k3 [or
  k1]; pi_ref a frozen copy of the starting model, built only when kl_coef > 0). pi_old is the policy's
  own log-prob, recomputed forward-only after the rollout when the rollouts serve several updates
  (ppo_epochs x mini_batches > 1); with one update per step it is the policy's log-prob detached (r = 1 in
  value, the same numbers without the extra pass).
  Log-probs and entropy use the vocab-parallel logits / temperature, never gathering the vocabulary.
- Aggregation: the token mean over the whole global batch [token_mean, as DAPO and Dr. GRPO], or the mean
  over completions of each one's token mean (`seq_mean_token_mean`, the original GRPO paper).
- Update: `grpo.ppo_epochs` [1] passes over the rollouts, each split into `grpo.mini_batches` [1] optimizer
  steps; the learning-rate schedule advances once per GRPO step.

parse -> init -> build -> resume -> loop -> save -> cleanup. With no arguments it starts from the default
SFT's output `outputs/sft/hf`, running that SFT first (in this process group) when it is missing.
Resume: a checkpoint holds model, optimizer, LR schedule and step; prompt order and sampling seeds are pure
functions of (train.seed, step), so N steps + resume + N steps repeat 2N straight steps exactly.
"""

import dataclasses
import functools
import hashlib
import math
import os
import time
from pathlib import Path

import torch

from ckpt import checkpoint
from data import rewards, sft as sft_data
from model import build, generate, parallel
from trainer import common, config as config_module, grpo_math, precision
from trainer.common import log
from trainer.config import GRPOModelConfig, GRPOTrainerConfig
from trainer.errors import UserError


# ---------------------------------------------------------------- start-up checks


def validate_grpo(config, world_size: int) -> None:
    """GRPO's own start-up checks, before any model is built; each error names the key to change."""
    grpo, train = config.grpo, config.train
    if config.parallel.pp != 1 or config.parallel.vpp != 1:
        raise UserError("GRPO samples its rollouts with the policy itself, which needs the whole model on every rank: "
                        "set `parallel.pp=1` and `parallel.vpp=1` (tensor and data parallelism are fine).")
    if grpo.n_samples < 2:
        raise UserError(f"`grpo.n_samples` must be at least 2 (advantages compare completions of one prompt), got {grpo.n_samples}.")
    choices = {"grpo.baseline": (grpo.baseline, grpo_math.BASELINES),
               "grpo.kl_estimator": (grpo.kl_estimator, tuple(grpo_math.KL_ESTIMATORS)),
               "grpo.loss_aggregation": (grpo.loss_aggregation, grpo_math.LOSS_AGGREGATIONS)}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise UserError(f"`{key}={value}` is not one of {', '.join(allowed)}. Change `--{key}`.")
    rules = {  # key: (holds, what it must be)
        "clip_low": (0 < grpo.clip_low < 1, "between 0 and 1"), "clip_high": (grpo.clip_high > 0, "positive"),
        "dual_clip": (grpo.dual_clip == 0 or grpo.dual_clip > 1, "0 (off) or above 1"),
        "kl_coef": (grpo.kl_coef >= 0, "0 or more"), "temperature": (grpo.temperature > 0, "positive (rollouts are sampled)"),
        "top_p": (0 < grpo.top_p <= 1, "in (0, 1]"), "top_k": (grpo.top_k >= 0, "0 or more"),
        "ppo_epochs": (grpo.ppo_epochs >= 1, "at least 1"), "mini_batches": (grpo.mini_batches >= 1, "at least 1"),
        "max_new_tokens": (1 <= grpo.max_new_tokens < config.data.max_seq_len,
                           f"at least 1 and below `data.max_seq_len={config.data.max_seq_len}`"),
    }
    for name, (holds, rule) in rules.items():
        if not holds:
            raise UserError(f"`grpo.{name}` must be {rule}, got {getattr(grpo, name)}. Change `--grpo.{name}`.")
    data_parallel = max(world_size // (config.parallel.tp * config.parallel.pp), 1)
    if train.global_batch_size % grpo.n_samples or (train.global_batch_size // grpo.n_samples) % data_parallel:
        raise UserError(f"`train.global_batch_size={train.global_batch_size}` counts completions: it must be a multiple of "
                        f"`grpo.n_samples={grpo.n_samples}` whose number of prompts divides over the data-parallel size "
                        f"{data_parallel}. Change `--train.global_batch_size`.")
    if train.global_batch_size % (grpo.mini_batches * train.micro_batch_size * data_parallel):
        raise UserError(f"`train.global_batch_size={train.global_batch_size}` must be a multiple of `grpo.mini_batches="
                        f"{grpo.mini_batches}` x `train.micro_batch_size={train.micro_batch_size}` x data-parallel size "
                        f"{data_parallel}. Change one of them.")


def train_default_policy_if_missing(config) -> None:
    """The embedded default starts from the default SFT's output; when that is missing, the default SFT runs first, here."""
    default = GRPOModelConfig().path
    if config.model.path != default or (Path(default) / "config.json").is_file():
        return
    log.info("%s does not exist yet: running the default SFT first (as `torchrun -m trainer.sft` would)", default)
    from trainer import sft

    sft.main([])  # leaves the process group shut down; GRPO initialises its own below


# ---------------------------------------------------------------- prompts


@dataclasses.dataclass
class Prompt:
    """A tokenized prompt (chat template applied, generation header included) and the reference answer."""

    ids: list[int]
    reference: str


def load_prompts(config, tokenizer, path: str, split: str) -> list[Prompt]:
    """Prompts of one split; those leaving no room for `grpo.max_new_tokens` within `data.max_seq_len` are skipped and counted."""
    data = config.data
    rows = sft_data.load_rows(path, split=split, hub_config=data.hub_config or None)
    conversations, report = sft_data.to_conversations(
        rows, prompt_field=data.prompt_field, response_field=data.response_field, messages_field=data.messages_field or None)
    # The reference is the last assistant turn; the prompt is every turn before it.
    cuts = [max(index for index, message in enumerate(turns) if message["role"] == "assistant") for turns in conversations]
    texts = [tokenizer.apply_chat_template(turns[:cut], add_generation_prompt=True, tokenize=False)
             for turns, cut in zip(conversations, cuts)]
    limit = data.max_seq_len - config.grpo.max_new_tokens
    prompts = [Prompt(ids, turns[cut]["content"])
               for ids, turns, cut in zip(tokenizer(texts, add_special_tokens=False)["input_ids"], conversations, cuts)
               if len(ids) <= limit]
    skipped = len(conversations) - len(prompts)
    log.info("prompts %s (%s): %d used; %s; %d skipped as longer than %d tokens (data.max_seq_len - grpo.max_new_tokens)",
             path, split, len(prompts), report.summary(), skipped, limit)
    if not prompts:
        raise UserError(f"Every prompt of {path} ({split}) is longer than {limit} tokens, which leaves no room for "
                        f"`grpo.max_new_tokens={config.grpo.max_new_tokens}` within `data.max_seq_len={data.max_seq_len}`. "
                        "Raise `--data.max_seq_len` or lower `--grpo.max_new_tokens`.")
    return prompts


def load_eval_prompts(config, tokenizer, data_parallel_size: int) -> list[Prompt]:
    """Held-out prompts (the test split unless data.eval_path is set), trimmed to a multiple of the data-parallel size."""
    try:
        prompts = load_prompts(config, tokenizer, config.data.eval_path or config.data.path, "test")
    except UserError:
        if config.data.eval_path:
            raise
        log.info("no held-out split found for %s: evaluation is skipped (set data.eval_path)", config.data.path)
        return []
    return prompts[: min(config.train.eval_samples, len(prompts)) // data_parallel_size * data_parallel_size]


def step_prompt_indices(num_prompts: int, prompts_per_step: int, step: int, seed: int) -> list[int]:
    """Indices of step `step`'s prompts: a seeded shuffle per epoch, a pure function of the step (so resume is exact)."""
    orders, indices = {}, []
    for position in range((step - 1) * prompts_per_step, step * prompts_per_step):
        epoch, offset = divmod(position, num_prompts)
        if epoch not in orders:
            orders[epoch] = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        indices.append(orders[epoch][offset])
    return indices


def rollout_seed(seed: int, step: int, dp_rank: int) -> int:
    """Sampling seed of one step on one data-parallel rank (tensor-parallel ranks share it, as generation requires)."""
    digest = hashlib.sha256(f"rollout:{seed}:{step}:{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---------------------------------------------------------------- rollouts


@dataclasses.dataclass
class Rollouts:
    """One step's completions on this rank: groups of `grpo.n_samples` consecutive rows, with rewards and advantages."""

    examples: list[sft_data.Example]  # prompt + completion ids; the loss mask covers the completion
    advantages: torch.Tensor  # [completions]
    scores: rewards.Scores
    zero_advantage_groups: int
    seconds: float


def collect_rollouts(chunks, prompts, config, step, runtime, tokenizer, vocab_size, reward) -> Rollouts:
    """Sample this rank's completions of the step's prompts, score them and compute group advantages."""
    grpo = config.grpo
    prompts_per_rank = config.train.global_batch_size // grpo.n_samples // runtime.dp_size
    indices = step_prompt_indices(len(prompts), prompts_per_rank * runtime.dp_size, step, config.train.seed)
    mine = [prompts[index] for index in indices[runtime.dp_rank * prompts_per_rank : (runtime.dp_rank + 1) * prompts_per_rank]
            for _ in range(grpo.n_samples)]
    start = time.perf_counter()
    completions = generate.generate(
        chunks, [prompt.ids for prompt in mine], max_new_tokens=grpo.max_new_tokens, eos_id=tokenizer.eos_token_id,
        vocab_size=vocab_size, temperature=grpo.temperature, top_p=grpo.top_p, top_k=grpo.top_k,
        seed=rollout_seed(config.train.seed, step, runtime.dp_rank))
    seconds = time.perf_counter() - start
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    scores = rewards.score(reward, texts, [prompt.reference for prompt in mine], grpo.format_bonus)
    group_rewards = torch.tensor(scores.rewards, dtype=torch.float32).view(-1, grpo.n_samples)  # [prompts, samples]
    advantages, zero_groups = grpo_math.group_advantages(group_rewards, grpo.baseline, grpo.scale_rewards)
    examples = [sft_data.Example(prompt.ids + completion, [0] * len(prompt.ids) + [1] * len(completion))
                for prompt, completion in zip(mine, completions)]
    return Rollouts(examples, advantages.flatten(), scores, zero_groups, seconds)


def rollout_metrics(rollouts: Rollouts) -> dict:
    """Global (all data-parallel ranks) reward, accuracy and length figures of one step's rollouts."""
    from megatron.core import parallel_state

    completion_tokens = sum(sum(example.loss_mask) for example in rollouts.examples)
    totals = common.all_reduce_sum([
        sum(rollouts.scores.rewards), sum(rollouts.scores.correct), len(rollouts.examples), rollouts.scores.errors,
        rollouts.zero_advantage_groups, completion_tokens, sum(len(example.input_ids) for example in rollouts.examples),
    ], parallel_state.get_data_parallel_group())
    reward_sum, correct, count, errors, zero_groups, completion_tokens, all_tokens = totals
    return {"reward_mean": reward_sum / count, "accuracy": correct / count, "response_len": completion_tokens / count,
            "rollout_tokens_per_s": completion_tokens / rollouts.seconds, "reward_errors": int(errors),
            "zero_advantage_groups": int(zero_groups), "sequence_tokens": all_tokens}


# ---------------------------------------------------------------- log-probs and loss


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The loss's knobs, fixed at start-up (the KL estimator picked once, from its dict)."""

    temperature: float
    clip_low: float
    clip_high: float
    dual_clip: float
    kl_coef: float
    kl_estimator: object
    aggregation: str


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of `labels` under softmax(logits / temperature) from vocab-parallel logits, without gathering the vocabulary."""
    from megatron.core import tensor_parallel

    # logits: [batch, seq, vocab shard]; labels: [batch, seq]. Dividing makes a copy, which the
    # cross entropy then shifts in place, so the model's own output stays intact.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits / temperature, labels)  # [batch, seq]


@torch.no_grad()
def forward_logprobs(chunks, batch: dict, temperature: float) -> torch.Tensor:
    """Per-token log-probs of a collated batch's labels under a model, forward only."""
    logits = chunks[0](input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
    return token_logprobs(logits, batch["labels"], temperature)  # [batch, seq]


def policy_loss(batch: dict, settings: LossSettings, logits: torch.Tensor):
    """(loss sum, count, report) of one microbatch: clipped surrogate plus KL penalty; megatron-core divides by the global count."""
    from megatron.core import parallel_state

    mask = batch["loss_mask"]  # [batch, seq]
    with torch.no_grad():  # entropy is logged, not optimised
        entropy = grpo_math.vocab_parallel_entropy(logits.detach() / settings.temperature,
                                                   parallel_state.get_tensor_model_parallel_group())  # [batch, seq]
    logprobs = token_logprobs(logits, batch["labels"], settings.temperature)  # [batch, seq]
    # With one update per step pi_old is the policy itself: its own log-probs, detached (the same values a
    # separate forward-only pass gives, without the pass).
    old_logprobs = logprobs.detach() if batch["old_logprobs"] is None else batch["old_logprobs"]  # [batch, seq]
    per_token, clipped = grpo_math.clipped_policy_loss(logprobs, old_logprobs, batch["advantages"],
                                                       settings.clip_low, settings.clip_high, settings.dual_clip)
    kl = torch.zeros_like(logprobs) if batch["ref_logprobs"] is None else settings.kl_estimator(logprobs, batch["ref_logprobs"])
    loss_sum, count = grpo_math.masked_sum_and_count(per_token + settings.kl_coef * kl, mask, settings.aggregation)
    stats = torch.stack([(kl * mask).sum(), (entropy * mask).sum(), (clipped * mask).sum(), mask.sum()]).detach()
    return loss_sum, count.to(torch.int), {"loss": torch.stack([loss_sum.detach(), count.detach()]), "stats": stats}


def forward_step(settings: LossSettings, data_iterator, model):
    """One microbatch through the policy; the vocab-parallel logits [batch, seq, vocab shard] go to the loss."""
    batch = next(data_iterator)
    logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
    return logits, functools.partial(policy_loss, batch, settings)


# ---------------------------------------------------------------- update


def build_microbatches(rollouts: Rollouts, chunks, reference, config, pad_id: int, device) -> tuple[list[dict], int]:
    """This rank's rollouts as padded microbatches with advantages, old log-probs (policy) and reference log-probs."""
    micro, temperature = config.train.micro_batch_size, config.grpo.temperature
    recompute_old = config.grpo.ppo_epochs * config.grpo.mini_batches > 1
    longest = max(len(example.input_ids) - 1 for example in rollouts.examples)
    seq_len = min(config.data.max_seq_len, 8 * math.ceil(longest / 8))
    microbatches = []
    for start in range(0, len(rollouts.examples), micro):
        batch = sft_data.collate(rollouts.examples[start : start + micro], seq_len, pad_id)
        batch = common.to_device(batch, device)
        batch["advantages"] = rollouts.advantages[start : start + micro, None].to(device)  # [micro, 1]
        # pi_old only differs from the policy being optimised once an update has happened within the step.
        batch["old_logprobs"] = forward_logprobs(chunks, batch, temperature) if recompute_old else None  # [micro, seq]
        batch["ref_logprobs"] = None if reference is None else forward_logprobs(reference, batch, temperature)
        microbatches.append(batch)
    return microbatches, seq_len


def update_policy(chunks, optimizer, microbatches: list[dict], seq_len: int, config, settings: LossSettings) -> dict:
    """`grpo.ppo_epochs` passes over the microbatches, `grpo.mini_batches` optimizer steps each; global loss figures."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    per_update = len(microbatches) // config.grpo.mini_batches
    totals = torch.zeros(6, dtype=torch.float64)  # loss sum, loss count, kl, entropy, clipped, tokens
    for _ in range(config.grpo.ppo_epochs):
        for start in range(0, len(microbatches), per_update):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            outputs = get_forward_backward_func()(
                forward_step_func=functools.partial(forward_step, settings), data_iterator=iter(microbatches[start : start + per_update]),
                model=chunks, num_microbatches=per_update, seq_length=seq_len,
                micro_batch_size=config.train.micro_batch_size, forward_only=False)
            _, grad_norm, _ = optimizer.step()
            for output in outputs:
                totals += torch.cat([output["loss"], output["stats"]]).detach().to("cpu", torch.float64)
    loss_sum, count, kl, entropy, clipped, tokens = common.all_reduce_sum(totals.tolist(), parallel_state.get_data_parallel_group())
    return {"loss": loss_sum / max(count, 1), "grad_norm": float(grad_norm or 0.0),
            "kl": kl / max(tokens, 1) if settings.kl_coef > 0 else None,
            "entropy": entropy / max(tokens, 1), "clip_frac": clipped / max(tokens, 1)}


# ---------------------------------------------------------------- evaluation


def evaluate(chunks, eval_prompts, config, runtime, tokenizer, vocab_size, reward) -> dict:
    """Greedy held-out accuracy: the share of held-out prompts whose completion the reward function gives full marks."""
    if not eval_prompts:
        return {}
    from megatron.core import parallel_state

    # Every data-parallel rank scores an equal share (load_eval_prompts trimmed the set to a multiple of the DP size),
    # in batches no larger than its rollout batch, whose KV cache is known to fit.
    mine = eval_prompts[runtime.dp_rank :: runtime.dp_size]
    batch = max(config.train.global_batch_size // runtime.dp_size, 1)
    completions = []
    for start in range(0, len(mine), batch):
        completions += generate.generate(chunks, [prompt.ids for prompt in mine[start : start + batch]],
                                         max_new_tokens=config.grpo.max_new_tokens, eos_id=tokenizer.eos_token_id,
                                         vocab_size=vocab_size)
    scores = rewards.score(reward, tokenizer.batch_decode(completions, skip_special_tokens=True),
                           [prompt.reference for prompt in mine])
    correct, = common.all_reduce_sum([float(sum(scores.correct))], parallel_state.get_data_parallel_group())
    return {"eval_accuracy": correct / len(eval_prompts)}


# ---------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    """Parse -> init -> build -> resume -> loop -> save -> cleanup."""
    import transformers

    # ---- parse, and every check that needs no model
    config, resume = config_module.parse_args(GRPOTrainerConfig, argv, "trainer.grpo")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    common.setup_logging(int(os.environ.get("RANK", "0")) == 0)
    validate_grpo(config, world_size)
    reward = rewards.get_reward(config.grpo.reward)
    train_default_policy_if_missing(config)
    config_module.validate_startup(config, world_size)
    precision.validate(config)
    model_path = build.resolve_model_path(config.model.path)
    out_dir = Path(config.train.out_dir)
    checkpoint_dir, fingerprint, resume_path, resume_step = checkpoint.find_resume_point(config, resume, model_path)
    if resume_step >= config.train.steps:
        log.info("this run already finished all %d steps (checkpoint %s); nothing to do", config.train.steps, resume_path)
        return
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    data_parallel_size = world_size // config.parallel.tp
    train_prompts = load_prompts(config, tokenizer, config.data.path, "train")
    eval_prompts = load_eval_prompts(config, tokenizer, data_parallel_size)

    # ---- init
    runtime = parallel.init_distributed(config.parallel.tp, config.parallel.pp, None, config.train.seed)

    # ---- build
    optimizer_config = precision.optimizer_config(config)
    ddp_config = precision.ddp_config(config, optimizer_config, build.environment_ddp_defaults())
    bridge = build.auto_bridge(model_path)
    provider = build.configure_provider(
        bridge, dtype=config.model.dtype, tp=config.parallel.tp, pp=1, vpp=None, seq_length=config.data.max_seq_len,
        attention=config.model.attention,
        transformer_overrides={"calculate_per_token_loss": True, **precision.transformer_overrides(config)})
    chunks = build.build_chunks(provider, ddp_config)
    # The frozen reference of the KL penalty: the same starting checkpoint, never trained, only when it is used.
    reference = build.build_chunks(provider) if config.grpo.kl_coef > 0 else None
    for chunk in reference or []:
        chunk.requires_grad_(False).eval()
    optimizer, lr_schedule = common.build_optimizer_and_schedule(chunks, optimizer_config, config)
    build.attach_training_hooks(provider, chunks, optimizer)
    log.info("resolved optimizer and DDP settings:\n%s", precision.settings_table(optimizer_config, ddp_config))
    vocab_size = bridge.hf_pretrained.config.vocab_size
    grpo = config.grpo
    settings = LossSettings(grpo.temperature, grpo.clip_low, grpo.clip_high, grpo.dual_clip, grpo.kl_coef,
                            grpo_math.KL_ESTIMATORS[grpo.kl_estimator], grpo.loss_aggregation)

    # ---- resume
    start_step = 0
    if resume_path:
        state = checkpoint.load(resume_path, chunks, optimizer)
        lr_schedule.load_state_dict(state["lr_schedule"])
        start_step = state["step"]
        log.info("resumed from %s at step %d", resume_path, start_step)

    def save_checkpoint(step: int) -> None:
        state = {"step": step, "lr_schedule": lr_schedule.state_dict(), "config": config_module.to_dict(config),
                 "fingerprint": fingerprint}
        checkpoint.save(checkpoint_dir, step, chunks, optimizer, state, config.ckpt.keep_last, runtime.is_main)

    # ---- loop
    metrics = common.MetricsWriter(out_dir, runtime.is_main, config.train.steps, start_step, config.train.log_interval)
    evaluation = functools.partial(evaluate, chunks, eval_prompts, config, runtime, tokenizer, vocab_size, reward)
    if start_step == 0 and (baseline := evaluation()):
        # The starting policy's held-out accuracy: the figure the run is judged against.
        metrics.write({"step": 0, **baseline})
    preemption = checkpoint.Preemption()
    for step in range(start_step + 1, config.train.steps + 1):
        with common.StepTimer() as timer:
            rollouts = collect_rollouts(chunks, train_prompts, config, step, runtime, tokenizer, vocab_size, reward)
            microbatches, seq_len = build_microbatches(rollouts, chunks, reference, config, tokenizer.pad_token_id, runtime.device)
            update = update_policy(chunks, optimizer, microbatches, seq_len, config, settings)
            lr_schedule.step(increment=1)
        rollout = rollout_metrics(rollouts)
        row = {"step": step, "loss": update.pop("loss"), "lr": optimizer.param_groups[0]["lr"],
               "grad_norm": update.pop("grad_norm"), "tokens_per_s": rollout.pop("sequence_tokens") / timer.seconds,
               "step_time_s": timer.seconds, **rollout, **update}
        if config.train.eval_interval and step % config.train.eval_interval == 0 or step == config.train.steps:
            row.update(evaluation())
        metrics.write(row)
        if checkpoint.save_if_due(step, config, preemption, save_checkpoint):
            break
    metrics.close()

    # ---- save
    if step == config.train.steps:
        common.export_final_model(bridge, chunks, tokenizer, out_dir, runtime.is_main)
    parallel.shutdown()


if __name__ == "__main__":
    config_module.run_cli(main)
