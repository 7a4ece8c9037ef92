"""Figures at the numbers' edges, through the real GRPO entry point: a step that trained on no token reports its token
means as None and says so, not an entropy and a KL of 0.

Before, `--grpo.mask_truncated=true` with every completion cut at `grpo.max_new_tokens` (the untrained tiny model at 4
tokens) logged loss 0, grad_norm 0, kl 0, entropy 0 and clip_frac 0 on every step, with no line saying that nothing
was trained. One run in the shared 2-process launch (conftest's `joint_launches`).
"""

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.distributed

NOTHING_TRAINED = ["--model.path=tiny", "--grpo.reward=tests.tool_fixtures:parity", "--grpo.mask_truncated=true",
                   "--grpo.max_new_tokens=4", "--grpo.kl_coef=0.01", "--grpo.rollout_correction=tis",
                   "--train.steps=1", "--train.global_batch_size=16", "--train.micro_batch_size=8",
                   "--train.eval_samples=0"]


def launches(tmp_path_factory):
    """The GRPO run whose every completion is truncated and masked."""
    root = tmp_path_factory.mktemp("numerics")
    (result,) = yield launch([{"module": "trainer.grpo", "argv": [*NOTHING_TRAINED, f"--train.out_dir={root / 'truncated'}"]}])
    return {"truncated": result}


@pytest.fixture(scope="module")
def runs(joint_launches) -> dict:
    return joint_launches[__name__]


def test_a_step_that_trained_no_token_reports_no_token_means_and_says_so(runs):
    result = runs["truncated"]
    row = result["step1"]
    assert row["truncated_rate"] == 1.0 and row["loss"] == 0.0 and row["grad_norm"] == 0.0
    for key in ("kl", "entropy", "clip_frac", "rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl",
                "rollout_is_ratio_mean", "rollout_is_ratio_max"):
        assert row[key] is None, key
    assert "step 1 trained on no token: all its completions were cut at `grpo.max_new_tokens=4`" in result["log"]
    assert "`--grpo.mask_truncated false`" in result["log"]
