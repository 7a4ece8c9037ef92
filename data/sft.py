"""SFT data: load rows, turn them into chat conversations, tokenize with a loss mask, and order them.

Truncation policy: a tokenized sample longer than `max_seq_len + 1` tokens is cut from the right to
`max_seq_len + 1` tokens (inputs are `ids[:-1]`, labels `ids[1:]`, so both then fit in `max_seq_len`)
and counted as truncated; if the cut leaves no loss token among the labels the sample is dropped and
counted. A conversation whose turn pieces tokenize differently from its whole rendering (a response
starting with a newline merges with the header's) is dropped and counted rather than masked by guess.
Every row read is either used or counted in the `DropReport` under one reason.

Tool use: a messages row may hold assistant turns with `tool_calls`, `tool` messages with their results, and a
`tools` field with the JSON schemas of the tools offered (a list, or that list as JSON text). A row's conversation
is a `Conversation`, a list of messages that also carries those schemas, and every rendering of it passes them to
the chat template. Each assistant turn is learned from after its header through the eos token that closes it, its
rendered tool calls included; tool results and the template's text around them are not. A row with a broken tool call
or a tool result without a call is dropped and counted like any malformed row (`to_conversations`).

Tokenized examples are kept in a cache (`cached_examples`) keyed by everything tokenizing reads, so a restarted or
repeated run skips the work.

Batching (padding, packing, collating) is `data.batches`, which GRPO's rollouts share.
"""

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import platform

import torch

from config.errors import UserError
from data.arithmetic import EVAL_SEED, TRAIN_SEED, generate_problems
from data.batches import Example

log = logging.getLogger(__name__)
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
ARITHMETIC_SPLITS = {"train": (10000, TRAIN_SEED), "test": (1000, EVAL_SEED), "eval": (1000, EVAL_SEED)}
# SFT's targets on the bundled train split: this share answers `The answer is N.`, the rest `#### N`. The SFT
# model then knows both styles and greedily prefers the plain one, which GRPO's `#### N` reward must teach it out
# of; GRPO's prompts and every held-out reference keep `#### N`.
ARITHMETIC_SFT_PLAIN_SHARE = 0.75
DROP_EXAMPLES_KEPT = 5
TOKENIZE_CHUNK = 1024

# --- loading ----------------------------------------------------------------------------------


def load_rows(path: str, *, split: str = "train", hub_config: str | None = None, sft_targets: bool = False) -> list[dict]:
    """Return the rows of the bundled arithmetic set, a local json/jsonl/parquet file or folder, or a hub dataset.

    `sft_targets`: the rows are SFT training targets; only the bundled train split differs then (a seeded
    `ARITHMETIC_SFT_PLAIN_SHARE` answers in the plain style).
    """
    if path == "arithmetic":
        if split not in ARITHMETIC_SPLITS:
            raise UserError(f"The arithmetic data set has splits {sorted(ARITHMETIC_SPLITS)}, not {split!r}.")
        plain_share = ARITHMETIC_SFT_PLAIN_SHARE if sft_targets and split == "train" else 0.0
        return generate_problems(*ARITHMETIC_SPLITS[split], plain_share=plain_share)
    if path == "calculator":  # the bundled tool task
        from data import calculator  # imported where used: only the bundled tool task needs it

        return calculator.load_split(split, sft_targets)
    local = pathlib.Path(path).expanduser()
    looks_local = path.startswith(("/", "./", "../", "~")) or local.suffix in LOCAL_FORMATS
    if local.exists():
        return load_local(local, split)
    if looks_local:
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


def load_local(path: pathlib.Path, split: str) -> list[dict]:
    """Load a local data file, or the files in a folder (those named after `split` when there are any)."""
    files = sorted(file for file in path.rglob("*") if file.suffix in LOCAL_FORMATS) if path.is_dir() else [path]
    # A folder holding train.jsonl and test.jsonl must not mix the two splits.
    files = [file for file in files if file.stem.startswith(split)] or files
    formats = {LOCAL_FORMATS.get(file.suffix) for file in files}
    if not files or len(formats) != 1 or None in formats:
        raise UserError(f"data.path {str(path)!r} must be a .json, .jsonl or .parquet file, or a folder holding "
                        f"files of one of those formats; found {[file.name for file in files]}.")
    empty = [file.name for file in files if file.stat().st_size == 0]
    if empty:
        raise UserError(f"data.path {str(path)!r}: {', '.join(empty)} is empty. Fix the file, or set data.path to another one.")
    import datasets

    try:
        return datasets.load_dataset(formats.pop(), data_files=[str(file) for file in files], split="train").to_list()
    except UnicodeDecodeError as error:
        raise UserError(f"data.path {str(path)!r} is not UTF-8 text ({error}). Re-encode it as UTF-8 (e.g. "
                        "`iconv -f latin1 -t utf-8`), or set data.path to another file.") from None
    except Exception as error:
        reason = str(error).strip() or type(error).__name__
        raise UserError(f"data.path {str(path)!r} could not be read as a table ({reason}). Fix the file, or set "
                        "data.path to another one.") from None


# --- conversations ----------------------------------------------------------------------------


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


def to_conversations(rows: list[dict], *, prompt_field: str = "question", response_field: str = "answer",
                     messages_field: str | None = None) -> tuple[list[Conversation], DropReport]:
    """Map rows to conversations, skipping malformed rows and counting them in a `DropReport`.

    A messages row's `tools` field becomes its conversation's `tools`; other rows offer none. A row with a broken tool
    call (arguments that are not JSON, or not a JSON object; no function name) or a tool result without a call
    before it (more `tool` messages than calls since the last assistant turn) is skipped and counted under that
    reason, like every malformed row, so none of it is trained on; the callers log `report.summary()`, which names
    the first rows skipped and why. Only when no row is left is it a UserError."""
    if not rows:
        raise UserError("data.path holds no rows; point data.path at a non-empty data set.")
    columns = sorted({key for row in rows for key in row})
    wanted = {"data.messages_field": messages_field} if messages_field else {
        "data.prompt_field": prompt_field, "data.response_field": response_field}
    for key, field in wanted.items():
        if field not in columns:
            raise UserError(f"{key} is {field!r}, but the data has no such column; its columns are {columns}. "
                            f"Set {key} to one of them.")
    report = DropReport(rows_read=len(rows))
    conversations = []
    for index, row in enumerate(rows):
        if messages_field:
            messages = row.get(messages_field)
            tools, tools_reason = row_tools(row.get("tools"))
            reason = messages_problem(messages) or tools_reason
        else:
            messages = [{"role": "user", "content": row.get(prompt_field)},
                        {"role": "assistant", "content": row.get(response_field)}]
            tools, reason = None, pair_problem(row.get(prompt_field), row.get(response_field))
        if reason:
            report.drop(index, reason)
            continue
        conversations.append(Conversation([copied_message(message) for message in messages], tools))
        report.kept_rows.append(index)
    if not conversations:
        raise UserError(f"data.path gave no usable rows: {report.summary()}. Point data.path at data with "
                        "non-empty prompts and responses, or fix the field settings.")
    return conversations, report


def pair_problem(prompt, response) -> str | None:
    """Return why a prompt/response pair is unusable, or None when it is fine."""
    if prompt is None or response is None:
        return "missing field"
    if not isinstance(prompt, str) or not isinstance(response, str):
        return "not a string"
    return "empty response" if not response.strip() else None


def messages_problem(messages) -> str | None:
    """Return why a list of chat messages is unusable, or None when it is fine."""
    if messages is None:
        return "missing field"
    if not isinstance(messages, list) or not all(
        isinstance(message, dict) and isinstance(message.get("role"), str) for message in messages
    ):
        return "malformed messages"
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
    if not any((message.get("content") or "").strip() or message.get("tool_calls")
               for message in messages if message["role"] == "assistant"):
        return "no assistant turn"
    # The assistant header is found by rendering the turns before it, so there must be some.
    return "starts with assistant turn" if messages[0]["role"] == "assistant" else None


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
    if message["role"] == "tool":
        names_are_strings = all(isinstance(message.get(key), (str, type(None))) for key in ("name", "tool_call_id"))
        return None if isinstance(content, str) and names_are_strings else "malformed tool message"
    return None if isinstance(content, str) else "malformed messages"


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
    return {"name": function["name"], "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments}


def copied_message(message: dict) -> dict:
    """Return the parts of a checked message that the chat template reads.

    Those are the role, the content ("" for a turn of tool calls alone), tool calls in the OpenAI form with dict
    arguments, and a tool message's `name` and `tool_call_id`."""
    kept = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        kept["tool_calls"] = [{"type": "function", "function": tool_call_function(call)}
                              for call in message["tool_calls"]]
    if message["role"] == "tool":
        kept |= {key: message[key] for key in ("name", "tool_call_id") if isinstance(message.get(key), str)}
    return kept


def row_tools(tools) -> tuple[list[dict] | None, str | None]:
    """Return a row's tool schemas (None when it offers none) and why they are unusable (None when fine).

    `tools` is a list of OpenAI function schemas (`{"type": "function", "function": {"name", "description",
    "parameters"}}`, or the flat function), or that list as JSON text; the schemas are passed on as they are."""
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except ValueError:
            return None, "malformed tools"
    if not tools:
        return None, None
    if not isinstance(tools, list) or not all(map(named_function, tools)):
        return None, "malformed tools"
    return tools, None


# --- tokenization -----------------------------------------------------------------------------


def tokenize_conversation(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """Return `(input_ids, loss_mask)` with 1 exactly on each assistant turn after its header, through its eos token.

    The learned part is the turn's content, its rendered tool calls, and the end-of-turn token that closes it."""
    tokenized = tokenize_conversations([messages], tokenizer)[0]
    if tokenized is None:
        raise template_error(tokenizer, "tokenizing the turns one by one differs from tokenizing the whole text")
    return tokenized


def tokenize_conversations(conversations: list[list[dict]], tokenizer) -> list[tuple[list[int], list[int]] | None]:
    """Tokenize like `tokenize_conversation` in two batched calls; None where the pieces tokenize differently."""
    split = [split_turns(messages, tokenizer) for messages in conversations]
    texts = [text for pieces, _ in split for text, _ in pieces]
    piece_ids = iter(encode_texts(texts, tokenizer))
    whole_ids = encode_texts([rendered for _, rendered in split], tokenizer)
    tokenized = []
    for (pieces, _), expected in zip(split, whole_ids):
        input_ids, loss_mask = [], []
        # zip asks `pieces` first, so it stops without taking the next conversation's first piece.
        for (_, flag), ids in zip(pieces, piece_ids):
            input_ids += ids
            loss_mask += [flag] * len(ids)
        # Text at a turn boundary can merge into one token (a response starting with a newline joins
        # the header's newline); such a token belongs to neither side, so the caller must not guess.
        tokenized.append((input_ids, loss_mask) if input_ids == expected else None)
    return tokenized


def encode_texts(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of each text, no special tokens added. A fast tokenizer's Rust backend is called directly: the
    same ids as `tokenizer(texts)`, without building a Python encoding object per text."""
    if not texts:
        return []
    if getattr(tokenizer, "is_fast", False):
        return [encoding.ids for encoding in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def chat_text(messages: list[dict], tokenizer, tools: list | None, *, add_generation_prompt: bool = False) -> str:
    """Return the chat template's text of `messages`, offering `tools` (schemas or functions; None: no tools)."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def split_turns(messages: list[dict], tokenizer) -> tuple[list[tuple[str, int]], str]:
    """Return the rendered conversation as `(text, loss flag)` pieces, and the whole rendering they concatenate to."""
    tools = conversation_tools(messages)
    pieces = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # The turns since the last assistant turn are one unlearned piece, rendered together: a template may
        # join them (consecutive tool results share one user turn), so one of them alone is no prefix.
        context = chat_text(messages[:index], tokenizer, tools)
        prompted = chat_text(messages[:index], tokenizer, tools, add_generation_prompt=True)
        text = chat_text(messages[: index + 1], tokenizer, tools)
        if not (context.startswith(rendered) and prompted.startswith(context) and text.startswith(context)):
            raise template_error(tokenizer, "rendering more turns rewrites earlier ones")
        header, turn = prompted[len(context) :], text[len(context) :]
        after_header, content = turn[len(header) :], message["content"]
        if not (turn.startswith(header) and after_header.startswith(content)
                and tokenizer.eos_token and tokenizer.eos_token in after_header[len(content) :]):
            raise template_error(tokenizer, "an assistant turn is not header + content (+ tool calls) + "
                                            "end-of-turn token")
        # Learn the content, the rendered tool calls, and the token that ends the turn, so generation knows when
        # to stop; the search starts after the content, so content quoting the eos text does not end it early.
        learned = after_header.index(tokenizer.eos_token, len(content)) + len(tokenizer.eos_token)
        pieces += [(context[len(rendered) :], 0), (header, 0), (after_header[:learned], 1), (after_header[learned:], 0)]
        rendered = text
    if messages[-1]["role"] != "assistant":
        text = chat_text(messages, tokenizer, tools)
        if not text.startswith(rendered):
            raise template_error(tokenizer, "rendering more turns rewrites earlier ones")
        pieces.append((text[len(rendered) :], 0))
        rendered = text
    return pieces, rendered


def template_error(tokenizer, problem: str) -> UserError:
    """Return the error for a chat template the loss mask cannot be derived from."""
    return UserError(f"The chat template of tokenizer {tokenizer.name_or_path!r} cannot be split into turns for "
                     f"the SFT loss mask: {problem}. Use a model whose template renders each turn as a plain suffix "
                     "of the previous turns, with assistant turns closed by the eos token.")


def build_examples(conversations: list[list[dict]], tokenizer, max_seq_len: int, report: DropReport) -> list[Example]:
    """Tokenize conversations, truncate them to `max_seq_len + 1` tokens and drop those left with no loss token."""
    if not report.kept_rows:
        # A report that did not come from `to_conversations` counts conversations as its rows.
        report.rows_read, report.kept_rows = len(conversations), list(range(len(conversations)))
    examples, kept_rows = [], []
    # Chunks keep the batched tokenizer calls fast without holding every rendering at once.
    tokenized = (pair for start in range(0, len(conversations), TOKENIZE_CHUNK)
                 for pair in tokenize_conversations(conversations[start : start + TOKENIZE_CHUNK], tokenizer))
    for row, pair in zip(report.kept_rows, tokenized, strict=True):
        if pair is None:
            report.drop(row, "tokens merge across a turn boundary")
            continue
        input_ids, loss_mask = pair
        truncated = len(input_ids) > max_seq_len + 1
        input_ids, loss_mask = input_ids[: max_seq_len + 1], loss_mask[: max_seq_len + 1]
        # The first token is never a label, so its mask does not count.
        if not any(loss_mask[1:]):
            report.drop(row, "no loss tokens after truncation")
            continue
        report.truncated += truncated
        examples.append(Example(input_ids, loss_mask))
        kept_rows.append(row)
    report.kept_rows = kept_rows
    if not examples:
        raise UserError(f"No usable SFT example is left after tokenizing: {report.summary()}. Raise data.max_seq_len "
                        f"(now {max_seq_len}) if samples lost every response token, or change data.path (or the "
                        "model, when its chat template merges tokens across every turn boundary).")
    return examples


# --- cache of tokenized examples -----------------------------------------------------------------

CACHE_FOLDER = "sft-examples"


def tokenizer_digest_parts(tokenizer, rendered_sample: str) -> list[str] | None:
    """What a cache key must cover of a fast tokenizer (None for a slow one, which has no one text of its state): its
    chat template and special tokens, a sample as that template renders it now (a template that prints today's date
    renders differently tomorrow), the whole backend (vocabulary, merges, normalisation, added tokens), and the source
    of this module and of `data.batches` (a change to the tokenization code is a new key)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    return [json.dumps({"chat_template": tokenizer.chat_template, "special_tokens": tokenizer.special_tokens_map,
                        "rendering": rendered_sample}, sort_keys=True, default=str),
            tokenizer.backend_tokenizer.to_str(), pathlib.Path(__file__).read_text(),
            pathlib.Path(__file__).with_name("batches.py").read_text()]


def cache_key(state: dict, tokenizer, rendered_sample: str, *sources: str) -> str | None:
    """A digest of `state` (JSON), the tokenizer (`tokenizer_digest_parts`) and `sources`; None for a slow tokenizer."""
    parts = tokenizer_digest_parts(tokenizer, rendered_sample)
    if parts is None:
        return None
    digest = hashlib.sha256()
    for part in (json.dumps(state, sort_keys=True, default=str), *parts, *sources):
        digest.update(hashlib.sha256(part.encode()).digest())
    return digest.hexdigest()[:32]


def examples_cache_key(conversations: list[list[dict]], tokenizer, max_seq_len: int, report: DropReport) -> str | None:
    """A digest of everything `build_examples` reads, or None for a slow tokenizer: the conversations and their tools,
    the report's row numbering so far, `max_seq_len`, and the tokenizer (`tokenizer_digest_parts`, the first
    conversation rendered)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    state = {"conversations": conversations, "tools": [conversation_tools(messages) for messages in conversations],
             "max_seq_len": max_seq_len, "rows_read": report.rows_read,
             "kept_rows": report.kept_rows, "dropped": sorted(report.dropped_by_reason.items()),
             "first_drops": report.first_drops, "truncated": report.truncated}
    first = chat_text(conversations[0], tokenizer, conversation_tools(conversations[0])) if conversations else ""
    return cache_key(state, tokenizer, first)


def read_cached(cache_dir: pathlib.Path, folder: str, key: str) -> dict | None:
    """The JSON stored under `key`, or None when it is missing or damaged (the caller builds it again)."""
    try:
        return json.loads((cache_dir / folder / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def write_cached(cache_dir: pathlib.Path, folder: str, key: str, stored: dict) -> None:
    """Store `stored` under `key`, atomically: every process may write the same entry, and nodes may share the cache. A
    cache that cannot be written is left out with a warning."""
    path = cache_dir / folder / f"{key}.json"
    staging = path.with_name(f".{path.name}.{platform.node()}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(json.dumps(stored))
        os.replace(staging, path)
    except OSError as error:
        log.warning("tokenized data not cached (%s); set data.cache=false or $TRAINER_CACHE_DIR to a writable "
                    "directory to silence this", error)
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)


def cached_examples(conversations: list[list[dict]], tokenizer, max_seq_len: int, report: DropReport,
                    cache_dir: pathlib.Path | None) -> list[Example]:
    """`build_examples`, read from `cache_dir` when these conversations were tokenized the same way before (the
    report then reads as if tokenized now); otherwise built and written there. None: no cache.

    Every process reads or writes the same file (each write is atomic), so ranks and nodes sharing the cache agree. A
    damaged entry is rebuilt; a cache that cannot be written is left out with a warning."""
    key = examples_cache_key(conversations, tokenizer, max_seq_len, report) if cache_dir is not None else None
    if key is None:
        return build_examples(conversations, tokenizer, max_seq_len, report)
    stored = read_cached(cache_dir, CACHE_FOLDER, key)
    try:
        examples = [Example(input_ids, loss_mask) for input_ids, loss_mask in stored["examples"]]
        restored = stored["report"]
        kept_rows, truncated = restored["kept_rows"], restored["truncated"]
        dropped, first_drops = collections.Counter(dict(restored["dropped"])), [tuple(drop) for drop in restored["first_drops"]]
    except (KeyError, TypeError, ValueError):
        pass  # not cached yet, or damaged: tokenize
    else:
        report.kept_rows, report.truncated, report.dropped_by_reason, report.first_drops = kept_rows, truncated, dropped, first_drops
        log.info("tokenized examples read from the cache %s (data.cache=false tokenizes anew)",
                 cache_dir / CACHE_FOLDER / f"{key}.json")
        return examples
    examples = build_examples(conversations, tokenizer, max_seq_len, report)
    write_cached(cache_dir, CACHE_FOLDER, key,
                 {"examples": [[example.input_ids, example.loss_mask] for example in examples],
                  "report": {"kept_rows": report.kept_rows, "truncated": report.truncated,
                             "dropped": sorted(report.dropped_by_reason.items()), "first_drops": report.first_drops}})
    return examples


# --- order ------------------------------------------------------------------------------------


class BatchSchedule:
    """Seeded, per-epoch reshuffled order of example indices, split into this data-parallel rank's microbatches.

    The batch sizes divide as start-up validation checked (`TrainerConfig.validate`)."""

    def __init__(self, num_examples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int):
        if num_examples < global_batch_size:
            raise UserError(f"The data has {num_examples} usable examples, fewer than one global batch; lower "
                            f"train.global_batch_size (now {global_batch_size}) or add data.")
        self.micro_batch_size, self.dp_rank, self.dp_size, self.seed = micro_batch_size, dp_rank, dp_size, seed
        self.num_examples, self.global_batch_size = num_examples, global_batch_size
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        # The incomplete tail of each epoch is dropped so that every global batch is full.
        self.batches_per_epoch = num_examples // global_batch_size
        self.epoch, self.batches_consumed_in_epoch = 0, 0
        self.order_epoch, self.order = -1, []

    def next_global_batch(self) -> list[list[int]]:
        """Return this rank's microbatches of the next global batch, as lists of example indices."""
        if self.batches_consumed_in_epoch == self.batches_per_epoch:
            self.epoch, self.batches_consumed_in_epoch = self.epoch + 1, 0
        if self.order_epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self.order, self.order_epoch = torch.randperm(self.num_examples, generator=generator).tolist(), self.epoch
        start = self.batches_consumed_in_epoch * self.global_batch_size
        share = self.global_batch_size // self.dp_size
        mine = self.order[start + self.dp_rank * share : start + (self.dp_rank + 1) * share]
        self.batches_consumed_in_epoch += 1
        size = self.micro_batch_size
        return [mine[index : index + size] for index in range(0, share, size)]

    def state_dict(self) -> dict:
        """Return the position in the order, for a checkpoint."""
        return {"epoch": self.epoch, "batches_consumed_in_epoch": self.batches_consumed_in_epoch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue the order from a checkpoint's position, with the checkpoint's seed."""
        if state["batches_consumed_in_epoch"] > self.batches_per_epoch:
            raise UserError(f"The checkpoint's data position ({state['batches_consumed_in_epoch']} batches into the "
                            f"epoch) is past this data's {self.batches_per_epoch} batches per epoch; resume with the "
                            "same data.path and train.global_batch_size it was saved with.")
        self.epoch, self.batches_consumed_in_epoch, self.seed = (
            state["epoch"], state["batches_consumed_in_epoch"], state["seed"])
        self.order_epoch = -1  # the seed may have changed, so the cached order is stale

