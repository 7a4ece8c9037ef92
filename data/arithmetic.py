"""Seeded, offline arithmetic word problems in GSM8K's answer format (reasoning, then `#### N`)."""

import operator
import random
import re

TRAIN_SEED = 1234
EVAL_SEED = 5678

NAMES = ["Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Zoe"]
OBJECTS = ["apples", "books", "coins", "pencils", "stickers", "marbles"]

# Each template: (operator symbol, operand ranges, question text). Ranges are kept small so that a
# ~1M parameter model can learn the whole table in a few hundred CPU steps.
TEMPLATES = [
    ("+", (0, 20), (0, 20), "{name} has {a} {thing} and buys {b} more. How many {thing} does {name} have now?"),
    ("+", (0, 20), (0, 20), "{name} found {a} {thing} on Monday and {b} {thing} on Tuesday. How many {thing} did {name} find in all?"),
    ("-", (0, 20), (0, 20), "{name} has {a} {thing} and gives {b} to a friend. How many {thing} does {name} have left?"),
    ("-", (0, 20), (0, 20), "{name} had {a} {thing} and lost {b} of them. How many {thing} are left?"),
    ("*", (2, 9), (2, 9), "{name} has {a} bags with {b} {thing} in each bag. How many {thing} does {name} have in total?"),
]

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

# A number as GSM8K writes it: optional sign, optional thousands commas, optional decimals.
NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"


def generate_problems(count: int, seed: int) -> list[dict]:
    """Return `count` problems `{"question", "answer"}`, deterministic for a given seed."""
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        symbol, a_range, b_range, text = rng.choice(TEMPLATES)
        a, b = rng.randint(*a_range), rng.randint(*b_range)
        if symbol == "-" and b > a:
            # Subtraction must not go below zero in a story about counting things.
            a, b = b, a
        result = OPERATIONS[symbol](a, b)
        question = text.format(name=rng.choice(NAMES), thing=rng.choice(OBJECTS), a=a, b=b)
        problems.append({"question": question, "answer": f"{a} {symbol} {b} = {result}\n#### {result}"})
    return problems


def training_text(count: int = 2000) -> str:
    """Return questions and answers from the training seed, joined as tokenizer-training text."""
    problems = generate_problems(count, TRAIN_SEED)
    return "\n\n".join(f"{problem['question']}\n{problem['answer']}" for problem in problems)


def extract_final_answer(text: str, strict: bool = True) -> str | None:
    """Return the number after the last `####` (strict) or the last number in the text, or None."""
    if strict:
        marker = text.rfind("####")
        if marker < 0:
            return None
        match = re.match(rf"\s*\$?({NUMBER})", text[marker + 4 :])
        return match.group(1).replace(",", "") if match else None
    numbers = re.findall(NUMBER, text)
    return numbers[-1].replace(",", "") if numbers else None
