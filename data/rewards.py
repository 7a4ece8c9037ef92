"""Reward functions for GRPO, picked by name (`grpo.reward`), and scoring that never stops a run.

A reward function maps `(completion text, reference answer)` to a correctness score in [0, 1]; 1.0 is
full marks and counts towards `accuracy`. `grpo.format_bonus` is added on top for a completion that ends
its answer GSM8K-style (`#### N`). `grpo.reward` may also name a function of your own as `module:function`.
"""

import dataclasses
import importlib
import math
import re
from collections.abc import Callable

from data.arithmetic import NUMBER, OPERATIONS, extract_final_answer
from config.errors import UserError

RewardFunction = Callable[[str, str], float]

# `a op b = c` as the bundled task shows its working.
EQUATION = re.compile(rf"({NUMBER})\s*([-+*])\s*({NUMBER})\s*=\s*({NUMBER})")


def _same_number(answer: str | None, reference: str | None) -> bool:
    """Numeric equality of two extracted answers (`8`, `8.0` and `8.00` agree); False when either is missing."""
    if answer is None or reference is None:
        return False
    return float(answer) == float(reference)


def gsm8k(completion: str, reference: str) -> float:
    """1.0 when the number after the completion's last `####` equals the reference's, else 0.0."""
    return float(_same_number(extract_final_answer(completion, strict=True), extract_final_answer(reference, strict=True)))


def gsm8k_flexible(completion: str, reference: str) -> float:
    """1.0 when the completion's last number equals the reference's `#### N` answer, else 0.0."""
    return float(_same_number(extract_final_answer(completion, strict=False), extract_final_answer(reference, strict=True)))


def arithmetic(completion: str, reference: str) -> float:
    """The bundled task: 1.0 when the `#### N` answer is right and every `a op b = c` shown holds, else 0.0."""
    for left, symbol, right, result in EQUATION.findall(completion):
        values = [float(number.replace(",", "")) for number in (left, right, result)]
        if OPERATIONS[symbol](values[0], values[1]) != values[2]:
            return 0.0
    return gsm8k(completion, reference)


REWARDS: dict[str, RewardFunction] = {"arithmetic": arithmetic, "gsm8k": gsm8k, "gsm8k_flexible": gsm8k_flexible}


def get_reward(name: str) -> RewardFunction:
    """The reward function called `name` (a key of REWARDS, or `module:function`); UserError naming `grpo.reward` otherwise."""
    if name in REWARDS:
        return REWARDS[name]
    known = ", ".join(sorted(REWARDS))
    module_name, colon, function_name = name.partition(":")
    if not colon:
        raise UserError(f"`grpo.reward={name}` is not a known reward function; known ones are {known}, or give your "
                        "own as `module:function`. Change `--grpo.reward`.")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise UserError(f"`grpo.reward={name}`: cannot load `{function_name}` from module `{module_name}` ({error}). "
                        f"Put the module on PYTHONPATH, or use one of {known}. Change `--grpo.reward`.") from error
    if not callable(function):
        raise UserError(f"`grpo.reward={name}` is not a function. Change `--grpo.reward`.")
    return function


def has_answer_format(completion: str) -> bool:
    """Whether the completion gives its answer as GSM8K does: `#### N`."""
    return extract_final_answer(completion, strict=True) is not None


@dataclasses.dataclass
class Scores:
    """Rewards of a list of completions, which of them earned full marks, and how many the reward function failed on."""

    rewards: list[float]
    correct: list[bool]
    errors: int


def score(reward: RewardFunction, completions: list[str], references: list[str], format_bonus: float = 0.0) -> Scores:
    """Score each completion; one the reward function raises on scores 0 and is counted, never stopping the run."""
    rewards, correct, errors = [], [], 0
    for completion, reference in zip(completions, references, strict=True):
        try:
            value = float(reward(completion, reference))
            if not math.isfinite(value):
                raise ValueError(f"reward {value}")
        except Exception:  # a user's reward function may fail in any way on odd model output
            value, errors = 0.0, errors + 1
        correct.append(value >= 1.0)
        rewards.append(value + (format_bonus if has_answer_format(completion) else 0.0))
    return Scores(rewards, correct, errors)
