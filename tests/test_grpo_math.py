"""GRPO math against hand-computed numbers: advantages, clipped surrogate, KL estimators, aggregation, entropy."""

import math

import pytest
import torch

from trainer import grpo_math


def close(actual, expected, tolerance=1e-5):
    """Elementwise closeness of a tensor to a nested list of numbers."""
    return torch.allclose(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=tolerance)


# ---------------------------------------------------------------- advantages


def test_group_advantages_mean_baseline_with_std():
    # Group [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3) = 0.57735 -> +-0.5 / (0.57735 + 1e-4).
    advantages, zero_groups = grpo_math.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    scale = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert close(advantages, [[scale, -scale, -scale, scale]])
    assert zero_groups == 0


def test_group_advantages_without_std_is_dr_grpo():
    # Group [3, 1, 2]: mean 2 -> [1, -1, 0], no division.
    advantages, _ = grpo_math.group_advantages(torch.tensor([[3.0, 1.0, 2.0]]), scale_rewards=False)
    assert close(advantages, [[1.0, -1.0, 0.0]])


def test_group_advantages_leave_one_out():
    # Group [3, 1, 2]: each minus the mean of the other two: 3 - 1.5, 1 - 2.5, 2 - 2 = [1.5, -1.5, 0].
    advantages, _ = grpo_math.group_advantages(torch.tensor([[3.0, 1.0, 2.0]]), baseline="leave_one_out", scale_rewards=False)
    assert close(advantages, [[1.5, -1.5, 0.0]])
    # With the std (1.0 for [3, 1, 2]): divided by 1 + 1e-4.
    scaled, _ = grpo_math.group_advantages(torch.tensor([[3.0, 1.0, 2.0]]), baseline="leave_one_out")
    assert close(scaled, [[1.5 / 1.0001, -1.5 / 1.0001, 0.0]])


def test_equal_reward_groups_give_exact_zeros_and_are_counted():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    for baseline in ("mean", "leave_one_out"):
        advantages, zero_groups = grpo_math.group_advantages(rewards, baseline=baseline)
        assert zero_groups == 2
        assert torch.equal(advantages[:2], torch.zeros(2, 3))
        assert advantages[2, 1] > 0 > advantages[2, 0]


# ---------------------------------------------------------------- clipped surrogate


def per_token_loss(ratio: float, advantage: float, dual_clip: float = 0.0, clip_low=0.2, clip_high=0.28):
    """Loss and clip flag of one token with the given probability ratio."""
    loss, clipped = grpo_math.clipped_policy_loss(torch.tensor([[math.log(ratio)]]), torch.zeros(1, 1),
                                                  torch.tensor([[advantage]]), clip_low, clip_high, dual_clip)
    return loss.item(), bool(clipped.item())


@pytest.mark.parametrize("ratio, advantage, expected_loss, expected_clipped", [
    (1.0, 2.0, -2.0, False),   # at the old policy: -r A
    (1.1, 2.0, -2.2, False),   # inside [0.8, 1.28]
    (1.5, 2.0, -2.56, True),   # A > 0, r above 1 + clip_high: -1.28 A, no gradient
    (0.5, 2.0, -1.0, False),   # A > 0, r below 1 - clip_low: the unclipped term is the larger loss
    (0.5, -2.0, 1.6, True),    # A < 0, r below 1 - clip_low: -0.8 A
    (1.5, -2.0, 3.0, False),   # A < 0, r above: -r A (no upper clip for negative advantages)
    (0.9, 0.0, 0.0, False),    # zero advantage: zero loss
])
def test_clipped_surrogate_asymmetric(ratio, advantage, expected_loss, expected_clipped):
    loss, clipped = per_token_loss(ratio, advantage)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    assert clipped == expected_clipped


def test_dual_clip_bounds_negative_advantage_loss():
    # A = -2, r = 5: plain PPO loss is -r A = 10; the dual clip bounds it at -3 A = 6.
    assert per_token_loss(5.0, -2.0) == pytest.approx((10.0, False), abs=1e-4)
    assert per_token_loss(5.0, -2.0, dual_clip=3.0) == pytest.approx((6.0, True), abs=1e-4)
    # Below the bound, and for positive advantages, the dual clip changes nothing.
    assert per_token_loss(2.0, -2.0, dual_clip=3.0) == pytest.approx((4.0, False), abs=1e-4)
    assert per_token_loss(5.0, 2.0, dual_clip=3.0) == pytest.approx((-2.56, True), abs=1e-4)


def test_clipped_tokens_get_no_gradient_and_log_ratio_is_clamped():
    logprobs = torch.tensor([[math.log(1.5), 0.0, 100.0]], requires_grad=True)
    loss, _ = grpo_math.clipped_policy_loss(logprobs, torch.zeros(1, 3), torch.tensor([[1.0]]), 0.2, 0.28)
    loss.sum().backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] == pytest.approx(-1.0)
    assert torch.isfinite(loss).all()  # exp(100) would overflow without the clamp


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    logprobs, reference = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    # k1 = log pi - log pi_ref.
    assert close(grpo_math.kl_k1(logprobs, reference), [[0.5, -1.0]])
    # k3 = exp(d) - d - 1, d = log pi_ref - log pi = [-0.5, 1.0].
    assert close(grpo_math.kl_k3(logprobs, reference), [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]])
    assert close(grpo_math.kl_k3(logprobs, logprobs), [[0.0, 0.0]])


def test_kl_estimators_are_unbiased_for_the_true_kl():
    """Sampled from pi, both estimators average to KL(pi || pi_ref) of two categorical distributions."""
    policy, reference = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    true_kl = (policy * (policy / reference).log()).sum()
    samples = torch.multinomial(policy, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logprobs, ref_logprobs = policy.log()[samples], reference.log()[samples]
    for estimator in grpo_math.KL_ESTIMATORS.values():
        assert estimator(logprobs, ref_logprobs).mean() == pytest.approx(true_kl.item(), abs=5e-3)


# ---------------------------------------------------------------- aggregation


def test_token_mean_and_sequence_mean_with_masks():
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # Token mean: (1 + 2 + 3 + 4) / 4 tokens.
    total, count = grpo_math.masked_sum_and_count(values, mask, "token_mean")
    assert (total.item(), count.item()) == (10.0, 4.0)
    # Sequence mean of token means: (2 + 4) / 2 sequences; the row without tokens does not count.
    total, count = grpo_math.masked_sum_and_count(values, mask, "seq_mean_token_mean")
    assert (total.item(), count.item()) == (6.0, 2.0)


def test_aggregation_over_microbatches_is_one_global_division():
    """Summing (numerator, count) over two microbatches and dividing once equals the whole batch's mean."""
    values, mask = torch.rand(6, 5, generator=torch.Generator().manual_seed(1)), torch.ones(6, 5)
    mask[0, 2:] = 0
    mask[4, 1:] = 0
    for aggregation in grpo_math.LOSS_AGGREGATIONS:
        whole = grpo_math.masked_sum_and_count(values, mask, aggregation)
        parts = [grpo_math.masked_sum_and_count(values[rows], mask[rows], aggregation) for rows in (slice(0, 2), slice(2, 6))]
        assert (sum(part[0] for part in parts) / sum(part[1] for part in parts)).item() == pytest.approx((whole[0] / whole[1]).item())


# ---------------------------------------------------------------- entropy


def test_entropy_by_hand_and_against_the_plain_formula():
    # Uniform over 4 tokens: log 4; a point mass: 0.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]])
    assert close(grpo_math.vocab_parallel_entropy(logits), [math.log(4), 0.0])
    # Random logits [batch, seq, vocab] (large ones too): -sum p log p.
    logits = 20 * torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    plain = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert torch.allclose(grpo_math.vocab_parallel_entropy(logits), plain, atol=1e-10)
