"""A GRPO step's update: the loss's settings, per-token log-probs from vocab-parallel logits, the policy loss of a
microbatch, the KL reference, the step's microbatches and the optimizer steps over them (`trainer/grpo.py` states
the loss exactly).

The rollout/training gap: every sampled token carries the log-prob its sampler gave it (`model.generate.Completions`);
pi_old (the training forward with the sampling weights) is compared with it on every trained token:
`rollout_logprob_diff_mean` / `_max` (|log pi_old - log pi_sampler|) and `rollout_kl` (k3, samples from the sampler).
`grpo.rollout_correction=tis` weights each token's policy-gradient term by min(pi_old / pi_sampler, cap);
`token_reject` / `sequence_reject` leave tokens (completions) whose ratio lies outside [1 / cap, cap] out of the loss.
With stale rollouts (asynchronous GRPO) pi_old is the proximal policy and pi_sampler the behaviour policy: `tis` is
then AReaL's decoupled objective. Any correction logs the ratio's mean and maximum, a rejection the share it masks.
A Mixture-of-Experts policy's training forwards load the rollout's routes (`model.routing`): replayed with
`grpo.routing_replay`, compared with the router's own choice either way (`moe_route_mismatch`, counted in the forward
that has the sampling weights: pi_old's when it is recomputed, else the single update's). The KL reference replays
them too: its KL term is then the change of weights along the rollout's experts, 0 at the first step as it must be;
routing on its own it would also count the routes its rounding flips (measured: bf16 tiny-moe's first step had
kl = 8.8e-7 with identical weights, 0 with the reference replaying)."""

import dataclasses
import functools
from pathlib import Path

import torch

from config.errors import UserError
from data import batches
from model import build, collectives, moe, output, parallel, routing, shared_prefix
from trainer import grpo_math
from trainer.grpo_batches import collate_rows, microbatch_rows
from trainer.grpo_sampling import StepBatch
from trainer.metrics import log
from trainer.reward_model import RewardModel


# ---------------------------------------------------------------- log-probs and loss


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The loss's knobs, fixed at start-up (each named choice picked once, from its table in `trainer.grpo_math`)."""

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
    correction_cap: float | None  # grpo.rollout_correction: the weight's cap or the ratio's bound (None: off)
    routing_replay: bool
    share_prompts: bool = False  # each group one row of the model's input, its prompt once (`model.shared_prefix`)
    teacher_coef: float | None = None  # grpo.teacher's weight in each token's advantage (None: no teacher)
    correction: str = "none"  # grpo.rollout_correction

    @classmethod
    def from_config(cls, grpo, share_prompts: bool = False) -> "LossSettings":
        """The `grpo` section's loss settings, with the named functions looked up."""
        return cls(grpo.temperature, grpo.clip_low, grpo.clip_high, grpo.dual_clip, grpo.kl_coef,
                   grpo_math.KL_ESTIMATORS[grpo.kl_estimator], grpo_math.IMPORTANCE_RATIOS[grpo.importance_ratio],
                   grpo.entropy_coef, grpo_math.LOSS_AGGREGATIONS[grpo.loss_aggregation], grpo.max_new_tokens,
                   grpo.rollout_correction_cap if grpo.correction() != "none" else None, grpo.routing_replay,
                   share_prompts, grpo.teacher_coef if grpo.teacher else None, grpo.correction())

    @classmethod
    def for_run(cls, config, policy, teacher=None) -> "LossSettings":
        """`from_config`, prompts shared where this run's models and layout allow it (a start-up line says why not
        where `grpo.share_prompts` asked for it)."""
        reason = shared_prefix.reason_not_shared(config, policy.provider) or (
            teacher and shared_prefix.reason_not_shared(config, teacher.model.provider))
        if reason and config.grpo.share_prompts:
            log.info(f"each completion is its own row in the training forwards (grpo.share_prompts is off): {reason}")
        return cls.from_config(config.grpo, share_prompts=reason is None)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of `labels` under softmax(logits / temperature) from vocab-parallel logits, without gathering the vocabulary."""
    from megatron.core import tensor_parallel

    # logits: [batch, seq, vocab shard]; labels: [batch, seq]. Dividing makes a copy, which the
    # cross entropy then shifts in place, so the model's own output stays intact.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits / temperature, labels)  # [batch, seq]


@torch.no_grad()
def forward_logprobs(chunks, batch: dict, temperature: float) -> torch.Tensor | None:
    """Per-token log-probs [batch, seq] of a collated batch's labels under a model, forward only and in eval mode:
    pi_old and pi_ref are the policy that sampled (dropout off, as in generation), not a random dropout draw of it.
    Through megatron-core's pipeline schedule, so with pipeline stages they exist on the last stage only (None on the
    others), where the loss that reads them runs."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def logprobs_step(data_iterator, model):
        microbatch = next(data_iterator)
        read = microbatch["read"]
        logits = read_logits(model, microbatch)  # [1, read, vocab shard]
        return logits, lambda logits, non_loss_data=True: read.scatter(
            token_logprobs(logits, read.pick(microbatch["labels"]), temperature))

    with build.eval_mode(chunks[0]):
        outputs = get_forward_backward_func()(
            forward_step_func=logprobs_step, data_iterator=iter([batch]), model=chunks, num_microbatches=1,
            seq_length=batch["tokens"].size(1), micro_batch_size=batch["tokens"].size(0), forward_only=True,
            collect_non_loss_data=True)
    return outputs[0] if outputs else None


def read_logits(model, batch: dict, **kwargs) -> torch.Tensor:
    """The vocab-parallel logits [1, read positions, vocab shard] of a collated micro-batch at `batch["read"]`
    (`model.output`); with its prompts shared (`data.batches.collate_shared`), each token rotated by its position id."""
    with shared_prefix.rotary_positions(model, batch["position_ids"] if "hidden_index" in batch else None):
        return model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
                     output_processor=output.project_positions, output_processor_context=batch["read"], **kwargs)


def policy_loss(batch: dict, settings: LossSettings, logits: torch.Tensor):
    """(loss sum, count, report) of one microbatch: clipped surrogate, KL penalty and entropy bonus; megatron-core
    divides by the global count."""
    from megatron.core import parallel_state

    # logits: [1, read positions, vocab shard], the positions `batch["read"]` names (every trained token); the terms
    # below are laid out as [batch, seq] again, zero where nothing is read (and the mask is 0).
    mask, read = batch["loss_mask"], batch["read"]  # [batch, seq]
    group = parallel_state.get_tensor_model_parallel_group()
    # A few rows at a time, in the backward too (the entropy bonus): no full-vocabulary temporaries beyond a chunk.
    if settings.entropy_coef > 0:
        entropy = read.scatter(grpo_math.chunked_entropy(logits, settings.temperature, group))  # [batch, seq]
    else:
        with torch.no_grad():  # logged, not optimised
            entropy = read.scatter(grpo_math.chunked_entropy(logits, settings.temperature, group))  # [batch, seq]
    logprobs = read.scatter(token_logprobs(logits, read.pick(batch["labels"]), settings.temperature))  # [batch, seq]
    # With one update per step pi_old is the policy itself: its own log-probs, detached (the same values a
    # separate forward-only pass gives, without the pass).
    old_logprobs = batch["old_logprobs"] if batch["pi_old_recomputed"] else logprobs.detach()  # [batch, seq]
    # The rollout/training gap on the trained tokens: log pi_old - log pi_sampler.
    gap = torch.where(mask > 0, old_logprobs - batch["sampler_logprobs"], 0.0)  # [batch, seq]
    trained = mask  # the tokens the loss averages over
    if settings.correction not in ("none", "tis"):  # rejection: tokens or completions out of bounds leave the loss
        trained = mask * grpo_math.rejection_keep(gap, mask, settings.correction_cap, settings.correction)
    # GSPO's sequence ratio over the trained tokens only, as verl's gspo loss reads the mask its rollout_rs left.
    log_ratio = settings.importance_ratio(logprobs, old_logprobs, trained)  # [batch, seq]
    teacher = batch.get("teacher_logprobs")
    advantages = distilled_advantages(batch["advantages"], mask, teacher, old_logprobs, settings)
    per_token, clipped = grpo_math.clipped_policy_loss(log_ratio, advantages, settings.clip_low,
                                                       settings.clip_high, settings.dual_clip)
    if settings.correction == "tis":  # truncated importance sampling: pi_old / pi_sampler, at most the cap
        per_token = per_token * grpo_math.truncated_importance_weights(gap, settings.correction_cap)
    kl = torch.zeros_like(logprobs) if batch["ref_logprobs"] is None else settings.kl_estimator(logprobs, batch["ref_logprobs"])
    per_token = per_token + settings.kl_coef * kl
    if settings.entropy_coef > 0:
        per_token = per_token - settings.entropy_coef * entropy
    loss_sum, count = settings.aggregation(per_token, trained, settings.budget)
    # KL(sampler || pi_old) from the sampler's samples, in fp64: a gap of 1e-7 has a k3 of 1e-14, which fp32 rounds to 0.
    rollout_kl = grpo_math.kl_k3(batch["sampler_logprobs"].double(), old_logprobs.double())
    # With a teacher: the reverse KL log pi_old - log pi_teacher and the teacher's log-prob, over the trained tokens.
    teacher_sums = ([torch.zeros((), device=mask.device)] * 2 if teacher is None
                    else [((old_logprobs - teacher) * mask).sum(), (teacher * mask).sum()])
    ratio = torch.where(mask > 0, gap.detach().clamp(max=grpo_math.LOG_RATIO_CLAMP).exp(), 0.0)  # pi_old / pi_sampler
    stats = torch.stack([(kl * mask).sum(), (entropy * mask).sum(), (clipped * mask).sum(), mask.sum(),
                         gap.abs().sum(), (rollout_kl * mask).sum().float(), *teacher_sums, ratio.sum(),
                         (mask - trained).sum()]).detach()
    return loss_sum, count.to(torch.int), {"loss": torch.stack([loss_sum.detach(), count.detach()]), "stats": stats,
                                           "gap_max": gap.abs().max().detach(), "ratio_max": ratio.max().detach()}


def forward_step(settings: LossSettings, routes, data_iterator, model):
    """One microbatch through the policy (a Mixture-of-Experts policy's rollout routes loaded first); the
    vocab-parallel logits [1, read positions, vocab shard] of its trained tokens (`model.output`) go to the loss."""
    batch = next(data_iterator)
    if "routes" in batch:  # compared here only when this forward has the sampling weights (no separate pi_old pass)
        routes.load(batch["routes"], batch["routed"], settings.routing_replay, compare=not batch["pi_old_recomputed"])
    logits = read_logits(model, batch, padding_mask=moe.routing_padding_mask(batch, model))
    return logits, functools.partial(policy_loss, batch, settings)


# ---------------------------------------------------------------- update


class KLReference:
    """pi_ref of the KL penalty, the starting model: a frozen copy of it, or with LoRA the policy with its adapters
    switched off (which is the starting model exactly, so no copy is built)."""

    def __init__(self, policy):
        self.policy = policy
        self.copy = policy.frozen_copy() if policy.lora is None else None
        # A Mixture-of-Experts copy's own routers, to replay the rollout's routes (with LoRA: the policy's).
        self.routes = routing.Routes(self.copy) if self.copy is not None else policy.routes
        log.info("KL reference: %s", "a frozen copy of the starting model" if self.copy is not None
                 else "the policy with its LoRA adapters switched off (no copy built)")

    def logprobs(self, batch: dict, temperature: float, replay: bool) -> torch.Tensor:
        """Per-token log-probs of a collated batch's labels under pi_ref, forward only; a Mixture-of-Experts model
        replays the rollout's routes when `replay` (not counted in `moe_route_mismatch`)."""
        if "routes" in batch:
            self.routes.load(batch["routes"], batch["routed"], replay, compare=False)
        try:
            if self.copy is not None:
                return forward_logprobs(self.copy, batch, temperature)
            with self.policy.adapters_disabled():
                return forward_logprobs(self.policy.chunks, batch, temperature)
        finally:
            if self.routes:
                self.routes.clear()


def check_teacher_tokenizer(config, tokenizer) -> None:
    """Refuse, before any model is built, a `grpo.teacher` whose tokenizer is not the policy's (`tokenizer`)."""
    path = config.grpo.teacher
    if path and build.load_tokenizer(Path(path), "grpo.teacher").get_vocab() != tokenizer.get_vocab():
        raise UserError(f"`grpo.teacher={path}` has another tokenizer than the policy (`model.path`): its log-probs "
                        "would score other tokens than the ones sampled. Distil from a teacher that shares the "
                        "policy's tokenizer (the same family), or leave `--grpo.teacher` empty.")


class Teacher:
    """On-policy distillation's teacher (`grpo.teacher`): a frozen dense model with the policy's tokenizer, built at the
    policy's parallel layout (any size), forward only. Its log-prob of each sampled token enters that token's advantage
    as `grpo.teacher_coef` x (log pi_teacher - log pi_old) (`distilled_advantages`): the per-token reverse KL of the
    policy to the teacher, negated, on the sampler's samples. At one update per step its policy gradient is the
    gradient of that reverse KL (each token credited with its own term, as the Thinking Machines recipe), so it is not
    also offered as a loss term. A Mixture-of-Experts policy's routes are not replayed into it (another model)."""

    def __init__(self, config, policy):
        path = Path(config.grpo.teacher)
        build.check_weight_files(path)
        self.model = build.build_frozen_dense(config, path, policy.tokenizer, "grpo.teacher")
        log.info("teacher: %s (%d layers, hidden %d), at the policy's parallel layout", path,
                 self.model.hf_config.get("num_hidden_layers", 0), self.model.hf_config.get("hidden_size", 0))

    def logprobs(self, batch: dict, temperature: float) -> torch.Tensor | None:
        """Per-token log-probs [batch, seq] of a collated batch's labels under the teacher (None off the last stage)."""
        return forward_logprobs(self.model.chunks, batch, temperature)


@dataclasses.dataclass
class FrozenModels:
    """The frozen models that score a step's samples: the KL reference (with `grpo.kl_coef` > 0), the distillation
    teacher (with `grpo.teacher`) and the reward model (with `grpo.reward_model`, `trainer.reward_model`)."""

    reference: KLReference | None
    teacher: Teacher | None
    reward_model: RewardModel | None = None

    @classmethod
    def for_run(cls, config, policy) -> "FrozenModels":
        return cls(KLReference(policy) if config.grpo.kl_coef > 0 else None,
                   Teacher(config, policy) if config.grpo.teacher else None,
                   RewardModel(config, policy) if config.grpo.reward_model else None)


def distilled_advantages(advantages: torch.Tensor, mask: torch.Tensor, teacher_logprobs: torch.Tensor | None,
                         old_logprobs: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """The group advantages [micro, 1] (of rewards `grpo.reward_weight` weighs); with a teacher's log-probs, them plus
    `grpo.teacher_coef` x (log pi_teacher - log pi_old) on each trained token: [micro, seq] (`Teacher`). pi_old, the
    policy before the step's update, not the sampler: the reverse KL of the policy being trained. They differ by the
    rollout/training gap when synchronous; with stale rollouts (`grpo.max_staleness`) by the updates since, and the
    sampler's term measured the distance of a policy already left (0 at steps sampled by the teacher's own weights)."""
    if teacher_logprobs is None:
        return advantages
    return advantages + settings.teacher_coef * (teacher_logprobs - old_logprobs) * mask


def recomputes_pi_old(config) -> bool:
    """Whether pi_old needs its own forward-only pass (eval mode: no dropout, as the rollouts were sampled): when an
    update has happened within the step (several updates a step), or when the training forward draws dropout (LoRA's
    `peft.dropout`), which would make the detached log-probs a dropout draw and `rollout_logprob_diff_*`, TIS and the
    rejection masks measure that draw (0.30-0.39 max at dropout 0.3 on the tiny model, against 4e-6 without)."""
    return config.grpo.ppo_epochs * config.grpo.mini_batches > 1 or (config.peft.method == "lora" and config.peft.dropout > 0)


def build_microbatches(step_batch: StepBatch, policy, frozen: FrozenModels, config, settings: LossSettings, device,
                       timer) -> tuple[list[dict], int]:
    """This rank's step batch as microbatches (each padded to its own longest row, or with pipeline stages to the step's),
    with advantages (with a teacher, per token), old log-probs (policy), reference and teacher log-probs, their forwards
    timed as the step's `pi_old`, `reference` and `teacher` phases (`timer`, a `trainer.metrics.StepTimer`); and the
    step's padded length (the pipeline schedule's)."""
    temperature = config.grpo.temperature
    recompute_old = recomputes_pi_old(config)
    pad = batches.padded_length_for(config)
    step_len = pad(step_batch.examples)
    microbatches = []
    for rows in microbatch_rows(step_batch, config, settings.share_prompts):
        # Each micro-batch padded to its own longest row; pipeline stages exchange one shape, so there the step's.
        seq_len = step_len if parallel.fixed_microbatch_shape() else pad([step_batch.examples[row] for row in rows])
        batch = batches.to_device(collate_rows(step_batch, rows, seq_len, config, settings.share_prompts,
                                               policy.tokenizer.pad_token_id), device)
        # The only positions projected onto the vocabulary.
        batch["read"] = output.ReadPositions.where(batch["loss_mask"], batch.get("hidden_index"), batch["tokens"].size(1))
        advantages = step_batch.advantages[rows, None].to(device)  # [micro, 1]
        # pi_old only differs from the policy being optimised once an update has happened within the step, or by dropout.
        if recompute_old and "routes" in batch:
            policy.routes.load(batch["routes"], batch["routed"], config.grpo.routing_replay, compare=True)
        batch["pi_old_recomputed"] = recompute_old
        with timer.phase("pi_old"):
            batch["old_logprobs"] = forward_logprobs(policy.chunks, batch, temperature) if recompute_old else None  # [micro, seq]
        with timer.phase("reference"):
            batch["ref_logprobs"] = (None if frozen.reference is None
                                     else frozen.reference.logprobs(batch, temperature, config.grpo.routing_replay))
        if frozen.teacher is not None:
            with timer.phase("teacher"):
                batch["teacher_logprobs"] = frozen.teacher.logprobs(batch, temperature)  # [micro, seq]; None: not last stage
        batch["advantages"] = advantages  # a teacher's term is added per token in the loss (`distilled_advantages`)
        microbatches.append(batch)
    return microbatches, step_len


def update_policy(policy, microbatches: list[dict], seq_len: int, config, settings: LossSettings, timer) -> dict:
    """The step's update, timed as its `update` phase (`timer`, a `trainer.metrics.StepTimer`): the optimizer steps
    (`optimizer_steps`), then the learning-rate schedule's one step per GRPO step; the update's figures, with the rate
    its optimizer steps used (`lr`)."""
    with timer.phase("update"):
        update = optimizer_steps(policy, microbatches, seq_len, config, settings)
    # A step whose every update was skipped (fp16 overflows) leaves the schedule where it is.
    return {**update, "lr": policy.next_lr(applied=update["grad_norm"] is not None)}


def optimizer_steps(policy, microbatches: list[dict], seq_len: int, config, settings: LossSettings) -> dict:
    """`grpo.ppo_epochs` passes over the microbatches, `grpo.mini_batches` optimizer steps each; global loss figures, and
    a Mixture-of-Experts policy's routing figures over all of them (`model.moe.RoutingFigures`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    per_update = len(microbatches) // config.grpo.mini_batches
    # loss sum, loss count, kl, entropy, clipped, tokens, |gap|, rollout k3, teacher reverse KL, teacher log-prob,
    # pi_old / pi_sampler, tokens rejected
    totals = torch.zeros(12, dtype=torch.float64)
    grad_norms, gap_max, ratio_max = [], 0.0, 0.0
    policy.routing_figures.start_step()
    for _ in range(config.grpo.ppo_epochs):
        for start in range(0, len(microbatches), per_update):
            for chunk in policy.chunks:
                chunk.zero_grad_buffer()
            policy.optimizer.zero_grad()
            update = microbatches[start : start + per_update]
            # Each micro-batch's share of this update's loss denominator, rollout corrections aside.
            moe.weigh_router_losses(policy.chunks, update, lambda batch: settings.aggregation(
                batch["loss_mask"], batch["loss_mask"], settings.budget)[1])
            outputs = get_forward_backward_func()(
                forward_step_func=functools.partial(forward_step, settings, policy.routes),
                data_iterator=iter(update),
                model=policy.chunks, num_microbatches=per_update, seq_length=seq_len,
                micro_batch_size=microbatches[start]["tokens"].size(0), forward_only=False)
            grad_norms.append(policy.optimizer_step())  # None: skipped (fp16 overflow)
            for reported in outputs:  # one per micro-batch (`policy_loss`'s report)
                totals += torch.cat([reported["loss"], reported["stats"]]).detach().to("cpu", torch.float64)
                gap_max = max(gap_max, float(reported["gap_max"]))
                ratio_max = max(ratio_max, float(reported["ratio_max"]))
    loss_sum, count, kl, entropy, clipped, tokens, gap, rollout_kl, reverse_kl, teacher_logprob, ratio, rejected = (
        collectives.last_stage_sum(totals.tolist()))
    padded, positions = collectives.data_parallel_sum(batches.padding_counts(microbatches))
    # The step's several updates each have their gradient norm: the mean over those applied is logged, and the largest
    # beside it (None when every update was skipped).
    applied = [norm for norm in grad_norms if norm is not None]
    # Means over the trained tokens; a step with none (every completion cut at the budget under grpo.mask_truncated)
    # has none of them: None, not an entropy and a KL of 0 (`grpo_metrics.say_nothing_trained`).
    per_token = (lambda total: total / tokens) if tokens else (lambda total: None)
    gap_max = collectives.all_reduce_float(gap_max, torch.distributed.ReduceOp.MAX)
    return {"loss": loss_sum / max(count, 1), "grad_norm": sum(applied) / len(applied) if applied else None,
            **({"grad_norm_max": max(applied, default=None)} if len(grad_norms) > 1 else {}),
            **policy.loss_scale_figures(grad_norms.count(None)),
            "kl": per_token(kl) if settings.kl_coef > 0 else None,
            "entropy": per_token(entropy), "clip_frac": per_token(clipped),
            "rollout_logprob_diff_mean": per_token(gap), "rollout_logprob_diff_max": gap_max if tokens else None,
            "rollout_kl": per_token(rollout_kl), "padding_share": padded / max(positions, 1),
            **({"teacher_reverse_kl": per_token(reverse_kl), "teacher_logprob": per_token(teacher_logprob)}
               if settings.teacher_coef is not None else {}),
            **correction_figures(settings, ratio, rejected, tokens, ratio_max),
            **route_mismatch(policy.routes),
            **policy.routing_figures.step_figures()}


def correction_figures(settings: LossSettings, ratio: float, rejected: float, tokens: float, ratio_max: float) -> dict:
    """With `grpo.rollout_correction`: the ratio pi_old / pi_sampler's mean and maximum over the trained tokens
    (`rollout_is_ratio_mean` / `_max`), and a rejection's share of them masked (`rollout_rejected_share`). Collective."""
    if settings.correction == "none":
        return {}
    ratio_max = collectives.all_reduce_float(ratio_max, torch.distributed.ReduceOp.MAX)
    figures = {"rollout_is_ratio_mean": ratio / tokens if tokens else None, "rollout_is_ratio_max": ratio_max if tokens else None}
    if settings.correction != "tis":
        figures["rollout_rejected_share"] = rejected / tokens if tokens else None
    return figures


def route_mismatch(routes) -> dict:
    """A Mixture-of-Experts policy's `moe_route_mismatch` over every rank: the share of the compared (token, layer)
    decisions whose top-k set differed from the rollout's (none for a dense policy). Clears the loaded routes.
    Collective for a Mixture-of-Experts model on every rank, a pipeline stage without routers included."""
    if not routes.model_has_experts:
        return {}
    routes.clear()
    differ, compared = collectives.all_reduce_sum(list(routes.take_mismatch()))
    return {"moe_route_mismatch": differ / max(compared, 1)}

