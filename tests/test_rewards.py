"""Reward functions on hand examples and on GSM8K, scoring that survives a raising reward, and the unknown-name error."""

import json

import pytest

from config.errors import UserError
from data import rewards
from tests.conftest import GSM8K

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


@pytest.mark.parametrize("working, expected", [
    ("2 + 3 * 4 = 14", 1.0),                    # * before +, not `3 * 4 = 14`
    ("2 + 3 * 4 = 20", 0.0),                    # what left to right without precedence gives
    ("10 - 4 - 3 = 3", 1.0),                    # same precedence: left to right
    ("8 / 4 / 2 = 1", 1.0),
    ("(2 + 3) * 4 = 20", 1.0),
    ("2 * (3 + 4) = 14", 1.0),
    ("5 - 8 = -3", 1.0),
    ("2 * -3 = -6", 1.0),
])
def test_arithmetic_evaluates_each_step_with_precedence(working, expected):
    answer = working.rpartition("=")[2].strip()
    assert rewards.arithmetic(f"{working}\n#### {answer}", f"#### {answer}") == expected


@pytest.mark.parametrize("working, expected", [
    ("3 / 4 = 0.75", 1.0),
    ("3 / 4 = 5", 0.0),
    ("6 ÷ 4 = 1.5", 1.0),
    ("5 / 0 = 0", 0.0),                         # no result is right for a division by zero
])
def test_arithmetic_checks_division(working, expected):
    answer = working.rpartition("=")[2].strip()
    assert rewards.arithmetic(f"{working}\n#### {answer}", f"#### {answer}") == expected


@pytest.mark.parametrize("working, expected", [
    ("0.1 + 0.2 = 0.3", 1.0),                   # 0.30000000000000004 in floating point
    ("1 / 3 = 0.33", 1.0),                      # rounded to the decimals shown
    ("2 / 3 = 0.67", 1.0),
    ("2 / 3 = 0.66", 0.0),
    ("10 / 3 = 3", 0.0),                        # a whole number claims an exact result
    ("1,000,000 + 1 = 1,000,000", 0.0),         # the tolerance is relative 1e-9, not 1e-6
])
def test_arithmetic_compares_results_with_a_tolerance(working, expected):
    answer = working.rpartition("=")[2].strip()
    assert rewards.arithmetic(f"{working}\n#### {answer}", f"#### {answer}") == expected


@pytest.mark.parametrize("working, answer, expected", [
    ("3 * 4 = 12 + 2 = 14", "14", 1.0),        # a running total goes on from each result
    ("2 + 3 * 4 = 2 + 12 = 14", "14", 1.0),    # or each side is rewritten
    ("2 + 3 = 6 + 1 = 7", "7", 0.0),
    ("(2 + 3 = 5) apples", "5", 1.0),
    ("(2 + 3 = 6) apples", "6", 0.0),
    ("$5 + $3 = $8", "8", 1.0),
    ("2 x 3 = 6", "6", 1.0),
    ("2 x 3 = 7", "7", 0.0),
    ("3 / 6 = 50%", "50", 1.0),
    ("She has 48/2 = <<48/2=24>>24 clips", "24", 1.0),  # GSM8K's calculator annotations
    ("Day 1 = 5 + 3 = 8", "8", 1.0),           # `1 = 5 + 3` shows no computation on its left
    ("2 apples * 3 + 4 = 10", "10", 1.0),      # `* 3 + 4` is the end of a computation, not judged
    ("3 / 2 = 1 1/2", "1.5", 1.0),              # a mixed number is not read, not judged
])
def test_arithmetic_reads_working_as_written(working, answer, expected):
    assert rewards.arithmetic(f"{working}\n#### {answer}", f"#### {answer}") == expected


@pytest.mark.parametrize("written, value", [
    (".5", "0.5"),
    ("+5", "5"),
    ("$18", "18"),
    ("$ 18", "18"),
    ("1,000", "1000"),
    ("-3", "-3"),
    ("1,000.50", "1000.5"),
])
def test_answers_as_written_are_numbers(written, value):
    assert rewards.gsm8k(f"#### {written}", f"#### {written}") == 1.0
    assert rewards.gsm8k(f"#### {written}", f"#### {value}") == 1.0
    assert rewards.gsm8k(f"#### {value}", f"#### {written}") == 1.0
    assert rewards.gsm8k_flexible(f"#### {written}", f"#### {written}") == 1.0
    assert rewards.gsm8k_flexible(f"so the answer is {written}.", f"#### {value}") == 1.0


@pytest.mark.parametrize("written, other", [(".5", "5"), ("-3", "3"), ("1,000.50", "1000"), ("1,000", "1")])
def test_answers_as_written_are_read_whole(written, other):
    assert rewards.gsm8k(f"#### {written}", f"#### {other}") == 0.0
    assert rewards.gsm8k_flexible(f"so the answer is {written}.", f"#### {other}") == 0.0


@pytest.mark.parametrize("written, prefix", [("1,0002", "1000"), ("1,000,00", "1000"), ("3/4", "3"), ("12/4", "12"),
                                             ("1.2.3", "1.2")])
def test_an_answer_is_not_read_as_a_prefix_of_what_follows_the_marker(written, prefix):
    # Before, the strict reading took the longest number at the start of `#### 1,0002` (`1,000`) or `#### 3/4` (`3`),
    # so a wrong answer scored full marks against the reference `#### 1000` or `#### 3`.
    assert rewards.gsm8k(f"#### {written}", f"#### {prefix}") == 0.0
    assert not rewards.has_answer_format(f"#### {written}")
    assert rewards.gsm8k(f"#### {prefix}. Then 4", f"#### {prefix}") == 1.0  # a sentence's period still ends it


def test_every_gsm8k_test_answer_scores_full_marks_against_itself():
    test_file = GSM8K / "test.jsonl"
    if not test_file.exists():
        pytest.skip(f"GSM8K is not at {test_file}")
    answers = [json.loads(line)["answer"] for line in test_file.read_text().splitlines()]
    assert len(answers) == 1319
    assert [answer for answer in answers if rewards.gsm8k(answer, answer) != 1.0] == []
    assert [answer for answer in answers if rewards.gsm8k_flexible(answer, answer) != 1.0] == []


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
    # A user's own `data.py` (or `model.py`) beside the run is shadowed by the trainer's package of that name: said so
    # (before: "cannot load `my_reward` from module `data`... Put the module on PYTHONPATH", where it was).
    ("data:my_reward", "`data` is this trainer's own package"),
    ("model:my_reward", "which has no `my_reward`: a file of yours of that name is shadowed by it. Rename your file "
                        "(`my_model.py`, say)"),
    # Called as f(completion, reference): a function of one text is refused at start-up, not after a step's rollouts.
    ("data.rewards:has_answer_format", "is called as `has_answer_format(completion, reference)` with two texts"),
])
def test_unknown_reward_is_a_user_error_naming_the_key(name, expected):
    with pytest.raises(UserError) as error:
        rewards.get_reward(name)
    assert expected in str(error.value) and "--grpo.reward" in str(error.value)


USER_REWARDS = '''
import os, sys, time

class Unreadable(Exception):
    def __init__(self, first, second):
        super().__init__(f"{first} {second}")

def graded(completion, reference):
    if "boom" in completion:
        raise ValueError("cannot parse " + completion)
    if "odd" in completion:
        raise Unreadable("needs", "two")   # pickles, but cannot be read back
    if "object" in completion:
        return (lambda: 1.0)               # cannot be sent back
    if "hang" in completion:
        time.sleep(600)
    if "spin" in completion:
        while True:
            pass
    if "exit" in completion:
        sys.exit(3)                        # its worker ends
    return (len(completion) / 10, "####" in completion)

def always_hangs(completion, reference):
    time.sleep(600)
'''


@pytest.mark.slow
def test_a_users_reward_runs_in_workers_and_a_call_past_its_timeout_is_stopped(tmp_path, monkeypatch):
    """`module:function` rewards run in worker processes (`grpo.reward_timeout`): the same scores as in the trainer's
    process; a call that sleeps or spins is stopped at the timeout and scores 0 as a TimeoutError (a hanging reward
    function hung the run: it was called in the trainer with no limit); one that always hangs costs a few timeouts, not one per completion."""
    import time

    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    in_process = rewards.get_reward("user_rewards:graded", timeout=0)
    isolated = rewards.get_reward("user_rewards:graded", timeout=2.0, workers=2)
    assert not isinstance(in_process, rewards.IsolatedReward) and isinstance(isolated, rewards.IsolatedReward)
    try:
        plain = ["#### 8", "no answer", "boom here", "odd one", "object", "#### 12345678"]
        local, remote = rewards.score(in_process, plain, [REFERENCE] * 6), rewards.score(isolated, plain, [REFERENCE] * 6)
        assert remote.rewards == local.rewards == [0.6, 0.9, 0.0, 0.0, 0.0, 1.3]
        assert remote.correct == local.correct == [True, False, False, False, False, True]
        assert remote.errors == local.errors == 3
        # Where in the user's file it raised: said in the paragraph that stops a run (before, the error alone).
        assert remote.failures["ValueError"] == local.failures["ValueError"] == (
            f"`user_rewards:graded` raised ValueError: cannot parse boom here (raised at {tmp_path / 'user_rewards.py'}, "
            "line 10) (on the completion 'boom here')")
        # An exception that cannot be read back arrives as its text; a value that cannot be sent is a failure.
        assert "raised RuntimeError: Unreadable: needs two (on the completion 'odd one')" in remote.failures["RuntimeError"]
        assert rewards.score(isolated, ["object"], [REFERENCE]).failures["RuntimeError"].startswith(
            "`user_rewards:graded` raised RuntimeError: its return value could not be sent from the worker process")
        started = time.monotonic()
        stuck = rewards.score(isolated, ["#### 8", "hang", "spin", "no answer"], [REFERENCE] * 4)
        assert time.monotonic() - started < 10
        assert stuck.rewards == [0.6, 0.0, 0.0, 0.9] and stuck.errors == 2
        assert "did not answer within 2 s (grpo.reward_timeout)" in stuck.failures["TimeoutError"]
        # The stopped calls' workers were killed; the next batch starts fresh ones.
        assert rewards.score(isolated, ["#### 8"], [REFERENCE]).rewards == [0.6]
    finally:
        rewards.close(isolated)
    # A worker that ended is never handed the next call (its closed pipe failed every later call of the batch).
    alone = rewards.get_reward("user_rewards:graded", timeout=5.0, workers=1)
    try:
        for _ in range(3):
            exited = rewards.score(alone, ["exit", "#### 8", "#### 8", "#### 8"], [REFERENCE] * 4)
            assert exited.errors == 1 and exited.rewards == [0.0, 0.6, 0.6, 0.6], exited.failures
            assert "the worker process running it ended (exit status 3)" in exited.failures["RuntimeError"]
    finally:
        rewards.close(alone)
    hanging = rewards.get_reward("user_rewards:always_hangs", timeout=1.0, workers=1)
    try:
        started = time.monotonic()
        scores = rewards.score(hanging, ["a"] * 50, [REFERENCE] * 50)
        # GIVE_UP calls on the one worker timed out, and nothing answered: the other calls are not made.
        assert time.monotonic() - started < 1.0 * rewards.IsolatedReward.GIVE_UP + 5
        assert scores.errors == 50 and scores.rewards == [0.0] * 50
    finally:
        rewards.close(hanging)


def test_an_async_reward_is_awaited_in_the_trainer_and_in_worker_processes(tmp_path, monkeypatch):
    # Before, its coroutine failed as no number (2 errors of 2, every completion scored 0), in the trainer and in workers.
    (tmp_path / "async_rewards.py").write_text("async def graded(completion, reference):\n    return len(completion) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    isolated = rewards.get_reward("async_rewards:graded", timeout=30.0, workers=1)
    try:
        for reward in (rewards.get_reward("async_rewards:graded", timeout=0), isolated):
            scores = rewards.score(reward, ["#### 8", "no answer"], [REFERENCE] * 2)
            assert scores.rewards == [0.6, 0.9] and scores.errors == 0
    finally:
        rewards.close(isolated)


def test_a_built_in_reward_on_references_without_an_answer_line_is_refused_when_it_is_the_whole_signal(caplog):
    """GRPO with the default reward on a user's own rows (`{"question": "What is 3 plus 3?", "answer": "6"}`) ran with
    every reward 0 (a 1-step run: reward_mean=0, loss=0, grad_norm=0), without a word."""
    from types import SimpleNamespace

    from config.sections import GRPOSection

    plain = [SimpleNamespace(reference=str(number)) for number in range(5)]
    grpo = GRPOSection()
    assert grpo.reward in rewards.GRADE_AGAINST_ANSWER_LINE  # the default
    with pytest.raises(UserError, match=r"`grpo.reward=arithmetic` grades each completion against its reference's GSM8K "
                                        r"answer line \(`#### N`\), and none of the 5 references of qa.jsonl read has one "
                                        r"\(e.g. '0'\).*`--grpo.reward module:function`"):
        rewards.check_references_graded(grpo, plain, "qa.jsonl")
    # Another part of the reward, or some references with the line: said, not refused; `none` and your own read none.
    for changes in ({"reward_model": "rm/hf"}, {"environment": "guess:Guess"}, {"teacher": "big/hf"}, {"format_bonus": 0.1}):
        with caplog.at_level("WARNING", logger="data.rewards"):
            caplog.clear()
            rewards.check_references_graded(GRPOSection(**changes), plain, "qa.jsonl")
        assert "5 of the first 5 references of qa.jsonl have no GSM8K answer line" in caplog.text
    caplog.clear()
    rewards.check_references_graded(grpo, plain + [SimpleNamespace(reference="3 + 3 = 6\n#### 6")], "qa.jsonl")
    assert "5 of the first 6 references" in caplog.text
    for name in ("none", "user_rewards:graded"):
        rewards.check_references_graded(GRPOSection(reward=name), plain, "qa.jsonl")
    rewards.check_references_graded(grpo, [SimpleNamespace(reference="#### 6")], "qa.jsonl")


def test_a_graded_rewards_verdict_must_be_true_or_false():
    """`(reward, correct)` with a text verdict: `bool("False")` is True, so every such completion counted correct (in
    `accuracy`, and in what DAPO's filter reads). Now a failure, counted and said; None leaves it to full marks."""
    def graded(completion, reference):
        return {"text": (0.5, "False"), "half": (0.5, 0.5), "numpy": (0.2, numpy.bool_(True)), "int": (0.3, 0),
                "none": (1.0, None)}[completion]

    import numpy

    scores = rewards.score(graded, ["text", "half", "numpy", "int", "none"], [REFERENCE] * 5)
    assert scores.rewards == [0.0, 0.0, 0.2, 0.3, 1.0]
    assert scores.correct == [False, False, True, False, True]
    assert scores.errors == 2
    assert scores.failures["TypeError"].endswith(
        "graded` raised TypeError: it returned (reward, str 'False'): `correct` is not true or false (on the completion "
        "'text')")


def test_held_out_references_without_an_answer_line_are_said_naming_the_held_out_file(tmp_path, caplog):
    """GRPO checked only the training references for the `#### N` line its built-in rewards grade against: a held-out
    file whose answers are plain numbers (`{"answer": "2"}`) gave eval_accuracy=0 at every evaluation, whatever the
    policy answered, without a word. Now a warning names the held-out file and the count."""
    from config.loops import GRPOConfig
    from model.tiny import ensure_tiny_checkpoint
    from trainer.grpo import load_tokenizer_and_prompts

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"{index} + 1", "answer": f"#### {index + 1}"})
                                                  + "\n" for index in range(4)))
    held_out = tmp_path / "held.jsonl"
    held_out.write_text("".join(json.dumps({"question": f"{index} + 2", "answer": str(index + 2) if index else "#### 2"})
                                + "\n" for index in range(4)))
    config = GRPOConfig()
    config.data.path, config.data.eval_path, config.data.cache = str(tmp_path / "train.jsonl"), str(held_out), False
    with caplog.at_level("WARNING", logger="data.rewards"):
        *_, eval_prompts = load_tokenizer_and_prompts(config, ensure_tiny_checkpoint(), None, 1)
    assert len(eval_prompts) == 4
    # (4 prompts, fewer than a step's 64 at the defaults: `trainer` warns of that too.)
    assert [record.getMessage() for record in caplog.records if record.name == "data.rewards"] == [
        f"3 of the first 4 references of `{held_out}` (test) have no GSM8K answer line (`#### N`), which "
        "`grpo.reward=arithmetic` grades against: their completions score 0 under it, and eval_accuracy counts "
        "them wrong whatever the policy answers"]


def test_a_reward_hanging_on_one_prompts_group_does_not_fail_the_rest_of_the_batch(tmp_path, monkeypatch):
    """A grader that hangs on one reference (a symbolic simplifier on a pathological answer) times out on every
    completion of that prompt's group. The calls run first to see whether the reward always hangs were the batch's
    first ones, that one group's: all timed out, so the other groups' calls were never made and scored 0 (4 groups of
    4 on a rank: 16 of 16 failed, the 12 that score 1.0 included; alone on a rank, the run stopped as if the reward
    always failed). They are spread over the batch now: only the hanging group's 4 fail."""
    (tmp_path / "hangs_on_one.py").write_text("import time\n\ndef graded(completion, reference):\n"
                                              "    if reference == '#### 1':\n        time.sleep(600)\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    isolated = rewards.get_reward("hangs_on_one:graded", timeout=1.0, workers=2)
    try:
        references = [f"#### {group}" for group in (1, 2, 3, 4) for _ in range(4)]  # 4 prompts x grpo.n_samples=4
        scores = rewards.score(isolated, ["#### 1"] * 16, references)
        assert scores.rewards == [0.0] * 4 + [1.0] * 12 and scores.errors == 4
        assert "did not answer within 1 s (grpo.reward_timeout)" in scores.failures["TimeoutError"]
    finally:
        rewards.close(isolated)
