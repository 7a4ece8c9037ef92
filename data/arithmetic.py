"""Seeded, offline arithmetic word problems: the working `a op b = c`, then the answer as GSM8K writes it
(`#### N`) or, for a seeded share, as a plain sentence (`The answer is N.`)."""

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

# The problems never divide, but the `arithmetic` reward checks division in a model's working.
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}

# A number as GSM8K or a model writes it: optional sign, optional thousands commas, optional decimals,
# or decimals alone (`.5`).
NUMBER = r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"


def generate_problems(count: int, seed: int, plain_share: float = 0.0) -> list[dict]:
    """Return `count` problems `{"question", "answer"}`, deterministic for a given seed.

    A seeded `round(plain_share * count)` of them end in `The answer is N.` instead of `#### N`; the
    problems themselves, and which ones, do not depend on anything else.
    """
    rng = random.Random(seed)
    # Its own generator, so the problems are the same whatever the share.
    plain = set(random.Random(f"plain-{seed}").sample(range(count), round(plain_share * count)))
    problems = []
    for _ in range(count):
        symbol, a, b, result, question = draw_problem(rng, TEMPLATES)
        answer = f"The answer is {result}." if len(problems) in plain else f"#### {result}"
        problems.append({"question": question, "answer": f"{a} {symbol} {b} = {result}\n{answer}"})
    return problems


def draw_problem(rng: random.Random, templates: list) -> tuple[str, int, int, int, str]:
    """One problem from `rng`: (operator, a, b, result, question), a story of `templates` with the bundled names."""
    symbol, a_range, b_range, text = rng.choice(templates)
    a, b = rng.randint(*a_range), rng.randint(*b_range)
    if symbol == "-" and b > a:
        # Subtraction must not go below zero in a story about counting things.
        a, b = b, a
    result = OPERATIONS[symbol](a, b)
    return symbol, a, b, result, text.format(name=rng.choice(NAMES), thing=rng.choice(OBJECTS), a=a, b=b)


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
        # The number whole: not the start of a longer one (`1,0002`, `1.2.3`) or of a fraction (`3/4`).
        match = re.match(rf"\s*(?:\$\s*)?({NUMBER})(?![,./]?\d)", text[marker + 4 :])
        number = match.group(1) if match else None
    else:
        numbers = re.findall(NUMBER, text)
        number = numbers[-1] if numbers else None
    # Without commas or a plus sign, so that callers comparing the strings see `+1,000` and `1000` agree.
    return number.replace(",", "").removeprefix("+") if number is not None else None
