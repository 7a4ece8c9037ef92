"""The bundled tool task: seeded, offline word problems too large for the tiny model's head (products of two 2-digit
numbers, 3-4 digit results), and the `calculator` tool that solves them.

The stories, names and objects are data/arithmetic.py's; only the operands grow. SFT rows carry the conversation
(`messages`) and the tool's schema (`tools`); a seeded quarter of the training conversations (`SFT_TOOL_SHARE`) call
the tool.
"""

import ast
import copy
import fractions
import functools
import operator
import random
import re

from config.errors import UserError
from data import arithmetic

TRAIN_SEED = 4321
EVAL_SEED = 8765

# Products a ~1M parameter model cannot work out in its head (3-4 digit results) but whose 2-digit operands it can copy
# into a call, as it copies arithmetic's operands into its working; with 3-4 digit operands (tried first) the SFT model
# called the tool on 90% of held-out problems and got none right, miscopying the operands (docs/tools.md).
OPERAND_RANGES = {"*": ((11, 99), (11, 99))}
TEMPLATES = [
    (symbol, *OPERAND_RANGES[symbol], text) for symbol, _, _, text in arithmetic.TEMPLATES if symbol in OPERAND_RANGES
]

SPLITS = {"train": (4000, TRAIN_SEED), "test": (500, EVAL_SEED)}
# SFT's targets on the train split: this share calls the calculator, the rest answers in its head. The SFT model then
# knows the call's form but greedily answers in its head (the majority), while sampling calls now and then: a GRPO group
# holds tool-using rollouts (right) beside direct ones (wrong), and the reward teaches it to call. With half the rows
# calling, the SFT model already called on 90% of held-out problems greedily, leaving GRPO nothing to teach.
SFT_TOOL_SHARE = 0.25

MAX_EXPRESSION_LENGTH = 200
# Plain decimal literals only: Python's exponent form (`1e99999999`) would build a huge number from a few characters.
DECIMAL_LITERAL = re.compile(r"\d+\.?\d*|\.\d+")
BINARY_OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
UNARY_OPERATIONS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
RESULT_DECIMALS = 10


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses, and return the result.

    Args:
        expression: The expression to evaluate, for example "347 * 29" or "(1234 + 8766) / 4".

    Returns:
        The exact result; a non-integer one rounded to 10 decimal places.
    """
    if not isinstance(expression, str):
        raise ValueError(f"The expression must be a string, not {type(expression).__name__}.")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise ValueError(f"The expression is {len(expression)} characters long; the limit is {MAX_EXPRESSION_LENGTH}.")
    # ast.parse refuses leading spaces as an indent.
    expression = expression.strip()
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"{expression!r} is not an arithmetic expression ({error.msg}).") from None
    value = evaluate(tree.body, expression)
    return format_number(round(value, RESULT_DECIMALS))


def evaluate(node: ast.AST, expression: str) -> fractions.Fraction:
    """The exact value of one node of `expression`'s tree, refusing everything but numbers, + - * / and signs."""
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPERATIONS:
        left, right = evaluate(node.left, expression), evaluate(node.right, expression)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError(f"{expression!r} divides by zero.")
        return BINARY_OPERATIONS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPERATIONS:
        return UNARY_OPERATIONS[type(node.op)](evaluate(node.operand, expression))
    literal = ast.get_source_segment(expression, node)
    if isinstance(node, ast.Constant) and DECIMAL_LITERAL.fullmatch(literal):
        # From the text, not the parsed float, so that 0.1 + 0.2 is exactly 0.3.
        return fractions.Fraction(literal)
    raise ValueError(f"{literal!r} is not allowed in {expression!r}: use numbers, + - * / and parentheses only.")


def format_number(value: fractions.Fraction) -> str:
    """`value` (with at most RESULT_DECIMALS decimals) in plain decimal notation, an integer without `.0`."""
    if value.denominator == 1:
        return str(value.numerator)
    digits = str(abs(value) * 10**RESULT_DECIMALS).rjust(RESULT_DECIMALS + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-RESULT_DECIMALS]}.{digits[-RESULT_DECIMALS:].rstrip('0')}"


@functools.cache
def calculator_schema() -> dict:
    """The tool's schema, from its signature and docstring; computed on first use, so a tool worker process that
    imports this module for `calculator` does not import transformers (and torch with it, 0.5 GB)."""
    from transformers.utils import get_json_schema

    return get_json_schema(calculator)


def generate_problems(count: int, seed: int, tool_share: float = 0.0) -> list[dict]:
    """Return `count` rows `{"question", "answer", "messages", "tools"}`, deterministic for a given seed.

    A seeded `round(tool_share * count)` of the conversations (`messages`) call the calculator before answering; the
    rest answer directly. The problems themselves, and which ones call the tool, do not depend on anything else.
    """
    rng = random.Random(seed)
    # Its own generator, so the problems are the same whatever the share.
    tool_rows = set(random.Random(f"tool-{seed}").sample(range(count), round(tool_share * count)))
    problems = []
    for _ in range(count):
        symbol, a, b, result, question = arithmetic.draw_problem(rng, TEMPLATES)
        answer = f"{a} {symbol} {b} = {result}\n#### {result}"
        if len(problems) in tool_rows:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} {symbol} {b}"}}}
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": calculator(f"{a} {symbol} {b}")},
                {"role": "assistant", "content": answer},
            ]
        else:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        # A copy per row, so that a caller editing one row's schema does not edit every row's.
        tools = [copy.deepcopy(calculator_schema())]
        problems.append({"question": question, "answer": answer, "messages": messages, "tools": tools})
    return problems


def load_split(split: str, sft_targets: bool) -> list[dict]:
    """Return the rows of `split`; as SFT targets (`sft_targets`) a seeded SFT_TOOL_SHARE of the train rows call the tool."""
    if split not in SPLITS:
        raise UserError(f"The calculator data set has splits {sorted(SPLITS)}, not {split!r}.")
    tool_share = SFT_TOOL_SHARE if sft_targets and split == "train" else 0.0
    return generate_problems(*SPLITS[split], tool_share=tool_share)
