"""Reward functions for GRPO, picked by name (`grpo.reward`), and scoring that never stops a run.

A reward function maps `(completion text, reference answer)` to a correctness score in [0, 1]; 1.0 is
full marks and counts towards `accuracy`. `grpo.format_bonus` is added on top for a completion that ends
its answer GSM8K-style (`#### N`). `grpo.reward` may also name a function of your own as `module:function`, which is
called in worker processes, each call within `grpo.reward_timeout` seconds (`IsolatedReward`; 0: in this process).
"""

import dataclasses
import inspect
import logging
import math
import re
from collections.abc import Callable

from config.errors import UserError
from config import user_code
from data.arithmetic import NUMBER, OPERATIONS, extract_final_answer
from tool_runtime import runner as tool_runner
from tool_runtime import worker as tool_worker

log = logging.getLogger(__name__)

RewardFunction = Callable[[str, str], float]

# A piece of shown working: a number (with its sign, as NUMBER reads it, or a `%`), an operator, a
# parenthesis or `=`. Spaces, tabs and `$` sit between pieces; anything else (a word, a newline, `<<`)
# ends the run. A number glued to a letter (`5A`, `s+55`) is part of a name or a term, not a number.
TOKEN = re.compile(
    rf"(?P<number>(?<![^\W\d])(?>{NUMBER})(?:[ \t]*%)?(?![^\W\d]))"
    r"|(?P<symbol>[-+*/()=×÷−–]|(?<!\w)x(?!\w))|(?P<gap>[ \t$]+)|(?P<other>.)",
    re.DOTALL,
)
# How people write the operators: `2 x 3`, `6 ÷ 2`, and a minus sign or an en dash for `-`.
SYMBOL_SPELLINGS = {"x": "*", "×": "*", "÷": "/", "−": "-", "–": "-"}
SYMBOLS = frozenset("+-*/()=")
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}

# A shown result is right when it equals the computed value up to floating-point noise (relative 1e-9;
# 1e-6 would pass `1,000,000 + 1 = 1,000,000`), or when it is written with decimals and is the value
# rounded to them (`1 / 3 = 0.33`). A whole number claims an exact result: `10 / 3 = 3` is wrong.
RELATIVE_TOLERANCE = 1e-9
ABSOLUTE_TOLERANCE = 1e-9


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


def _runs(text: str) -> list[list[str]]:
    """The runs of arithmetic in `text` as token lists; a sign right after an operand is an operator (`5-3`)."""
    runs, run = [], []
    for match in TOKEN.finditer(text):
        kind, token = match.lastgroup, match.group()
        if kind == "other":
            if run:
                runs.append(run)
            run = []
        elif kind == "number" and token[0] in "+-" and run and (run[-1] == ")" or run[-1] not in SYMBOLS):
            run += [token[0], token[1:]]
        elif kind != "gap":
            run.append(SYMBOL_SPELLINGS.get(token, token))
    if run:
        runs.append(run)
    return runs


def _steps(text: str) -> list[tuple[list[str], list[str]]]:
    """Each `left = right` pair of sides in the text's runs of arithmetic (a chain `a = b = c` gives two)."""
    steps = []
    for run in _runs(text):
        sides = [[]]
        for token in run:
            if token == "=":
                sides.append([])
            else:
                sides[-1].append(token)
        steps += zip(sides, sides[1:])
    return steps


def _number(token: str) -> tuple[float, int]:
    """The value of a number token (`1,000.5`, `-3`, `20%`) and how many decimal places it is written to."""
    digits = token.rstrip("% \t").replace(",", "")
    decimals = len(digits.partition(".")[2])
    if token.endswith("%"):
        return float(digits) / 100, decimals + 2
    return float(digits), decimals


def _evaluate(tokens: list[str]) -> tuple[float, int]:
    """The value of `tokens` (* and / before + and -, left to right) and its operator count; ValueError if malformed."""
    # Operator precedence parsing with two stacks, so that no input nests Python calls deeply. There is
    # no unary minus: a sign is part of its number, and a side that starts with an operator is a fragment.
    values, pending = [], []

    def apply():
        right, left = values.pop(), values.pop()
        values.append(OPERATIONS[pending.pop()](left, right))

    expect_operand, operators = True, 0
    for token in tokens:
        if token == "(" and expect_operand:
            pending.append(token)
        elif token == ")" and not expect_operand:
            while pending and pending[-1] != "(":
                apply()
            if not pending:
                raise ValueError("unmatched `)`")
            pending.pop()
        elif token in PRECEDENCE and not expect_operand:
            while pending and pending[-1] != "(" and PRECEDENCE[pending[-1]] >= PRECEDENCE[token]:
                apply()
            pending.append(token)
            expect_operand, operators = True, operators + 1
        elif token not in SYMBOLS and expect_operand:
            values.append(_number(token)[0])
            expect_operand = False
        else:
            raise ValueError(f"`{token}` out of place")
    if expect_operand or "(" in pending:
        raise ValueError("incomplete expression")
    while pending:
        apply()
    return values[0], operators


def _without_stray_parentheses(tokens: list[str]) -> list[str]:
    """`tokens` less the unmatched `(` they start with or `)` they end with, as in `(2 + 3 = 5)`."""
    excess = tokens.count("(") - tokens.count(")")
    if excess > 0 and tokens[:excess] == ["("] * excess:
        return tokens[excess:]
    if excess < 0 and tokens[excess:] == [")"] * -excess:
        return tokens[:excess]
    return tokens


def _is_close(value: float, result: float, decimals: int = 0) -> bool:
    """Whether `result`, written with `decimals` decimal places, is right for `value` (see RELATIVE_TOLERANCE)."""
    rounding = 0.5 * 10.0**-decimals if decimals else 0.0
    return math.isclose(value, result, rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE + rounding)


def _step_holds(left: list[str], right: list[str]) -> bool:
    """Whether the step `left = right` is true; one showing no computation, or part of one, is not judged: True."""
    left, right = _without_stray_parentheses(left), _without_stray_parentheses(right)
    try:
        value, operators = _evaluate(left)
    except ValueError:  # e.g. `* 3 + 4` from `2 apples * 3 + 4 = 10`: its start is not arithmetic
        return True
    except ZeroDivisionError:
        return False
    if operators == 0:  # `Day 1 = 5 + 3 = 8` shows no computation on the left of its first `=`
        return True
    if right and right[0] not in SYMBOLS and _is_close(value, *_number(right[0])):
        return True  # the result, which a running total may go on from: `3 * 4 = 12 + 2 = 14`
    try:
        whole = _evaluate(right)[0]  # a rewriting: `2 + 3 * 4 = 2 + 12`
    except ValueError:  # `3 / 2 = 1 1/2`, `8/3 = 24/Y`: a result this cannot read is not judged
        return True
    except ZeroDivisionError:
        return False
    return _is_close(value, whole)


def arithmetic(completion: str, reference: str) -> float:
    """The bundled task: 1.0 when the `#### N` answer is right and every computation shown holds, else 0.0."""
    if all(_step_holds(left, right) for left, right in _steps(completion)):
        return gsm8k(completion, reference)
    return 0.0


def none(completion: str, reference: str) -> float:
    """No reward of its own: 0.0 for every completion, for an environment whose `reward()` is the whole reward."""
    return 0.0


REWARDS: dict[str, RewardFunction] = {"arithmetic": arithmetic, "gsm8k": gsm8k, "gsm8k_flexible": gsm8k_flexible,
                                      "none": none}


def spread(count: int, wanted: int) -> list[int]:
    """`wanted` of `count` positions (all, if fewer) spread evenly from the first: a batch's calls that decide whether
    the rest are made. Its first completions are one prompt's group, whose one reference a grader may hang on."""
    wanted = min(wanted, count)
    return sorted({index * count // wanted for index in range(wanted)}) if count else []


class IsolatedReward:
    """A `module:function` reward called in worker processes (`tool_runtime.runner`, as tools are), so one that hangs
    or spins cannot hold the run: a call past `timeout` seconds is killed and fails with a TimeoutError (scored 0,
    counted). A batch's calls run side by side on `workers` processes (`grpo.tool_workers`; 0: this rank's share of
    the cores). GIVE_UP calls (or one per worker, if more), spread over the batch, run first: when every one of them timed
    out the rest fail unrun, so a reward that always hangs costs a few timeouts, not one per completion; otherwise the rest
    run at once. Each worker imports the module itself: module state is per worker, not the trainer's."""

    GIVE_UP = 4

    def __init__(self, spec: str, function: RewardFunction, timeout: float, workers: int = 0):
        self.spec, self.function = spec, function
        self.runner = tool_runner.ToolRunner(timeout, workers, "process", preload=[spec],
                                             late="the reward function did not answer within {:g} s "
                                                  "(grpo.reward_timeout): it was stopped.")

    def call_all(self, completions: list[str], references: list[str]) -> list:
        """Each call's return value, or the exception it raised (TimeoutError past the timeout)."""
        calls = [tool_runner.Job([(self.spec, self.function, self.spec, pair)], stateful=False, tool_names=[])
                 for pair in zip(completions, references, strict=True)]
        # The first calls are spread over the batch, not its first completions: those are one prompt's group, whose
        # shared reference may be the one a grader hangs on (a whole rank's batch then failed unrun, scored 0).
        probes = spread(len(calls), max(self.GIVE_UP, self.runner.workers))
        rest = sorted(set(range(len(calls))) - set(probes))
        returned = dict(zip(probes, (job_outcomes[0] for job_outcomes in self.runner.run([calls[i] for i in probes]))))
        if rest and all(outcome.kind == "timeout" for outcome in returned.values()):
            unrun = tool_runner.Outcome("", "timeout", TimeoutError(f"not called: the {len(probes)} calls before it all timed out"))
            returned |= dict.fromkeys(rest, unrun)
        elif rest:
            returned |= dict(zip(rest, (job_outcomes[0] for job_outcomes in self.runner.run([calls[i] for i in rest]))))
        return [self._returned(returned[index]) for index in range(len(calls))]

    @staticmethod
    def _returned(outcome: tool_runner.Outcome):
        """A call's return value, or its exception (one that could not come back whole: its text)."""
        if outcome.kind == "ok" or isinstance(outcome.value, Exception):
            return outcome.value
        return (TimeoutError if outcome.kind == "timeout" else RuntimeError)(outcome.text.removeprefix("Error: "))

    def close(self) -> None:
        """Stop the worker processes."""
        self.runner.close()


def close(reward) -> None:
    """Stop a reward's worker processes, if it has any."""
    if isinstance(reward, IsolatedReward):
        reward.close()


def get_reward(name: str, timeout: float = 0.0, workers: int = 0) -> "RewardFunction | IsolatedReward":
    """The reward function called `name` (a key of REWARDS, or `module:function`: with a `timeout`, an
    `IsolatedReward` on `workers`); UserError naming `grpo.reward` otherwise."""
    if name in REWARDS:
        return REWARDS[name]
    known = ", ".join(sorted(REWARDS))
    if ":" not in name:
        raise UserError(f"`grpo.reward={name}` is not a known reward function; known ones are {known}, or give your "
                        "own as `module:function`. Change `--grpo.reward`.")
    function = user_code.load(name, "grpo.reward", f"Or use one of {known}.")
    if not callable(function):
        raise UserError(f"`grpo.reward={name}` is not a function. Change `--grpo.reward`.")
    try:  # called as function(completion, reference): said now, not after a step's rollouts
        inspect.signature(function).bind("", "")
    except TypeError as error:
        raise UserError(f"`grpo.reward={name}` is called as `{name.split(':')[-1]}(completion, reference)` with two "
                        f"texts, which its signature does not take ({error}). Give it those two parameters, or change `--grpo.reward`.") from None
    except ValueError:  # a builtin without a signature: its first call says
        pass
    return IsolatedReward(name, function, timeout, workers) if timeout > 0 else function


def reference_answer(reference: str) -> str | None:
    """The number a reference gives as its answer: after its `#### N` line, or the reference itself when it is one
    number (`{"target": "8"}`, data for a reward of your own); None when it gives none."""
    answer = extract_final_answer(reference, strict=True)
    if answer is None and re.fullmatch(NUMBER, reference.strip()):
        answer = reference.strip().replace(",", "").removeprefix("+")
    return answer


def has_answer_format(completion: str) -> bool:
    """Whether the completion gives its answer as GSM8K does: `#### N`."""
    return extract_final_answer(completion, strict=True) is not None


# The built-in rewards that grade a completion against its reference's `#### N` line: a reference without one scores
# every completion 0. How many references start-up reads for it (`check_references_graded`).
GRADE_AGAINST_ANSWER_LINE = ("arithmetic", "gsm8k", "gsm8k_flexible")
REFERENCES_CHECKED = 1000


def check_references_graded(grpo, prompts, path: str, held_out: bool = False) -> None:
    """Refuse a built-in reward (`grpo` section) that grades against a `#### N` line where none of the first
    `REFERENCES_CHECKED` training `prompts` (of `path`) has one and nothing else rewards (a reward model, an
    environment, a teacher, a format bonus): every reward would be 0, and the run would learn nothing. Some without one
    are said in a warning; `held_out` prompts' (which the held-out accuracy grades by the reward function alone) always."""
    if grpo.reward not in GRADE_AGAINST_ANSWER_LINE:
        return
    checked = min(len(prompts), REFERENCES_CHECKED)
    ungraded = sum(not has_answer_format(prompts[index].reference) for index in range(checked))
    if not ungraded:
        return
    alone = not (grpo.reward_model or grpo.environment or grpo.teacher or grpo.format_bonus)
    if ungraded == checked and alone and not held_out:
        raise UserError(
            f"`grpo.reward={grpo.reward}` grades each completion against its reference's GSM8K answer line (`#### N`), "
            f"and none of the {checked} references of {path} read has one (e.g. {prompts[0].reference[:60]!r}): every "
            "completion would score 0, every group's advantage would be 0, and the run would learn nothing. Give your own "
            "reward as `--grpo.reward module:function` (called as function(completion, reference), docs/rewards.md), "
            "or write each reference's answer as a last line `#### N`.")
    log.warning("%d of the first %d references of %s have no GSM8K answer line (`#### N`), which `grpo.reward=%s` grades "
                "against: their completions score 0 under it%s", ungraded, checked, path, grpo.reward,
                ", and eval_accuracy counts them wrong whatever the policy answers" if held_out else "")


@dataclasses.dataclass
class Scores:
    """Rewards of a list of completions, which earned full marks, how many the reward function failed on, and what
    the answers looked like: in the rewarded `#### N` form, and with the reference's number as the last number in
    any form (`#### N` or `The answer is N.`, as `gsm8k_flexible` reads them)."""

    rewards: list[float]
    correct: list[bool]
    errors: int
    in_format: list[bool]
    right_answer: list[bool]
    failures: dict[str, str] = dataclasses.field(default_factory=dict)  # the first failure of each kind, described
    failed: list[bool] = dataclasses.field(default_factory=list)  # which completions it failed on (`errors` of them)

    def fail(self, index: int, kind: str, described: str) -> None:
        """Count the completion at `index` as failed (once, however many of its parts failed), its reward part that
        failed scored 0 by the caller; the first failure of each kind kept, described."""
        if not self.failed[index]:
            self.failed[index], self.errors = True, self.errors + 1
        self.failures.setdefault(kind, described)

    def totals(self) -> dict[str, float]:
        """Sums that add up over data-parallel ranks (rates are these over the number of completions)."""
        return {"reward": sum(self.rewards), "correct": sum(self.correct), "errors": self.errors,
                "in_format": sum(self.in_format), "right_answer": sum(self.right_answer)}


# The largest reward magnitude taken, fp32's largest number: a group's rewards are summed in fp64
# (`grpo_math.group_advantages`), which two rewards near fp64's largest overflow to inf (NaN advantages); 1e39 was
# taken as finite here and became inf in the fp32 tensor the rewards were held in until 2026-12-07.
LARGEST_REWARD = 3.4028234663852886e38


def as_reward(value) -> float:
    """A reward function's return value as a finite float of fp32's range; TypeError or ValueError saying what it
    returned instead."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"it returned {type(value).__name__} {repr(value)[:40]}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"it returned {number}, not a finite number")
    if abs(number) > LARGEST_REWARD:
        raise ValueError(f"it returned {number:g}, beyond fp32's range (+-3.4e38) the trainer holds rewards in")
    return number


def as_verdict(value) -> bool | None:
    """The `correct` of a `(reward, correct)` return value as a bool: true or false (numpy's too), or a number 0 or 1;
    None (no verdict: full marks decide) as it is; TypeError saying what it was instead (`bool("False")` is True: a
    text verdict counted every completion correct)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__") or float(value) not in (0.0, 1.0):
        raise TypeError(f"it returned (reward, {type(value).__name__} {repr(value)[:40]}): `correct` is not true or false")
    return bool(value)


def shown_completion(completion: str) -> str:
    """A completion as a failure's description shows it: its first 117 characters and "..." when longer than 120."""
    return completion if len(completion) <= 120 else completion[:117] + "..."


def describe_failure(reward: RewardFunction, error: Exception, completion: str) -> str:
    """One line naming the reward function, its exception and the completion (cut) it failed on."""
    reward = getattr(reward, "function", reward)  # an IsolatedReward's own
    name = f"{getattr(reward, '__module__', '?')}:{getattr(reward, '__qualname__', repr(reward))}"
    text = " ".join(str(error).split())[:200]
    shown = shown_completion(completion)
    where = next((note for note in getattr(error, "__notes__", []) if note.startswith(tool_worker.RAISED_AT)), "")
    return f"`{name}` raised {type(error).__name__}: {text}{f' ({where})' if where else ''} (on the completion {shown!r})"


def score(reward: RewardFunction, completions: list[str], references: list[str], format_bonus: float = 0.0) -> Scores:
    """Score each completion: a number, correct at full marks (1.0 or more), or `(reward, correct)` from a graded
    reward that says which completions are correct itself; one the reward function raises on (or returns no finite number for) scores 0 and is
    counted, and the first failure of each exception type is kept, described (the loop decides what to say)."""
    rewards, correct, failed, failures = [], [], [], {}
    in_format = [has_answer_format(completion) for completion in completions]
    if isinstance(reward, IsolatedReward):
        returned = reward.call_all(completions, references)
    else:
        returned = [call(reward, completion, reference) for completion, reference in zip(completions, references)]
    for completion, value, formatted in zip(completions, returned, in_format, strict=True):
        verdict, failure = None, False  # a graded reward may say which completions are correct: (reward, correct)
        try:
            if isinstance(value, Exception):
                raise value
            if isinstance(value, tuple) and len(value) == 2:
                value, verdict = value[0], as_verdict(value[1])
            value = as_reward(value)
        except Exception as error:  # a user's reward function may fail in any way on odd model output
            value, verdict, failure = 0.0, None, True
            failures.setdefault(type(error).__name__, describe_failure(reward, error, completion))
        failed.append(failure)
        correct.append(value >= 1.0 if verdict is None else verdict)
        rewards.append(value + (format_bonus if formatted else 0.0))
    right_answer = [_same_number(extract_final_answer(completion, strict=False), reference_answer(reference))
                    for completion, reference in zip(completions, references)]
    return Scores(rewards, correct, sum(failed), in_format, right_answer, failures, failed)


def call(reward: RewardFunction, completion: str, reference: str):
    """`reward(completion, reference)` in this process: its value (an `async def` one's awaited, as in a worker process),
    or the exception it raised."""
    try:
        return tool_worker.awaited(reward(completion, reference))
    except Exception as error:  # a user's reward function may fail in any way on odd model output
        return tool_worker.note_where_raised(error, reward)
