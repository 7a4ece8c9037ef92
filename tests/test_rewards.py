"""Reward functions on hand examples, scoring that survives a raising reward, and the unknown-name error."""

import pytest

from data import rewards
from config.errors import UserError

REFERENCE = "3 + 5 = 8\n#### 8"


@pytest.mark.parametrize("completion, expected", [
    ("3 + 5 = 8\n#### 8", 1.0),
    ("so the answer is\n#### 8.0", 1.0),       # numerically equal
    ("#### 1,008", 0.0),
    ("3 + 5 = 8", 0.0),                         # no `####` answer: strict mode gives nothing
    ("#### 9\nwait, 8", 0.0),                   # the number after the last `####` counts
    ("", 0.0),
])
def test_gsm8k_strict(completion, expected):
    assert rewards.gsm8k(completion, REFERENCE) == expected


@pytest.mark.parametrize("completion, expected", [
    ("3 + 5 = 8", 1.0),                         # the last number is taken
    ("#### 9\nwait, 8", 1.0),
    ("8 apples, I think 9", 0.0),
    ("no number", 0.0),
])
def test_gsm8k_flexible(completion, expected):
    assert rewards.gsm8k_flexible(completion, REFERENCE) == expected


def test_thousands_separators_in_the_reference():
    assert rewards.gsm8k("#### 1008", "... #### 1,008") == 1.0


@pytest.mark.parametrize("completion, expected", [
    ("3 + 5 = 8\n#### 8", 1.0),
    ("#### 8", 1.0),                            # no working shown: only the answer is checked
    ("3 + 5 = 9\n#### 8", 0.0),                 # right answer, false working
    ("3 + 5 = 7\n#### 7", 0.0),                 # consistent but wrong
    ("4 * 2 = 8\n#### 8", 1.0),
])
def test_arithmetic(completion, expected):
    assert rewards.arithmetic(completion, REFERENCE) == expected


def test_format_bonus_and_accuracy_are_separate():
    scores = rewards.score(rewards.gsm8k, ["#### 8", "#### 7", "8"], [REFERENCE] * 3, format_bonus=0.1)
    assert scores.rewards == pytest.approx([1.1, 0.1, 0.0])
    assert scores.correct == [True, False, False]
    assert scores.errors == 0


def test_raising_or_non_finite_reward_scores_zero_and_is_counted():
    def fragile(completion, reference):
        if "boom" in completion:
            raise RuntimeError("cannot parse")
        return float("nan") if "nan" in completion else 1.0

    scores = rewards.score(fragile, ["boom", "fine", "nan", "boom"], [REFERENCE] * 4)
    assert scores.rewards == [0.0, 1.0, 0.0, 0.0]
    assert scores.correct == [False, True, False, False]
    assert scores.errors == 3


def test_known_names_and_user_functions():
    assert rewards.get_reward("gsm8k") is rewards.gsm8k
    assert rewards.get_reward("data.rewards:gsm8k_flexible") is rewards.gsm8k_flexible


@pytest.mark.parametrize("name, expected", [
    ("gsm9k", "`grpo.reward=gsm9k` is not a known reward function; known ones are arithmetic, gsm8k, gsm8k_flexible"),
    ("no_such_module:f", "cannot load `f` from module `no_such_module`"),
    ("data.rewards:nothing", "cannot load `nothing` from module `data.rewards`"),
])
def test_unknown_reward_is_a_user_error_naming_the_key(name, expected):
    with pytest.raises(UserError) as error:
        rewards.get_reward(name)
    assert expected in str(error.value) and "--grpo.reward" in str(error.value)
