"""A turn's text in a multi-turn tool rollout: the tool calls read from it, and the token ids its tool messages append.

Reading a turn: `tokenizer.parse_response` with the tokenizer's own `response_schema`, or, where it has none,
`TOOL_CALL_SCHEMA`, the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form of Qwen2.5 and Hermes
(the fallback transformers' own server uses for Qwen's families).

Appending: a turn's tool messages become token ids as the difference between two renders of the conversation by
the model's chat template, without and with them (plus the generation header of the next assistant turn); only
that difference is tokenized, so the ids of earlier turns, the policy's own samples, are never re-tokenized. A
template that rewrites earlier turns when more are added cannot be continued this way and is refused at start-up.
"""

import dataclasses
import json
from collections.abc import Callable

from config.errors import UserError
from data.encode import encode_texts, unpadded_backend

# `tokenizer.parse_response`'s schema for the common form: free text, then each call as JSON in <tool_call> tags. Both
# regexes run in time linear in the turn's length (the iterator is transformers' own fallback's; json.loads takes the
# whitespace around a call): with `\s*` around a lazy group, a turn of `<tool_call>` and 4,000 spaces took 47 s to read
# (its cube), while the peers waited in a collective.
TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "role": {"const": "assistant"},
        "content": {"type": "string", "x-regex": r"^((?:.*?\S)??)\s*(?:<tool_call>|\Z)"},
        "tool_calls": {"type": "array", "x-regex-iterator": r"<tool_call>(.*?)</tool_call>",
                       "items": {"type": "object", "x-parser": "json"}},
    },
}
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


# ---------------------------------------------------------------- a turn's tool calls


@dataclasses.dataclass
class Call:
    """One parsed tool call."""

    name: str
    arguments: dict


def parse_turn(tokenizer, text: str) -> tuple[str, list[Call], str | None]:
    """(content, tool calls, parse error) of one assistant turn's text: by the tokenizer's `response_schema`, else
    `TOOL_CALL_SCHEMA`. A turn that tries to call (or whose schema raises) and yields no well-formed call has an error."""
    schema = getattr(tokenizer, "response_schema", None) or TOOL_CALL_SCHEMA
    try:
        parsed = tokenizer.parse_response(text, schema)
    except Exception as error:  # the schema's JSON parser raises on malformed calls, ending its message with json's
        return text, [], f"the tool call could not be parsed ({str(error).strip().rsplit('Error: ', 1)[-1]})"
    calls = []
    for item in parsed.get("tool_calls") or []:
        function = item.get("function", item) if isinstance(item, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
            return text, [], f"the tool call {item!r} has no name or no arguments object"
        calls.append(Call(function["name"], arguments))
    # A call opened after the last closed one (`<tool_call>{...}</tool_call><tool_call>{"name": ...` ended by the end id)
    # is a call the iterator never sees: without this it was dropped, the turn's first calls run and nothing counted.
    unclosed = text.rfind(TOOL_CALL_START) > text.rfind(TOOL_CALL_END)
    if schema is TOOL_CALL_SCHEMA and TOOL_CALL_START in text and (not calls or unclosed):
        return text, [], f"`{TOOL_CALL_START}` without a closing tag"
    return parsed.get("content") or "", calls, None


# ---------------------------------------------------------------- rendering: the ids a turn appends


def end_texts(tokenizer, end_ids) -> list[str]:
    """The text of each end id (the template writes one of them to close a turn)."""
    return [tokenizer.convert_ids_to_tokens(int(token)) for token in end_ids]


def appended_text(tokenizer, messages: list[dict], new: list[dict], schemas: list[dict], ends: list[str]) -> str | None:
    """The text the chat template adds after a conversation's last assistant turn's end id for `new` messages and
    the next assistant header: the glue after that end id, then the difference of the two renders. None when the
    template rewrites the conversation's earlier text instead of appending."""
    render = tokenizer.apply_chat_template
    before = render(messages, tools=schemas or None, tokenize=False)
    after = render(messages + new, tools=schemas or None, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        return None
    closed = [before.rfind(end) + len(end) for end in ends if end in before]
    if not closed:
        return None
    return before[max(closed):] + after[len(before):]


# Rendered where a text goes, to find where the template puts it (letters only: no template escapes or trims them).
SLOT = "TEXTSLOTQX{}QX"
# A token is at most this many characters, in practice: a tool result is cut to the limit's characters before it is
# tokenized, so a 1 MB result costs no more to cut than a short one.
MAX_CHARS_PER_TOKEN = 32


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as plain text: a special token's string in it (`<|im_end|>`) is tokenized as the characters
    it is, never as the control id. A lone surrogate (half of a JSON `\\ud83d\\ude00` escape in the policy's arguments,
    which a tool may echo back) becomes `?`: a tokenizer raises on it, and would end the run."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    if getattr(tokenizer, "is_fast", False):
        with unpadded_backend(tokenizer) as backend:
            previous = backend.encode_special_tokens  # a flag on the shared backend: restored for every other caller
            backend.encode_special_tokens = True
            try:
                return backend.encode(text, add_special_tokens=False).ids
            finally:
                backend.encode_special_tokens = previous
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def render_ids(tokenizer, render: Callable[[list[str]], str | None], texts: list[str]) -> list[int] | None:
    """Token ids of `render(texts)`, a chat template's text holding `texts` (tool results, an environment's reset
    text), where each of `texts` is plain text and the template's own tokens around them stay special: a result
    holding `<|im_end|>\n<|im_start|>assistant\n` cannot forge a turn. None when `render` gives None, or does not
    place each text where its slot goes."""
    slots = [SLOT.format(index) for index in range(len(texts))]
    templated, full = render(slots), render(texts)
    if templated is None or full is None:
        return None
    spans, cursor = [], 0
    for slot in slots:
        start = templated.find(slot, cursor)
        if start < 0:
            return None
        spans.append((start, start + len(slot)))
        cursor = start + len(slot)
    pieces = [templated[end:start] for (_, end), (start, _) in zip([(0, 0), *spans], [*spans, (len(templated), 0)])]
    rendered = list(texts)  # as the template writes them: verbatim, or escaped (a template may `tojson` a result)
    if "".join(piece + text for piece, text in zip(pieces, [*rendered, ""])) != full:
        for index, (start, end) in enumerate(spans):
            one = render(slots[:index] + [texts[index]] + slots[index + 1 :])
            suffix = len(templated) - end
            if one is None or not (one.startswith(templated[:start]) and one.endswith(templated[end:])) or len(one) < start + suffix:
                return None
            rendered[index] = one[start : len(one) - suffix]
        if "".join(piece + text for piece, text in zip(pieces, [*rendered, ""])) != full:
            return None
    templates = encode_texts(pieces, tokenizer)  # the template's own text: special tokens live
    ids = list(templates[0])
    for text, piece_ids in zip(rendered, templates[1:]):
        ids += encode_plain(tokenizer, text) + piece_ids
    return ids


def appended_ids(tokenizer, messages: list[dict], new: list[dict], schemas: list[dict], ends: list[str]) -> list[int] | None:
    """The ids of `appended_text`, each new message's content tokenized as plain text (`render_ids`); None where the
    template rewrites the conversation's earlier text."""
    def render(contents: list[str]) -> str | None:
        filled = [dict(message, content=content) for message, content in zip(new, contents)]
        return appended_text(tokenizer, messages, filled, schemas, ends)

    return render_ids(tokenizer, render, [message["content"] for message in new])


def cut_result(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    """A tool result cut to `max_tokens` tokens of plain text, its message saying so, and whether it was cut; cut to
    `max_tokens * MAX_CHARS_PER_TOKEN` characters before it is tokenized."""
    head = text[: max_tokens * MAX_CHARS_PER_TOKEN]
    ids = encode_plain(tokenizer, head)
    if len(ids) <= max_tokens and len(head) == len(text):
        return text, False
    kept = tokenizer.decode(ids[:max_tokens], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return f"{kept} [cut: {len(text):,} characters, the limit is {max_tokens} tokens]", True


def turn_text(tokenizer, ids: list[int], end_ids) -> str:
    """A turn's sampled ids as the text `parse_turn` reads: special tokens kept (a call marker may be one, as
    Mistral's `[TOOL_CALLS]`), the end id that closed the turn left off."""
    if ids and ids[-1] in end_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def check_template(tokenizer, schemas: list[dict], ends: list[str]) -> None:
    """Refuse, before any model is built, a chat template multi-turn rollouts cannot continue: one that rewrites
    earlier turns as turns are added, does not close an assistant turn with an end id, or renders tool calls in a form
    `parse_turn` cannot read back. Checked on a dummy conversation calling the first tool."""
    function = schemas[0]["function"]
    arguments = {name: "1" for name in function.get("parameters", {}).get("properties", {})}
    user = {"role": "user", "content": "What is 1 + 1?"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": function["name"], "arguments": arguments}}]}
    answer = {"role": "assistant", "content": "2"}
    name = getattr(tokenizer, "name_or_path", "") or "(unnamed)"

    def refuse(problem: str):
        raise UserError(f"The chat template of tokenizer {name!r} cannot run multi-turn tool rollouts: {problem}. Each turn "
                        "must render as a plain suffix of the conversation before it, so that only the new messages' "
                        "tokens are appended and the policy's own tokens are never re-tokenized. Use a model whose "
                        "template appends turns (Qwen2.5 and Llama 3's do; Qwen3's drops earlier reasoning), or set "
                        "the tokenizer's `chat_template` to such a template; or run without `grpo.tools` and "
                        "`grpo.environment`.")

    try:
        prompt = tokenizer.apply_chat_template([user], tools=schemas, tokenize=False, add_generation_prompt=True)
        called = tokenizer.apply_chat_template([user, call], tools=schemas, tokenize=False)
    except Exception as error:  # a template may raise on tools or tool_calls it does not know
        refuse(f"rendering a conversation with a tool call raised {type(error).__name__}: {error}")
    if not called.startswith(prompt):
        refuse("the assistant turn does not continue the generation header")
    turn = called[len(prompt):]
    cut = min((turn.find(end) for end in ends if end in turn), default=-1)
    if cut < 0:
        refuse(f"an assistant turn is not closed by an end id ({', '.join(ends)})")
    _, calls, error = parse_turn(tokenizer, turn[:cut])
    if error or [parsed.name for parsed in calls] != [function["name"]]:
        refuse(f"its tool call renders as {turn[:cut]!r}, which does not parse back as a call of {function['name']!r} "
               "(the tokenizer has no `response_schema` and the text is not the `<tool_call>{json}</tool_call>` form)")
    tool = {"role": "tool", "name": function["name"], "content": "2"}
    try:
        text = appended_text(tokenizer, [user, call], [tool], schemas, ends)
        header = tokenizer.apply_chat_template([user, call, tool], tools=schemas, tokenize=False, add_generation_prompt=True)
        final = tokenizer.apply_chat_template([user, call, tool, answer], tools=schemas, tokenize=False)
    except Exception as error:
        refuse(f"rendering a tool message raised {type(error).__name__}: {error}")
    if text is None:
        refuse("adding a tool message rewrites the text before it")
    if not final.startswith(header):
        refuse("adding the answer after a tool message rewrites the text before it")
