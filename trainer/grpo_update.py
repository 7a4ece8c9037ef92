"""A GRPO step's update: the loss's settings, per-token log-probs from vocab-parallel logits, the policy loss of a
microbatch, the KL reference, the step's microbatches and the optimizer steps over them (`trainer/grpo.py` states
the loss exactly)."""

import dataclasses
import functools

import torch

from data import batches
from model import build, parallel
from trainer import grpo_math
from trainer.grpo_sampling import StepBatch
from trainer.metrics import log


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


def build_microbatches(step_batch: StepBatch, policy, reference, config, device) -> tuple[list[dict], int]:
    """This rank's step batch as padded microbatches with advantages, old log-probs (policy) and reference log-probs."""
    micro_batch_size, temperature = config.train.micro_batch_size, config.grpo.temperature
    recompute_old = config.grpo.ppo_epochs * config.grpo.mini_batches > 1
    seq_len = batches.padded_length(step_batch.examples, config.data.max_seq_len, config.parallel.sequence_multiple)
    microbatches = []
    for start in range(0, len(step_batch.examples), micro_batch_size):
        rows = step_batch.examples[start : start + micro_batch_size]
        batch = batches.collate(rows, seq_len, policy.tokenizer.pad_token_id)
        batch = batches.to_device(batch, device)
        batch["advantages"] = step_batch.advantages[start : start + micro_batch_size, None].to(device)  # [micro, 1]
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

