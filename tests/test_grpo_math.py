"""GRPO math against hand-computed numbers: advantages, overlong penalty, importance ratios, clipped surrogate, KL
estimators, aggregation (the constant normaliser too), entropy and its gradient."""

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
    advantages, equal = grpo_math.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    scale = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert close(advantages, [[scale, -scale, -scale, scale]])
    assert equal.tolist() == [False]


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
        advantages, equal = grpo_math.group_advantages(rewards, baseline=baseline)
        assert equal.tolist() == [True, True, False]
        assert torch.equal(advantages[:2], torch.zeros(2, 3))
        assert advantages[2, 1] > 0 > advantages[2, 0]


def test_advantages_of_large_rewards_are_neither_rounded_nor_overflowed():
    """Rewards go from the reward function to the advantages in fp64: in fp32 the group [1e6 + 0.1, 1e6, 1e6, 1e6] had
    advantages [1.73, 0, 0, 0] (its mean rounded to 1e6), two rewards of 3e38 overflowed the group's sum (NaN
    advantages, trained on), and a reward of 1e39 (finite as a Python float) was inf; now the last is refused as a
    failed call, scored 0."""
    from types import SimpleNamespace

    from data import rewards
    from trainer.grpo_sampling import shaped_rewards

    returned = {"a": 1e6 + 0.1, "b": 1e6, "c": 3e38, "d": 0.0, "e": 1e39}
    scores = rewards.score(lambda completion, reference: returned[completion], list("abbbccdde"), [""] * 9)
    assert scores.errors == 1 and scores.rewards[-1] == 0.0 and "ValueError" in scores.failures
    settings = SimpleNamespace(reward_weight=1.0, format_bonus=0.0, overlong_buffer=0)
    shaped, _ = shaped_rewards(scores, None, [SimpleNamespace(skipped=False, ids=[0])] * 9, settings)
    advantages, equal = grpo_math.group_advantages(shaped[:8].view(2, 4))
    scale = 1 / (0.05 + 1e-4)  # the std of [0.1, 0, 0, 0] is 0.05: 0.075 / (0.05 + 1e-4) = 1.4970
    assert advantages[0].tolist() == pytest.approx([0.075 * scale, -0.025 * scale, -0.025 * scale, -0.025 * scale], rel=1e-5)
    assert advantages.dtype == torch.float32 and torch.isfinite(advantages).all() and equal.tolist() == [False, False]
    assert advantages[1].tolist() == pytest.approx([0.866, 0.866, -0.866, -0.866], rel=1e-3)
    # Rewards apart by fp64's rounding alone are alike, as in fp32: exact zeros, counted.
    advantages, equal = grpo_math.group_advantages(torch.tensor([[0.1 + 0.2, 0.3, 0.3, 0.3]], dtype=torch.float64))
    assert equal.tolist() == [True] and advantages.tolist() == [[0.0] * 4]


# ---------------------------------------------------------------- clipped surrogate


def per_token_loss(ratio: float, advantage: float, dual_clip: float = 0.0, clip_low=0.2, clip_high=0.28):
    """Loss and clip flag of one token with the given probability ratio."""
    loss, clipped = grpo_math.clipped_policy_loss(torch.tensor([[math.log(ratio)]]), torch.tensor([[advantage]]),
                                                  clip_low, clip_high, dual_clip)
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
    log_ratio = grpo_math.token_log_ratio(logprobs, torch.zeros(1, 3), torch.ones(1, 3))
    loss, _ = grpo_math.clipped_policy_loss(log_ratio, torch.tensor([[1.0]]), 0.2, 0.28)
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
    """Sampled from pi, k1 and k3 average to KL(pi || pi_ref) of two categorical distributions (k2 does not)."""
    policy, reference = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    true_kl = (policy * (policy / reference).log()).sum()
    samples = torch.multinomial(policy, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logprobs, ref_logprobs = policy.log()[samples], reference.log()[samples]
    for name in ("k1", "k3"):
        assert grpo_math.KL_ESTIMATORS[name](logprobs, ref_logprobs).mean() == pytest.approx(true_kl.item(), abs=5e-3)
    assert grpo_math.kl_k2(torch.tensor([[-1.0]]), torch.tensor([[-3.0]])).item() == 2.0  # (-1 + 3)^2 / 2


def test_each_kl_penalty_pulls_as_its_documented_gradient():
    """As a loss on tokens sampled from pi, the expected gradient (exact, over a 6-token vocabulary) of k1 is 0 (it
    penalises nothing), of k2 that of KL(pi || pi_ref), of k3 that of KL(pi_ref || pi); and k3 is capped at
    nothing: a token far less likely than under the reference keeps its pull back."""
    logits = torch.tensor([1.0, 0.2, -0.5, 0.3, -1.0, 0.0], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([0.1, 0.3, 0.2, 0.1, 0.2, 0.1], dtype=torch.float64)

    def expected_gradient(term) -> torch.Tensor:
        """sum_a pi(a) grad term(a), pi(a) held fixed: the expectation over sampled tokens of the loss's gradient."""
        logprobs = logits.log_softmax(-1)
        weights = logprobs.exp().detach()
        return torch.autograd.grad((weights * term(logprobs[None], reference.log()[None])[0]).sum(), logits)[0]

    def true_gradient(kl) -> torch.Tensor:
        return torch.autograd.grad(kl(logits.softmax(-1)), logits)[0]

    forward = true_gradient(lambda pi: (pi * (pi / reference).log()).sum())  # KL(pi || pi_ref)
    reverse = true_gradient(lambda pi: (reference * (reference / pi).log()).sum())  # KL(pi_ref || pi)
    assert expected_gradient(grpo_math.KL_ESTIMATORS["k1"]).abs().max() < 1e-15
    assert torch.allclose(expected_gradient(grpo_math.KL_ESTIMATORS["k2"]), forward, atol=1e-12)
    assert torch.allclose(expected_gradient(grpo_math.KL_ESTIMATORS["k3"]), reverse, atol=1e-12)
    assert forward.abs().max() > 0.1 and (forward - reverse).abs().max() > 0.05  # the three differ
    # A token the policy gives e^-15 of what the reference does keeps its pull (not clamped as verl's low_var_kl is).
    logprob = torch.tensor([[-16.0]], requires_grad=True)
    far = grpo_math.KL_ESTIMATORS["k3"](logprob, torch.tensor([[-1.0]]))
    far.sum().backward()
    assert far.item() == pytest.approx(math.exp(15) - 16) and logprob.grad.item() == pytest.approx(-(math.exp(15) - 1))


# ---------------------------------------------------------------- aggregation


def test_token_mean_and_sequence_mean_with_masks():
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # Token mean: (1 + 2 + 3 + 4) / 4 tokens.
    total, count = grpo_math.token_mean(values, mask, budget=4)
    assert (total.item(), count.item()) == (10.0, 4.0)
    # Sequence mean of token means: (2 + 4) / 2 sequences; the row without tokens does not count.
    total, count = grpo_math.seq_mean_token_mean(values, mask, budget=4)
    assert (total.item(), count.item()) == (6.0, 2.0)
    # Dr. GRPO: the token sum (1 + 2 + 3 + 4) over 3 completions x a budget of 5 tokens, whatever their lengths.
    total, count = grpo_math.seq_mean_token_sum_norm(values, mask, budget=5)
    assert (total.item(), count.item()) == (10.0, 15.0)


def test_constant_normaliser_has_no_length_bias():
    """Dr. GRPO's point: with the token mean, a token's weight shrinks as the batch's other completions grow; with the
    constant normaliser every token weighs 1 / (completions x budget), so a long completion's gradient is not
    diluted. The per-token gradient is exactly that weight."""
    values = torch.zeros(2, 6, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    total, count = grpo_math.seq_mean_token_sum_norm(values, mask, budget=8)
    (total / count).backward()
    assert torch.equal(values.grad, mask / 16)
    values.grad = None
    total, count = grpo_math.seq_mean_token_mean(values, mask, budget=8)
    (total / count).backward()
    assert close(values.grad, [[0.25, 0.25, 0, 0, 0, 0], [1 / 12] * 6])


def test_aggregation_over_microbatches_is_one_global_division():
    """Summing (numerator, count) over two microbatches and dividing once equals the whole batch's mean."""
    values, mask = torch.rand(6, 5, generator=torch.Generator().manual_seed(1)), torch.ones(6, 5)
    mask[0, 2:] = 0
    mask[4, 1:] = 0
    for aggregation in grpo_math.LOSS_AGGREGATIONS.values():
        whole = aggregation(values, mask, 5)
        parts = [aggregation(values[rows], mask[rows], 5) for rows in (slice(0, 2), slice(2, 6))]
        assert (sum(part[0] for part in parts) / sum(part[1] for part in parts)).item() == pytest.approx((whole[0] / whole[1]).item())


# ---------------------------------------------------------------- entropy


def plain_entropy(logits: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dimension, by autograd-friendly torch operations: the reference."""
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


def test_entropy_by_hand_and_against_the_plain_formula():
    # Uniform over 4 tokens: log 4; a point mass: 0.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]])
    assert close(grpo_math.chunked_entropy(logits, 1.0), [math.log(4), 0.0])
    # Random logits [batch, seq, vocab] (large ones too): -sum p log p (the pieces compute in fp32).
    logits = 20 * torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(grpo_math.chunked_entropy(logits, 1.0).double(), plain_entropy(logits), atol=1e-5)


def test_entropy_bonus_gradient_raises_the_entropy():
    """The loss subtracts entropy_coef x entropy: a gradient-descent step on it makes the distribution flatter."""
    logits = torch.tensor([[[3.0, 0.5, -1.0, 0.0]]], requires_grad=True)
    before = grpo_math.chunked_entropy(logits, 1.0).item()
    loss = -0.1 * grpo_math.chunked_entropy(logits, 1.0).sum()
    loss.backward()
    # The most likely token's logit is pushed down, the least likely ones up.
    assert logits.grad[0, 0, 0] > 0 and logits.grad[0, 0, 2] < 0
    after = grpo_math.chunked_entropy(logits.detach() - 1.0 * logits.grad, 1.0).item()
    assert after > before
    # The analytic gradient of H w.r.t. logit j is -p_j (log p_j + H).
    probabilities = logits.detach().softmax(-1)
    expected = 0.1 * probabilities * (probabilities.log() + before)
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_chunked_entropy_equals_the_plain_one_in_value_and_gradient(monkeypatch):
    """A few rows at a time (here 3 rows of 64 per piece), with the temperature inside, in the forward and in the
    recomputing backward: the same values and gradients as autograd through the whole-vocabulary formula."""
    monkeypatch.setattr(grpo_math, "ENTROPY_CHUNK_ELEMENTS", 3 * 64)
    logits = 20 * torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = torch.rand(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    plain_logits, chunked_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    plain = plain_entropy(plain_logits / 0.7)
    chunked = grpo_math.chunked_entropy(chunked_logits, 0.7)
    assert torch.allclose(chunked.double(), plain, atol=1e-5)  # the pieces compute in fp32
    (plain * weights).sum().backward()
    (chunked * weights).sum().backward()
    assert torch.allclose(chunked_logits.grad, plain_logits.grad, atol=1e-5)
    with torch.no_grad():  # the logging path: no graph, the same values
        assert torch.equal(grpo_math.chunked_entropy(logits, 0.7), chunked.detach())


# ---------------------------------------------------------------- overlong penalty and GSPO


def test_overlong_penalty_at_the_boundary_tokens():
    # Budget 32, buffer 8: no penalty up to 24 tokens, then -1/8 per token, -1 at 32 (x the penalty 0.5 here).
    lengths = torch.tensor([1, 24, 25, 28, 31, 32])
    penalties = grpo_math.overlong_penalty(lengths, budget=32, buffer=8, penalty=0.5)
    assert close(penalties, [0.0, 0.0, -0.0625, -0.25, -0.4375, -0.5])
    # A buffer as long as the budget penalises from the first token.
    assert close(grpo_math.overlong_penalty(torch.tensor([0, 4, 8]), budget=8, buffer=8, penalty=1.0), [0.0, -0.5, -1.0])


def test_the_format_bonus_and_overlong_penalty_are_shaping_no_weight_scales():
    """`grpo.reward_weight` weighs the reward function's score (and an environment's) only: at 0, with a reward model
    alone, the format bonus still pays (it was multiplied by the weight, and paid nothing)."""
    from types import SimpleNamespace

    from data import rewards
    from trainer.grpo_sampling import shaped_rewards

    scores = rewards.score(rewards.gsm8k, ["#### 8", "#### 7", "8", "#### 8"], ["#### 8"] * 4, format_bonus=0.25)
    assert scores.rewards == [1.25, 0.25, 0.0, 1.25]
    episodes = [SimpleNamespace(skipped=False, ids=[0] * length) for length in (4, 4, 4, 8)]
    model_scores = torch.tensor([0.5, -0.5, 0.0, 0.0])
    settings = dict(format_bonus=0.25, reward_model_weight=2.0, overlong_buffer=4, max_new_tokens=8, overlong_penalty=1.0)
    for weight, expected in ((1.0, [2.25, -0.75, 0.0, 0.25]), (0.0, [1.25, -0.75, 0.0, -0.75]),
                             (0.5, [1.75, -0.75, 0.0, -0.25])):
        shaped, penalty = shaped_rewards(scores, model_scores, episodes, SimpleNamespace(reward_weight=weight, **settings))
        assert shaped.tolist() == pytest.approx(expected) and penalty == -1.0
    plain = SimpleNamespace(reward_weight=1.0, **{**settings, "overlong_buffer": 0})
    assert shaped_rewards(scores, None, episodes, plain)[0].tolist() == scores.rewards  # bit for bit, as before


def test_a_reward_models_non_finite_score_is_a_counted_failure_not_a_nan_advantage():
    """A reward model scoring NaN or inf (weights saved NaN, a bf16 overflow) made its whole group's advantages NaN
    and the update's gradients after them; such a score is now 0 and counted in `reward_errors`, as a reward
    function's NaN is, with the first one described; the group's other scores are kept."""
    from types import SimpleNamespace

    from data import rewards
    from trainer.grpo_sampling import REWARD_MODEL_FAILURE, finite_model_scores

    scores = rewards.score(rewards.gsm8k, ["#### 8", "#### 7", "#### 8", "#### 8"], ["#### 8"] * 4)
    episodes = [SimpleNamespace(answer=f"answer {index}") for index in range(4)]
    model_scores = finite_model_scores(torch.tensor([0.5, float("nan"), float("-inf"), -0.25]), scores, episodes,
                                       "rm/hf")
    assert model_scores.tolist() == [0.5, 0.0, 0.0, -0.25]
    assert scores.errors == 2 and scores.failed == [False, True, True, False]
    assert scores.failures == {REWARD_MODEL_FAILURE + "non-finite score":
                               "`grpo.reward_model=rm/hf` scored nan (on the completion 'answer 1')"}
    assert scores.rewards == [1.0, 0.0, 1.0, 1.0]  # the reward function's part stands
    advantages, _ = grpo_math.group_advantages(torch.tensor(scores.rewards, dtype=torch.float64).add(model_scores)
                                               .view(1, 4))
    assert torch.isfinite(advantages).all()


def test_sequence_ratio_is_the_length_normalised_mean_and_clips_whole_completions():
    """GSPO: s_i = exp(mean over the completion's tokens of log pi - log pi_old), the same value on each of its tokens."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -2.0, -2.5, 0.0], [-0.5, -0.6, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    log_ratio = grpo_math.sequence_log_ratio(logprobs, old, mask)
    # Row 1: (0.2 + 0 - 0.5) / 3 = -0.1; row 2: (0 + 0.1) / 2 = 0.05.
    assert close(log_ratio * mask, [[-0.1, -0.1, -0.1, 0.0], [0.05, 0.05, 0.0, 0.0]])
    # Clipped with GSPO's range [1 - 3e-4, 1 + 4e-4]: row 1 (s = 0.905, A > 0) keeps the unclipped term on every
    # token; row 2 (s = 1.051, A > 0) is clipped on every token and gets no gradient.
    loss, clipped = grpo_math.clipped_policy_loss(log_ratio, torch.tensor([[1.0], [1.0]]), 3e-4, 4e-4)
    assert (clipped * mask).tolist() == [[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    # Averaged over each completion's tokens, the gradient is GSPO's: A s_i / |y_i| per token for row 1.
    total, count = grpo_math.seq_mean_token_mean(loss, mask, budget=4)
    (total / count).backward()
    s = math.exp(-0.1)
    assert close(logprobs.grad, [[-s / 3 / 2] * 3 + [0.0], [0.0, 0.0, 0.0, 0.0]])
    # The token ratio of the same numbers differs per token.
    assert close(grpo_math.token_log_ratio(logprobs, old, mask) * mask, [[0.2, 0.0, -0.5, 0.0], [0.0, 0.1, 0.0, 0.0]])


# ---------------------------------------------------------------- the rollout/training gap


def test_truncated_importance_weights_by_hand():
    """pi_old / pi_sampler per token, capped (verl's rollout_is_threshold 2.0), without gradient; a token whose gap
    is 0 (untrained) keeps weight 1."""
    log_ratio = torch.tensor([[math.log(0.5), 0.0, math.log(1.5), math.log(3.0)]], requires_grad=True)
    weights = grpo_math.truncated_importance_weights(log_ratio, 2.0)
    assert close(weights, [[0.5, 1.0, 1.5, 2.0]]) and not weights.requires_grad


def test_the_samplers_log_prob_is_under_the_distribution_it_drew_from():
    """Under top-k / top-p the sampler's log-prob is the truncated distribution's (vLLM's processed log-probs): the gap
    and TIS then weigh by the behaviour policy that really sampled. Before, it was the full softmax's."""
    from model.sampling import sample_next

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 64)  # [rows, vocab]
    generator = torch.Generator().manual_seed(0)
    ids, logprobs = sample_next(logits, 1.0, 1.0, 2, generator)  # top-2: ids 0 and 1, renormalised
    assert set(ids.tolist()) == {0, 1}
    assert torch.equal(logprobs, torch.tensor([2.0, 1.0]).log_softmax(dim=0)[ids])
    ids, logprobs = sample_next(logits, 1.0, 0.5, 0, generator)  # top-p 0.5: id 0 alone holds 0.64 of the mass
    assert ids.tolist() == [0] * 64 and logprobs.tolist() == [0.0] * 64
    ids, logprobs = sample_next(logits, 0.7, 1.0, 0, generator)  # no truncation: the tempered softmax's, bit for bit
    assert torch.equal(logprobs, (logits / 0.7).log_softmax(dim=-1).gather(1, ids[:, None]).squeeze(1))
    ids, logprobs = sample_next(logits, 0.0, 1.0, 0, generator)  # greedy: the plain softmax's
    assert ids.tolist() == [0] * 64 and torch.equal(logprobs, logits.log_softmax(dim=-1)[:, 0])


def test_the_sampler_draws_from_the_distribution_transformers_warpers_leave():
    """Temperature, then top-k, then top-p, as `transformers.generate` applies its warpers (and vLLM its sampling
    parameters): every drawn id is one transformers keeps, its log-prob is transformers' processed log-prob, and the
    ids' frequencies over many draws are its probabilities (5,000 draws a row: a frequency's spread is under 0.007)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from model.sampling import sample_next

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 2  # [rows, vocab], no ties
    draws = 5000
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.7), (0.6, 10, 0.8)):
        processed = TemperatureLogitsWarper(temperature)(None, logits.clone())
        processed = TopKLogitsWarper(top_k)(None, processed) if top_k else processed
        processed = TopPLogitsWarper(top_p)(None, processed) if top_p < 1 else processed
        expected = processed.log_softmax(dim=-1)  # [rows, vocab]
        ids, logprobs = sample_next(logits.repeat_interleave(draws, dim=0), temperature, top_p, top_k,
                                    torch.Generator().manual_seed(1))  # [rows * draws] each
        rows = torch.arange(len(logits)).repeat_interleave(draws)  # [rows * draws]
        assert torch.isfinite(expected[rows, ids]).all(), (temperature, top_k, top_p)
        assert torch.allclose(logprobs, expected[rows, ids], atol=1e-5), (temperature, top_k, top_p)
        frequencies = torch.zeros_like(expected).index_put_((rows, ids), torch.ones(len(ids)), accumulate=True) / draws
        assert (frequencies - expected.exp()).abs().max() < 0.03, (temperature, top_k, top_p)


def test_without_log_probs_the_sampler_draws_the_same_ids_and_computes_none():
    """Held-out evaluation reads no log-prob: the sampler then skips the log-softmax over the vocabulary, and the ids
    it draws (greedy, and sampled from the same seed) are the ones it draws with them."""
    from model.sampling import sample_next

    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(1))  # [rows, vocab]
    for temperature, top_p, top_k in ((0.0, 1.0, 0), (1.0, 1.0, 0), (0.8, 0.9, 50)):
        with_logprobs = sample_next(logits, temperature, top_p, top_k, torch.Generator().manual_seed(2))
        ids, logprobs = sample_next(logits, temperature, top_p, top_k, torch.Generator().manual_seed(2), logprobs=False)
        assert torch.equal(ids, with_logprobs[0]) and logprobs.tolist() == [0.0] * 32
        assert with_logprobs[1].max() < 0  # (the other call's are real log-probs)


# ---------------------------------------------------------------- a step that rejected every token


def test_a_step_whose_rejection_left_every_token_out_is_said(caplog):
    # top_k keeps 3 of 8 equally likely tokens: the sampler's log-prob is log(1/3), the whole vocabulary's log(1/8), so
    # pi_old / pi_sampler = 3/8 on every token, below 1/2: `sequence_reject` at cap 2 keeps no completion.
    from config.sections import GRPOSection
    from trainer import grpo_metrics

    log_ratio = torch.full((2, 4), math.log(3 / 8))  # [batch, seq]
    mask = torch.ones(2, 4)
    assert grpo_math.rejection_keep(log_ratio, mask, 2.0, "sequence_reject").sum() == 0
    grpo = GRPOSection(rollout_correction="sequence_reject", top_k=3)
    with caplog.at_level("WARNING"):
        grpo_metrics.say_all_rejected(7, grpo, 3 / 8)
    assert ("step 7: `grpo.rollout_correction=sequence_reject` left every trained token out of the loss "
            "(pi_old / pi_sampler outside [1/2, 2]; its mean 0.375)") in caplog.text
    assert "`grpo.top_k=3` / `grpo.top_p=1`" in caplog.text and "--grpo.rollout_correction tis" in caplog.text


# ---------------------------------------------------------------- the loss of a micro-batch, in a process group


def _gspo_with_token_rejection(rank: int, port: int, results) -> None:
    """`trainer.grpo_update.policy_loss` at GSPO's settings with `token_reject`, in a one-process gloo group (TP=1)."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state

    from config.sections import GRPOSection
    from model import output
    from trainer.grpo_update import LossSettings, policy_loss

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    parallel_state.initialize_model_parallel(1)
    try:
        logits = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(0))  # [batch, seq, vocab]
        labels = torch.tensor([[0, 1, 2, 3, 0], [0, 4, 5, 0, 0]])
        mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0]])
        logprobs = logits.log_softmax(-1).gather(-1, labels[..., None])[..., 0] * mask  # [batch, seq]
        # pi / pi_old: 1e-4 on row 0's first two tokens, 2e-3 on its third, whose pi_old / pi_sampler = 3 is out of
        # [1/2, 2]: `token_reject` leaves it out. Row 1: pi = pi_old, nothing rejected.
        old = logprobs - torch.tensor([[0.0, 1e-4, 1e-4, 2e-3, 0.0], [0.0] * 5]) * mask
        sampler = old - torch.tensor([[0.0, 0.0, 0.0, math.log(3.0), 0.0], [0.0] * 5])
        grpo = GRPOSection(importance_ratio="sequence", clip_low=3e-4, clip_high=4e-4, dual_clip=0.0,
                           loss_aggregation="seq_mean_token_mean", kl_coef=0.0, rollout_correction="token_reject")
        read = output.ReadPositions.where(mask, None, 5)
        picked = read.pick(logits).clone().requires_grad_(True)  # [1, positions, vocab]
        batch = {"loss_mask": mask, "read": read, "labels": labels, "old_logprobs": old, "pi_old_recomputed": True,
                 "advantages": torch.tensor([[1.0], [-0.5]]), "sampler_logprobs": sampler, "ref_logprobs": None}
        total, count, _ = policy_loss(batch, LossSettings.from_config(grpo), picked)
        (total / count).backward()
        softmax = logits.softmax(-1)
        results["loss"] = float(total / count)
        # d loss / d log pi per position, by the chain rule through log_softmax: grad_logits = g (onehot - softmax).
        onehot = torch.nn.functional.one_hot(labels, 6).float()
        per_logprob = (picked.grad[0] / (read.pick(onehot) - read.pick(softmax))[0]).mean(-1)  # [positions]
        results["per_logprob"] = per_logprob.tolist()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.distributed
def test_gspo_sequence_ratio_leaves_out_the_tokens_a_rejection_masks():
    """GSPO's ratio of a completion is the geometric mean over the tokens it trains on: under `token_reject` a rejected
    token leaves the ratio as it leaves the loss (verl's rollout_rs masks response_mask before its gspo loss reads it).
    Before, row 0's ratio counted its rejected token, exp((1e-4 + 1e-4 + 2e-3) / 3) = 1.00073, past 1 + 4e-4: its
    kept tokens were clipped and got no gradient. Over its kept tokens it is exp(1e-4), inside the range."""
    import torch.multiprocessing as multiprocessing

    from model.parallel import free_port

    with multiprocessing.Manager() as manager:
        results = manager.dict()
        multiprocessing.start_processes(_gspo_with_token_rejection, args=(free_port(), results), nprocs=1,
                                        start_method="spawn", join=True)
        results = dict(results)
    s = math.exp(1e-4)
    # Loss: the mean over 2 completions of each one's token mean over its kept tokens of -A s.
    assert results["loss"] == pytest.approx((-1.0 * s + 0.5 * 1.0) / 2, rel=1e-6)
    # d loss / d log pi: -A s / (kept tokens) / 2 completions on row 0's two kept tokens, 0 on the rejected one;
    # row 1: 0.5 / 2 / 2.
    assert results["per_logprob"] == pytest.approx([-s / 2 / 2, -s / 2 / 2, 0.0, 0.5 / 2 / 2, 0.5 / 2 / 2], abs=1e-6)
