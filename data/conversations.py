"""Rows to chat conversations: reading rows (local JSON / JSONL / Parquet files through `data.local_files`, a hub
dataset, the bundled arithmetic task) and turning each into a `Conversation` of chat messages, with the tools it
offers; every row read is either used or counted in the `DropReport` under one reason.

Tool use: a messages row may hold assistant turns with `tool_calls`, `tool` messages with their results, and a
`tools` field with the JSON schemas of the tools offered (a list, or that list as JSON text). A row's conversation
is a `Conversation`, a list of messages that also carries those schemas, and every rendering of it passes them to
the chat template. A row with a broken tool call or a tool result without a call is dropped and counted like any
malformed row (`to_conversations`). SFT tokenizes the conversations (`data.sft`), GRPO prompts with them
(`data.prompts`).
"""

import collections
import dataclasses
import json
import logging
import pathlib

from config.errors import UserError
from config.sections import BUNDLED_DATA
from data.arithmetic import EVAL_SEED, TRAIN_SEED, generate_problems
from data.local_files import LOCAL_FORMATS, load_local

log = logging.getLogger(__name__)

ARITHMETIC_SPLITS = {"train": (10000, TRAIN_SEED), "test": (1000, EVAL_SEED), "eval": (1000, EVAL_SEED)}


# SFT's targets on the bundled train split: this share answers `The answer is N.`, the rest `#### N`. The SFT
# model then knows both styles and greedily prefers the plain one, which GRPO's `#### N` reward must teach it out
# of; GRPO's prompts and every held-out reference keep `#### N`.
ARITHMETIC_SFT_PLAIN_SHARE = 0.75


DROP_EXAMPLES_KEPT = 5


def looks_local(path: str) -> bool:
    """Whether `data.path` names a file on disk (a path, or a data file's suffix) rather than a hub dataset."""
    return path.startswith(("/", "./", "../", "~")) or pathlib.Path(path).suffix in LOCAL_FORMATS


def load_split(data, path: str, split: str, sft_targets: bool = False) -> list[dict]:
    """The rows of one split of `path` as the `data` section names it: `data.train_split` is trained on, any other
    (`data.eval_split`) is held out; `data.hub_config` picks a hub set's configuration."""
    return load_rows(path, split=split, hub_config=data.hub_config or None, sft_targets=sft_targets,
                     held_out=split != data.train_split)


def load_rows(path: str, *, split: str = "train", hub_config: str | None = None, sft_targets: bool = False,
              held_out: bool | None = None) -> list[dict]:
    """Return the rows of the bundled arithmetic set, a local json/jsonl/parquet file or folder, or a hub dataset.

    `held_out` (default: a split other than `train`): the split is held-out rows, never a folder's training files;
    the bundled sets then give their test split whatever the name, else their train split.
    `sft_targets`: the rows are SFT training targets; only the bundled train split differs then (a seeded
    `ARITHMETIC_SFT_PLAIN_SHARE` answers in the plain style).
    """
    held_out = split != "train" if held_out is None else held_out
    if path in BUNDLED_DATA and split not in ARITHMETIC_SPLITS:
        split = "test" if held_out else "train"  # a split name set for the user's own data
    if path == "arithmetic":
        if split not in ARITHMETIC_SPLITS:
            raise UserError(f"The arithmetic data set has splits {sorted(ARITHMETIC_SPLITS)}, not {split!r}.")
        plain_share = ARITHMETIC_SFT_PLAIN_SHARE if sft_targets and split == "train" else 0.0
        return generate_problems(*ARITHMETIC_SPLITS[split], plain_share=plain_share)
    if path == "calculator":  # the bundled tool task
        from data import calculator  # imported where used: only the bundled tool task needs it

        return calculator.load_split(split, sft_targets)
    local = pathlib.Path(path).expanduser()
    if local.exists():
        return load_local(local, split, held_out)
    if looks_local(path):
        raise UserError(f"data.path points to {path!r}, which does not exist. Set data.path to an existing "
                        ".json, .jsonl or .parquet file, a folder of them, 'arithmetic', or a hub dataset name.")
    import datasets  # imported where used: 3-4 s of start-up (pandas, pyarrow) that the bundled data never needs

    try:
        return datasets.load_dataset(path, hub_config, split=split).to_list()
    except Exception as error:
        raise UserError(f"data.path {path!r} (config {hub_config!r}, split {split!r}) was not found locally and "
                        f"could not be loaded from the Hugging Face hub ({error}). Machines without internet "
                        "cannot download; set data.path to a local .json, .jsonl or .parquet file or folder."
                        ) from error


class Conversation(list):
    """A conversation's messages (a list of message dicts), carrying the tool schemas its row offers in `tools`.

    It indexes, slices and compares as the plain list of its messages (equality ignores `tools`); a plain list
    of messages is read as a conversation without tools."""

    def __init__(self, messages: list[dict], tools: list | None = None):
        super().__init__(messages)
        self.tools = tools


def conversation_tools(messages: list[dict]) -> list | None:
    """Return the tool schemas a conversation offers: a `Conversation`'s `tools`, None for a plain list."""
    return messages.tools if isinstance(messages, Conversation) else None


@dataclasses.dataclass
class DropReport:
    """Counts of rows read, kept and dropped (by reason), plus the first few dropped rows."""

    rows_read: int = 0
    kept_rows: list[int] = dataclasses.field(default_factory=list)
    dropped_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    first_drops: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    truncated: int = 0

    @property
    def used(self) -> int:
        """Return how many rows survived every stage so far."""
        return len(self.kept_rows)

    @property
    def dropped(self) -> int:
        """Return how many rows were dropped, over all reasons."""
        return sum(self.dropped_by_reason.values())

    def drop(self, row: int, reason: str) -> None:
        """Count row `row` as dropped for `reason`."""
        self.dropped_by_reason[reason] += 1
        if len(self.first_drops) < DROP_EXAMPLES_KEPT:
            self.first_drops.append((row, reason))

    def summary(self) -> str:
        """Return a one-line account of the rows used, dropped and truncated."""
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(self.dropped_by_reason.items()))
        first = ", ".join(f"row {row} ({reason})" for row, reason in self.first_drops)
        return (f"{self.used} of {self.rows_read} rows used, {self.dropped} dropped ({reasons or 'none'}), "
                f"{self.truncated} truncated" + (f"; first dropped: {first}" if first else ""))


def check_columns(rows: list[dict], *, prompt_field: str, response_field: str, messages_field: str | None,
                  source: str) -> None:
    """Refuse rows without the columns the `data` section names (`data.messages_field`, else `data.prompt_field` and
    `data.response_field`), naming the key; `source` names the file and split."""
    if not rows:
        raise UserError(f"{source} holds no rows; point data.path (or data.eval_path) at a non-empty data set.")
    columns = sorted({key for row in rows for key in row})
    wanted = {"data.messages_field": messages_field} if messages_field else {
        "data.prompt_field": prompt_field, "data.response_field": response_field}
    chat = [column for column in columns if any(holds_messages(row.get(column)) for row in rows[:100])]
    for key, field in wanted.items():
        if field not in columns:
            hint = (f" The column {chat[0]!r} holds chat messages: set data.messages_field={chat[0]} to read them."
                    if chat and not messages_field else
                    " The rows have the data.prompt_field and data.response_field columns "
                    f"({prompt_field!r}, {response_field!r}): leave data.messages_field unset to read them."
                    if messages_field and {prompt_field, response_field} <= set(columns) else "")
            raise UserError(f"{key} is {field!r}, but {source} has no such column; its columns are {columns}.{hint} "
                            f"{'Or set' if hint else 'Set'} {key} to one of them (it names the column of the training and held-out data alike).")


def holds_messages(value) -> bool:
    """Whether a row's value is a list of chat messages (dicts with a role), as `data.messages_field` reads."""
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) and "role" in item for item in value)


def to_conversations(rows: list[dict], *, prompt_field: str = "question", response_field: str = "answer",
                     messages_field: str | None = None, source: str = "data.path",
                     reference_last: bool = False) -> tuple[list[Conversation], DropReport]:
    """Map rows to conversations, skipping malformed rows and counting them in a `DropReport`; errors name the rows'
    `source` (the file and split: a held-out file's are not the training file's).

    A messages row's `tools` field becomes its conversation's `tools`; other rows offer none. A row with a broken tool
    call (arguments that are not JSON, or not a JSON object; no function name) or a tool result without a call
    before it (more `tool` messages than calls since the last assistant turn) is skipped and counted under that
    reason, like every malformed row, so none of it is trained on; the callers log `report.summary()`, which names
    the first rows skipped and why. Only when no row is left is it a UserError. With `reference_last` (prompts for
    generation: the turns before the last assistant turn, the reference) a messages row whose last turn is not an
    assistant turn is skipped too: the turns after that one would be left out of its prompt without a word."""
    check_columns(rows, prompt_field=prompt_field, response_field=response_field, messages_field=messages_field,
                  source=source)
    report = DropReport(rows_read=len(rows))
    conversations = []
    for index, row in enumerate(rows):
        if messages_field:
            messages = row.get(messages_field)
            tools, tools_reason = row_tools(row.get("tools"))
            reason = messages_problem(messages, messages_field) or tools_reason
            if not reason and reference_last and messages[-1]["role"] != "assistant":
                reason = f"ends with a {messages[-1]['role']} turn, not the assistant's reference"
        else:
            messages = [{"role": "user", "content": row.get(prompt_field)},
                        {"role": "assistant", "content": row.get(response_field)}]
            tools, reason = None, pair_problem(row, prompt_field, response_field)
        if reason:
            report.drop(index, reason)
            continue
        conversations.append(Conversation([copied_message(message) for message in messages], tools))
        report.kept_rows.append(index)
    if not conversations:
        raise UserError(f"{source} gave no usable rows: {report.summary()}. Point data.path (or data.eval_path) at data with "
                        "non-empty prompts and responses, or fix the field settings (data.messages_field: a column of "
                        "role/content messages; else data.prompt_field and data.response_field: text columns).")
    return conversations, report


def pair_problem(row: dict, prompt_field: str, response_field: str) -> str | None:
    """Return why a row's prompt/response pair is unusable, or None when it is fine; the reason names the field."""
    for field in (prompt_field, response_field):
        if row.get(field) is None:
            return f"missing {field!r}"
    for field in (prompt_field, response_field):
        if not isinstance(row[field], str):
            return f"{field!r} not a string ({type(row[field]).__name__})"
    return "empty response" if not row[response_field].strip() else None


def messages_problem(messages, field: str) -> str | None:
    """Return why a row's list of chat messages (its `field`) is unusable, or None when it is fine."""
    if messages is None:
        return f"missing {field!r}"
    if not isinstance(messages, list):
        return f"{field!r} not a list ({type(messages).__name__})"
    if not all(isinstance(message, dict) and isinstance(message.get("role"), str) for message in messages):
        sharegpt = any(isinstance(message, dict) and isinstance(message.get("from"), str) for message in messages)
        return "ShareGPT's from/value messages, not role/content" if sharegpt else "malformed messages"
    for message in messages:
        reason = message_problem(message)
        if reason:
            return reason
    # Each tool result answers a call of the assistant turn before it; a result beyond those calls answers nothing,
    # and the model would learn to continue after a call it never made.
    unanswered_calls = 0
    for message in messages:
        if message["role"] == "assistant":
            unanswered_calls = len(message.get("tool_calls") or [])
        elif message["role"] == "tool":
            if unanswered_calls == 0:
                return "tool result without a call"
            unanswered_calls -= 1
    if not any(says_something(message) for message in messages
               if message["role"] == "assistant" and message.get("weight") != 0):
        return "no assistant turn"
    # The assistant header is found by rendering the turns before it, so there must be some.
    return "starts with assistant turn" if messages[0]["role"] == "assistant" else None


def says_something(message: dict) -> bool:
    """Whether a turn holds more than its end: text that is not blank, or tool calls."""
    return bool((message_text(message.get("content")) or "").strip() or message.get("tool_calls"))


def message_problem(message: dict) -> str | None:
    """Return why one chat message (a dict with a string role) is unusable, or None when it is fine."""
    content, tool_calls = message.get("content"), message.get("tool_calls")
    if tool_calls is not None:
        if message["role"] != "assistant" or not isinstance(tool_calls, list):
            return "malformed tool call"
        reason = next(filter(None, map(tool_call_problem, tool_calls)), None)
        if reason:
            return reason
        if content is None and tool_calls:
            return None  # a turn of tool calls alone
    if isinstance(content, list) and message_text(content) is None:
        kinds = sorted({str(part.get("type")) for part in content if isinstance(part, dict)} - {"text"})
        return f"content parts not text ({', '.join(kinds) or 'not parts'})"
    if message["role"] == "assistant" and message.get("weight") not in (None, 0, 1):
        return "assistant weight not 0 or 1"  # OpenAI's fine-tuning form: 0 leaves the turn out of the loss
    if message["role"] == "tool":
        names_are_strings = all(isinstance(message.get(key), (str, type(None))) for key in ("name", "tool_call_id"))
        return None if message_text(content) is not None and names_are_strings else "malformed tool message"
    return None if message_text(content) is not None else "malformed messages"


def message_text(content) -> str | None:
    """A message's content as text: a string as it is, a list of text parts (OpenAI's `[{"type": "text", "text": ...}]`)
    as their texts one after another, as the chat templates that take parts write them; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    return None


def named_function(entry) -> dict | None:
    """Return the function of a tool call or tool schema when it has a name, otherwise None.

    Both forms are read: OpenAI's `{"type": "function", "function": {"name", ...}}` and the flat `{"name", ...}`."""
    function = entry.get("function", entry) if isinstance(entry, dict) else None
    has_name = isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"].strip()
    return function if has_name else None


def tool_call_problem(call) -> str | None:
    """Return why one tool call is unusable (the reason a row is dropped for), or None when it is fine.

    Arguments are a dict, or JSON text of one (as the OpenAI API writes them)."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return "malformed tool call"
    if named_function(call) is None:
        return "tool call without a name"
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return "tool call arguments not JSON"
    return None if isinstance(arguments, dict) else "tool call arguments not an object"


def tool_call_function(call) -> dict | None:
    """Return a tool call's `{"name", "arguments"}` with the arguments as a dict, or None when it is malformed."""
    if tool_call_problem(call):
        return None
    function = named_function(call)
    arguments = function.get("arguments")
    return {"name": function["name"],
            "arguments": json.loads(arguments) if isinstance(arguments, str) else without_nulls(arguments)}


def without_nulls(value):
    """`value` with every mapping's null entries left out, at any depth. A Parquet table (the hub's format, or rows
    written by pandas or pyarrow) holds one schema for a column, so each row's tool-call arguments and tool schemas
    came back with every other row's names as nulls: `{"city": null, "expression": "2+3"}` was trained on, and offered
    as a tool's parameter. Arguments and schemas given as JSON text keep theirs: no table schema touched them."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def copied_message(message: dict) -> dict:
    """Return the parts of a checked message that the chat template reads.

    Those are the role, the content ("" for a turn of tool calls alone), tool calls in the OpenAI form with dict
    arguments and their `id` (Mistral's template writes it into the call the model learns, and refuses a call
    without one), a tool message's `name` and `tool_call_id`, and an assistant turn's `reasoning_content` (Qwen3's and
    DeepSeek-R1's templates render it in a think block) and its `weight` of 0 (OpenAI's fine-tuning form: a turn
    shown as context, not learned; `data.sft.split_turns` reads it)."""
    kept = {"role": message["role"], "content": message_text(message.get("content")) or ""}
    if message.get("tool_calls"):
        kept["tool_calls"] = [{**({"id": call["id"]} if isinstance(call.get("id"), str) else {}), "type": "function",
                               "function": tool_call_function(call)} for call in message["tool_calls"]]
    if message["role"] == "tool":
        kept |= {key: message[key] for key in ("name", "tool_call_id") if isinstance(message.get(key), str)}
    if message["role"] == "assistant" and isinstance(message.get("reasoning_content"), str):
        kept["reasoning_content"] = message["reasoning_content"]
    if message["role"] == "assistant" and message.get("weight") == 0:
        kept["weight"] = 0
    return kept


def row_tools(tools) -> tuple[list[dict] | None, str | None]:
    """Return a row's tool schemas (None when it offers none) and why they are unusable (None when fine).

    `tools` is a list of OpenAI function schemas (`{"type": "function", "function": {"name", "description",
    "parameters"}}`, or the flat function), or that list as JSON text; the schemas are passed on as they are, but for
    a list's null entries (`without_nulls`)."""
    as_text = isinstance(tools, str) and tools.strip()
    if as_text:
        try:
            tools = json.loads(tools)
        except ValueError:
            return None, "malformed tools"
    if not tools:
        return None, None
    if not isinstance(tools, list) or not all(map(named_function, tools)):
        return None, "malformed tools"
    return tools if as_text else without_nulls(tools), None
