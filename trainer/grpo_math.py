"""GRPO math as small pure functions: group advantages, reward shaping, importance ratios, the clipped surrogate,
KL estimators, aggregation, entropy. Each named choice is one table below (name -> function), over the names
`config.sections` lists once (and validates at start-up).

Shapes: `groups` prompts x `samples` completions for rewards; `[batch, seq]` per-token tensors, where a
batch row is one completion and `mask` is 1 on the completion's tokens (those the policy sampled).
"""

import math

import torch
import torch.distributed as dist

from config import sections

# exp() of a log-ratio beyond this overflows the surrogate long before clipping can help.
LOG_RATIO_CLAMP = 20.0
# Added to a group's reward std so a nearly uniform group does not blow advantages up.
ADVANTAGE_EPS = 1e-4


def mean_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """The group's mean reward (GRPO)."""
    # rewards: [groups, samples]
    return rewards.sum(dim=1, keepdim=True) / rewards.size(1)  # [groups, 1]


def leave_one_out_baseline(rewards: torch.Tensor) -> torch.Tensor:
    """Each completion's baseline is the mean of the *other* completions of its prompt (RLOO)."""
    # rewards: [groups, samples]
    total = rewards.sum(dim=1, keepdim=True)  # [groups, 1]
    return (total - rewards) / (rewards.size(1) - 1)  # [groups, samples]


BASELINES = dict(zip(sections.BASELINES, (mean_baseline, leave_one_out_baseline), strict=True))


def group_advantages(rewards: torch.Tensor, baseline: str = "mean", scale_rewards: bool = True,
                     eps: float = ADVANTAGE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion advantages `(r - baseline) / (std + eps)` within each prompt's group (fp32), and which groups are
    all-equal. Computed in fp64: in fp32 a group's mean of rewards near 1e6 rounds to the loser's reward (advantages
    [1.73, 0, 0, 0] for [1e6 + 0.1, 1e6, 1e6, 1e6], not [1.5, -0.5, -0.5, -0.5]), and two rewards near fp32's largest
    overflow its sum to inf (NaN advantages)."""
    # rewards: [groups, samples]
    rewards = rewards.double()
    advantages = rewards - BASELINES[baseline](rewards)  # [groups, samples]
    if scale_rewards:
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + eps)  # sample std (n - 1), as TRL
    # A group whose completions all scored alike carries no signal; force exact zeros (no rounding residue). Alike in
    # fp32: rewards apart by fp64's rounding alone (0.1 + 0.2 against 0.3) are alike, as they were in fp32 before.
    rounded = rewards.float()
    equal = rounded.amax(dim=1) == rounded.amin(dim=1)  # [groups]
    advantages = advantages.masked_fill(equal.unsqueeze(1), 0.0)
    return advantages.float(), equal


def overlong_penalty(lengths: torch.Tensor, budget: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to `budget - buffer` tokens, then falling linearly to `-penalty` at the budget.

    (DAPO, arXiv 2503.14476, eq. 13; TRL's `get_soft_overlong_punishment`, verl's `overlong_buffer`.)
    """
    # lengths: [completions] in tokens, at most `budget`
    excess = (lengths.to(torch.float32) - (budget - buffer)).clamp(min=0)  # tokens into the buffer
    return -penalty * excess / buffer  # [completions]


# The KL penalty's estimators, on tokens sampled from the policy. As a loss term what counts is the expected gradient:
# k1's is 0 (E_pi[grad log pi] = 0: it penalises nothing on average, it only adds noise), k2's is that of
# KL(pi || pi_ref), k3's that of KL(pi_ref || pi) (both pull the policy toward the reference; verl's `low_var_kl` and
# TRL's `beta` are k3). k1 and k3 are unbiased estimates of the value KL(pi || pi_ref); k2 is not.
# k3 is not capped per token, as TRL's is not: verl's low_var_kl clamps it to 10, which takes the pull back from a
# token the policy now finds over 12 times less likely than the reference (zero gradient past the cap); measured on
# GRPO scored by a reward model (kl_coef 0.1, seed 1234), held-out 0.55 uncapped and 0.45 capped. The clipped gradient
# norm (optim.clip_grad) bounds what one such token does to a step.


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(policy || reference): log pi - log pi_ref (unbiased, can be negative; zero gradient
    on average as a loss)."""
    # logprobs, ref_logprobs: [batch, seq]
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 term: (log pi - log pi_ref)^2 / 2 (>= 0, a biased estimate of KL(policy || reference), whose
    gradient in expectation is exactly KL(policy || reference)'s), the log ratio clamped to +-20."""
    # logprobs, ref_logprobs: [batch, seq]
    return (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).square() / 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(d) - d - 1 with d = log pi_ref - log pi (unbiased, >= 0)."""
    # logprobs, ref_logprobs: [batch, seq]
    difference = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return difference.exp() - difference - 1


def truncated_importance_weights(log_ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS) of the rollout/training gap: min(pi_old / pi_sampler, cap) per token, from
    log_ratio = log pi_old - log pi_sampler (0 on untrained tokens: weight 1). A constant of the loss (no gradient)."""
    # log_ratio: [batch, seq]
    return log_ratio.detach().clamp(max=LOG_RATIO_CLAMP).exp().clamp(max=cap)


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, level: str) -> torch.Tensor:
    """Rejection of the rollout/training gap (verl's rollout_rs): 1 where pi_old / pi_sampler lies in [1 / cap, cap]
    for the token (`token_reject`), or for its completion's geometric mean over the trained tokens
    (`sequence_reject`), else 0; from log_ratio = log pi_old - log pi_sampler (0 off the trained tokens)."""
    # log_ratio, mask: [batch, seq]
    bound = math.log(cap)
    if level == "token_reject":
        return (log_ratio.detach().abs() <= bound).to(mask.dtype)
    mean = (log_ratio.detach() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [batch]
    return (mean.abs() <= bound).to(mask.dtype)[:, None].expand_as(mask)


KL_ESTIMATORS = dict(zip(sections.KL_ESTIMATORS, (kl_k1, kl_k2, kl_k3), strict=True))


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token log importance ratio log pi - log pi_old (PPO, GRPO)."""
    # logprobs, old_logprobs, mask: [batch, seq]
    return logprobs - old_logprobs


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log ratio: every token of a completion carries the completion's length-normalised
    log ratio mean_t(log pi - log pi_old), with the gradient of its own log pi (GSPO, arXiv 2507.18071, eq. 7
    and its token form; verl's `gspo` loss). Averaged over a completion's tokens, the gradient is GSPO's."""
    # logprobs, old_logprobs, mask: [batch, seq]
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)  # [batch, 1]
    sequence = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / lengths  # [batch, 1]
    return logprobs - logprobs.detach() + sequence.detach()  # [batch, seq]: the value is the sequence's


IMPORTANCE_RATIOS = dict(zip(sections.IMPORTANCE_RATIOS, (token_log_ratio, sequence_log_ratio), strict=True))


def clipped_policy_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                        dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped-surrogate loss (ratio clipped to [1 - clip_low, 1 + clip_high]), and where clipping cut the gradient.

    `log_ratio` is log pi - log pi_old per token (or GSPO's per sequence, from `IMPORTANCE_RATIOS`). `dual_clip`
    > 1 also bounds the loss of negative-advantage tokens by `-dual_clip * A` (Ye et al. 2020); 0 turns it off.
    """
    # log_ratio: [batch, seq]; advantages: [batch, 1] or [batch, seq]
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # [batch, seq]
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


# Each aggregation gives (numerator, denominator) over one microbatch; both are summed over microbatches and
# data-parallel ranks before the one division, so the loss is over the whole global batch.


def token_mean(values: torch.Tensor, mask: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over every completion token of the batch (DAPO; verl `token-mean`, TRL `dapo`)."""
    # values, mask: [batch, seq]
    return (values * mask).sum(), mask.sum()


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over completions of each one's token mean, weighing short and long completions alike (the original
    GRPO, arXiv 2402.03300; verl `seq-mean-token-mean`, TRL `grpo`). Completions without loss tokens do not count."""
    # values, mask: [batch, seq]
    lengths = mask.sum(dim=1)  # [batch]
    has_tokens = lengths > 0
    per_sequence = (values * mask).sum(dim=1) / lengths.clamp(min=1)  # [batch]
    return per_sequence[has_tokens].sum(), has_tokens.sum().to(values.dtype)


def seq_mean_token_sum_norm(values: torch.Tensor, mask: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: each completion's token sum over a constant, the generation budget, then the mean over completions
    (arXiv 2503.20783; verl `seq-mean-token-sum-norm`, TRL `dr_grpo`): no length bias, whatever the lengths."""
    # values, mask: [batch, seq]
    return (values * mask).sum(), torch.tensor(float(values.size(0) * budget), dtype=values.dtype, device=values.device)


LOSS_AGGREGATIONS = dict(zip(sections.LOSS_AGGREGATIONS, (token_mean, seq_mean_token_mean, seq_mean_token_sum_norm),
                             strict=True))


# Elements of logits per piece of `chunked_entropy`: about 64 MiB of fp32 temporaries, a few hundred rows at a
# 152k-token vocabulary shard.
ENTROPY_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(rows: torch.Tensor):
    """Slices of `rows` ([positions, vocab shard]) of about ENTROPY_CHUNK_ELEMENTS elements each."""
    per_chunk = max(1, ENTROPY_CHUNK_ELEMENTS // rows.size(1))
    return [slice(start, start + per_chunk) for start in range(0, rows.size(0), per_chunk)]


class _ChunkedEntropy(torch.autograd.Function):
    """H(softmax(logits / T)) per position from vocab-parallel logits, a few rows at a time in the forward and again
    in the backward (recomputed from the logits, which it keeps by reference): no full-vocabulary temporary lives
    longer than a chunk, and the gradient is the only full-size tensor it makes.

    dH / d logit_k = -(1 / T) p_k (log p_k + H), with p and H over the whole vocabulary (its sums reduced over the
    tensor-parallel `group` in the forward; the backward needs no communication)."""

    @staticmethod
    def forward(ctx, logits, temperature, group):
        rows = logits.detach().reshape(-1, logits.size(-1))  # [positions, vocab shard], a view
        entropy = torch.empty(rows.size(0), dtype=torch.float32, device=logits.device)  # [positions]
        log_partition = torch.empty_like(entropy)  # [positions]: log sum exp(logits / T) over the whole vocabulary
        for piece in _row_chunks(rows):
            scaled = rows[piece].float() / temperature  # [chunk, vocab shard]
            maximum = scaled.amax(dim=-1, keepdim=True)  # [chunk, 1]
            if group is not None:
                dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
            shifted = scaled - maximum
            exponentials = shifted.exp()
            sums = torch.stack([exponentials.sum(dim=-1), (exponentials * shifted).sum(dim=-1)])  # [2, chunk]
            if group is not None:
                dist.all_reduce(sums, group=group)
            entropy[piece] = sums[0].log() - sums[1] / sums[0]
            log_partition[piece] = sums[0].log() + maximum.squeeze(-1)
        ctx.save_for_backward(logits, entropy, log_partition)
        ctx.temperature = temperature
        return entropy.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_entropy):
        logits, entropy, log_partition = ctx.saved_tensors
        rows = logits.detach().reshape(-1, logits.size(-1))
        scale = grad_entropy.reshape(-1).float() / ctx.temperature  # [positions]
        grad = torch.empty_like(rows)  # [positions, vocab shard]
        for piece in _row_chunks(rows):
            log_p = rows[piece].float() / ctx.temperature - log_partition[piece, None]  # [chunk, vocab shard]
            grad[piece] = -(log_p.exp() * (log_p + entropy[piece, None])) * scale[piece, None]
        return grad.view_as(logits), None, None


def chunked_entropy(logits: torch.Tensor, temperature: float, group=None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position, the vocabulary split over `group` (None: whole here), a few
    rows at a time (`_ChunkedEntropy`), differentiable
    (the entropy bonus) or, under no_grad, for logging. Every tensor-parallel rank holds the same rows, so they run
    the same pieces (two small all-reduces each)."""
    # logits: [..., vocab shard]
    return _ChunkedEntropy.apply(logits, temperature, group)  # [...]
