"""Unit tests for the bundled tool task: the calculator tool, its schema, and the seeded problems and conversations."""

import re

import pytest
from transformers.utils import get_json_schema

from config.errors import UserError
from data import arithmetic, calculator as task
from data.calculator import calculator, generate_problems, load_split
from model.tiny import build_tokenizer

# --- the tool --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("347 * 29", "10063"),
        ("1234 + 8766", "10000"),
        ("7 / 2", "3.5"),
        ("(1234 + 8766) / 4", "2500"),
        ("2 * (3 - 5)", "-4"),
        ("-(6 + 4) * 3", "-30"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.3333333333"),
        ("  12 - 12.0 ", "0"),
    ],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression, error",
    [
        ("x + 1", ValueError),
        ("__import__('os')", ValueError),
        ("abs(-3)", ValueError),
        ("2 ** 3", ValueError),
        ("1e999999999", ValueError),
        ("'5' * 3", ValueError),
        ("1 +", ValueError),
        ("1" * 201, ValueError),
        (347, ValueError),
        ("1 / 0", ZeroDivisionError),
        ("5 / (3 - 3)", ZeroDivisionError),
    ],
)
def test_calculator_refusals(expression, error):
    with pytest.raises(error) as raised:
        calculator(expression)
    assert type(raised.value) is error and str(raised.value)


def test_calculator_schema_names_a_required_string_expression():
    function = get_json_schema(calculator)["function"]
    assert function["name"] == "calculator" and function["description"]
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert function["parameters"]["properties"]["expression"]["description"]


# --- problems --------------------------------------------------------------------------------


def uses_tool(row: dict) -> bool:
    """Whether the row's conversation calls the calculator."""
    return len(row["messages"]) == 4


def test_generation_is_deterministic_per_seed():
    assert generate_problems(50, seed=3, tool_share=0.5) == generate_problems(50, seed=3, tool_share=0.5)
    assert generate_problems(50, seed=3) != generate_problems(50, seed=4)
    assert task.TRAIN_SEED != task.EVAL_SEED
    assert {task.TRAIN_SEED, task.EVAL_SEED}.isdisjoint({arithmetic.TRAIN_SEED, arithmetic.EVAL_SEED})


@pytest.mark.parametrize("count, share", [(40, 0.0), (40, 0.5), (7, 0.3), (40, 1.0)])
def test_tool_share_is_exact_and_leaves_the_problems_alone(count, share):
    rows = generate_problems(count, seed=11, tool_share=share)
    assert sum(map(uses_tool, rows)) == round(share * count)
    problems = [(row["question"], row["answer"]) for row in rows]
    assert problems == [(row["question"], row["answer"]) for row in generate_problems(count, seed=11)]


def test_answers_are_correct_and_conversations_well_formed():
    schema = get_json_schema(calculator)
    rows = generate_problems(300, seed=task.EVAL_SEED, tool_share=0.5)
    for row in rows:
        reasoning, final_line = row["answer"].split("\n")
        left, symbol, right, result = re.fullmatch(r"(\d+) ([+*]) (\d+) = (\d+)", reasoning).groups()
        a, b = int(left), int(right)
        assert int(result) == (a + b if symbol == "+" else a * b)
        assert symbol == "*" and 11 <= a <= 99 and 11 <= b <= 99
        assert final_line == f"#### {result}"
        assert re.findall(r"\d+", row["question"]) == [left, right]
        assert row["tools"] == [schema]
        user, *middle, final = row["messages"]
        assert user == {"role": "user", "content": row["question"]}
        assert final == {"role": "assistant", "content": row["answer"]}
        if middle:
            call, response = middle
            assert call["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": f"{a} {symbol} {b}"}}
            assert response == {"role": "tool", "name": "calculator", "content": result}
    assert {symbol for symbol, *_ in task.TEMPLATES} == {"*"}


def test_load_split_applies_the_tool_share_to_sft_train_targets_only(monkeypatch):
    monkeypatch.setitem(task.SPLITS, "train", (40, task.TRAIN_SEED))
    assert sum(map(uses_tool, load_split("train", sft_targets=True))) == round(task.SFT_TOOL_SHARE * 40)
    assert not any(map(uses_tool, load_split("train", sft_targets=False)))
    assert not any(map(uses_tool, load_split("test", sft_targets=True)))
    assert len(load_split("test", sft_targets=False)) == task.SPLITS["test"][0]
    with pytest.raises(UserError, match="'test', 'train'"):
        load_split("eval", sft_targets=False)


def test_tool_conversation_renders_with_the_tiny_chat_template():
    row = next(row for row in generate_problems(10, seed=5, tool_share=0.5) if uses_tool(row))
    text = build_tokenizer().apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
    expression = row["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]
    assert "<tool_call>" in text and expression in text.split("<tool_call>")[1]
    assert "<tool_response>" in text and row["messages"][2]["content"] in text.split("<tool_response>")[1]
