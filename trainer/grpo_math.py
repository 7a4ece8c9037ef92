"""GRPO math as small pure functions: group advantages, the clipped surrogate, KL estimators, aggregation, entropy.

Shapes: `groups` prompts x `samples` completions for rewards; `[batch, seq]` per-token tensors, where a
batch row is one completion and `mask` is 1 on the completion's tokens (those the policy sampled).
"""

import torch
import torch.distributed as dist

from config.sections import LOSS_AGGREGATIONS  # noqa: F401  (the names, listed once, with their checks)

# exp() of a log-ratio beyond this overflows the surrogate long before clipping can help.
LOG_RATIO_CLAMP = 20.0
# Added to a group's reward std so a nearly uniform group does not blow advantages up.
ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, baseline: str = "mean", scale_rewards: bool = True,
                     eps: float = ADVANTAGE_EPS) -> tuple[torch.Tensor, int]:
    """Per-completion advantages `(r - baseline) / (std + eps)` within each prompt's group, and the count of all-equal groups."""
    # rewards: [groups, samples]
    samples = rewards.size(1)
    total = rewards.sum(dim=1, keepdim=True)  # [groups, 1]
    if baseline == "mean":
        advantages = rewards - total / samples  # [groups, samples]
    elif baseline == "leave_one_out":
        # Each completion is compared with the mean of the *other* completions of its prompt.
        advantages = rewards - (total - rewards) / (samples - 1)  # [groups, samples]
    else:
        raise ValueError(f"unknown baseline {baseline!r}")
    if scale_rewards:
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + eps)  # sample std (n - 1), as TRL
    # A group whose completions all scored alike carries no signal; force exact zeros (no rounding residue).
    equal = rewards.amax(dim=1) == rewards.amin(dim=1)  # [groups]
    advantages = advantages.masked_fill(equal.unsqueeze(1), 0.0)
    return advantages, int(equal.sum())


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(policy || reference): log pi - log pi_ref (unbiased, can be negative)."""
    # logprobs, ref_logprobs: [batch, seq]
    return logprobs - ref_logprobs


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = log pi_ref - log pi (unbiased, >= 0)."""
    # logprobs, ref_logprobs: [batch, seq]
    difference = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return difference.exp() - difference - 1


KL_ESTIMATORS = {"k1": kl_k1, "k3": kl_k3}


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        clip_low: float, clip_high: float, dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped-surrogate loss (ratio clipped to [1 - clip_low, 1 + clip_high]), and where clipping cut the gradient.

    `dual_clip` > 1 also bounds the loss of negative-advantage tokens by `-dual_clip * A` (Ye et al. 2020);
    0 turns it off.
    """
    # logprobs, old_logprobs: [batch, seq]; advantages: [batch, 1] or [batch, seq]
    ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [batch, seq]
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # [batch, seq]
    was_clipped = clipped > unclipped
    if dual_clip > 0:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound.expand_as(loss), loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def masked_sum_and_count(values: torch.Tensor, mask: torch.Tensor, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) whose global ratio is the loss: token_mean or seq_mean_token_mean.

    Summed over microbatches and data-parallel ranks before the one division, so the mean is over the
    whole global batch: tokens (token_mean) or completions, each the mean over its own tokens
    (seq_mean_token_mean, which weighs short and long completions alike).
    """
    # values, mask: [batch, seq]
    masked = values * mask
    if aggregation == "token_mean":
        return masked.sum(), mask.sum()
    if aggregation == "seq_mean_token_mean":
        lengths = mask.sum(dim=1)  # [batch]
        has_tokens = lengths > 0
        per_sequence = masked.sum(dim=1) / lengths.clamp(min=1)  # [batch]
        return per_sequence[has_tokens].sum(), has_tokens.sum().to(values.dtype)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def vocab_parallel_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """Entropy of softmax(logits) per position when the vocabulary is split over `group` (None: whole vocabulary here)."""
    # logits: [..., vocab shard]
    maximum = logits.amax(dim=-1, keepdim=True)  # [..., 1]
    if group is not None:
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - maximum  # [..., vocab shard]
    exponentials = shifted.exp()
    # H = log Z - sum p * shifted, with Z = sum exp(shifted): two sums over the full vocabulary.
    sums = torch.stack([exponentials.sum(dim=-1), (exponentials * shifted).sum(dim=-1)])  # [2, ...]
    if group is not None:
        dist.all_reduce(sums, group=group)
    partition, weighted = sums[0], sums[1]
    return partition.log() - weighted / partition  # [...]
