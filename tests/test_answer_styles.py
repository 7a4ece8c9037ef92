"""The bundled SFT targets in two answer styles, and the answer-form figures both loops log."""

import hashlib

from data import rewards
from data.arithmetic import generate_problems, training_text
from data.conversations import ARITHMETIC_SFT_PLAIN_SHARE, load_rows


def test_training_text_is_unchanged():
    """The tiny tokenizer is trained on it: any change would move every pinned SFT figure."""
    digest = hashlib.sha256(training_text().encode()).hexdigest()
    assert digest == "c8433c475476883f6a0b597d5baca56066b6366f79104e340b9026596ab6c08b"


def test_plain_share_changes_only_the_answer_line_of_a_seeded_share():
    gsm8k_style, mixed = generate_problems(400, seed=3), generate_problems(400, seed=3, plain_share=0.75)
    assert mixed == generate_problems(400, seed=3, plain_share=0.75)
    assert [row["question"] for row in mixed] == [row["question"] for row in gsm8k_style]
    plain = 0
    for before, after in zip(gsm8k_style, mixed):
        working, answer = before["answer"].split("\n")
        assert after["answer"].startswith(working + "\n")  # the working line `a op b = c` stays in both styles
        if after["answer"] != before["answer"]:
            plain += 1
            assert after["answer"] == f"{working}\nThe answer is {answer.removeprefix('#### ')}."
    assert plain == 300


def test_only_the_sft_train_split_is_mixed():
    sft_train = load_rows("arithmetic", sft_targets=True)
    assert sum("####" not in row["answer"] for row in sft_train) == round(ARITHMETIC_SFT_PLAIN_SHARE * len(sft_train))
    # GRPO's prompts (the train split) and every held-out reference keep `#### N`, which the reward grades.
    for rows in (load_rows("arithmetic"), load_rows("arithmetic", split="test", sft_targets=True)):
        assert all("\n#### " in row["answer"] for row in rows)


def test_scores_count_the_answer_forms():
    reference = "3 + 5 = 8\n#### 8"
    completions = ["3 + 5 = 8\n#### 8", "3 + 5 = 8\nThe answer is 8.", "3 + 5 = 9\n#### 9", "3 + 5 = 8", "nothing"]
    scores = rewards.score(rewards.arithmetic, completions, [reference] * 5)
    assert scores.in_format == [True, False, True, False, False]
    assert scores.right_answer == [True, True, False, True, False]
    assert scores.correct == [True, False, False, False, False]
    assert scores.totals() == {"reward": 1.0, "correct": 1, "errors": 0, "in_format": 2, "right_answer": 3}


def test_a_bare_number_reference_is_the_right_answer():
    """Data for a reward of your own may give the answer alone (`{"target": "8"}`): `answer_accuracy` (the reference's
    number as the completion's last number, in any form) read such a reference as having no answer, and logged 0 for
    every completion, the right ones included."""
    completions = ["3 + 5 = 8\n#### 8", "3 + 5 = 8\nThe answer is 8.", "3 + 5 = 9\n#### 9", "3 + 5 = 8", "nothing"]
    scores = rewards.score(rewards.gsm8k_flexible, completions, [" 8 "] * 5)
    assert scores.right_answer == [True, True, False, True, False]
    scores = rewards.score(rewards.gsm8k_flexible, completions, ["1,000", "8.0", "9", "eight", "8 apples"])
    assert scores.right_answer == [False, True, True, False, False]
