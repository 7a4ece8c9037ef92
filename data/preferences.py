"""Preference pairs for reward-model training (`trainer.rm`): rows of a chosen and a rejected response, read in the
forms the common preference sets use (TRL's): an explicit prompt beside each response, or each side a whole
conversation; every part either text or chat messages. A side is what a reward model scores: the conversation as
the chat template renders it (`render`), or, for plain text with no prompt, that text and the end token.
"""

import dataclasses
import logging

import torch

from config.errors import UserError
from config.sections import PreferenceDataConfig
from data import conversations as conversation_data, encode
from data.conversations import DropReport
from data.sft import unrendered

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Pair:
    """One preference: the token ids of the chosen and of the rejected side."""

    chosen: list[int]
    rejected: list[int]


def as_messages(value, role: str) -> list[dict] | None:
    """Text as one message of `role`; chat messages with what the chat template reads of each, as SFT reads them (tool
    calls, a tool message's name and call id, an assistant turn's `reasoning_content`: `copied_message`); None for
    anything else, a malformed message included."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if (isinstance(value, list) and value
            and all(isinstance(message, dict) and isinstance(message.get("role"), str) for message in value)
            and not any(map(conversation_data.message_problem, value))):
        return [conversation_data.copied_message(message) for message in value]
    return None


def text_ids(text: str, tokenizer) -> list[int]:
    """`text` tokenized with the tokenizer's own special tokens (a Llama or Mistral BOS, as `tokenizer(text)` adds it),
    that BOS once where the text already begins with it (a chat template's rendering that wrote one)."""
    ids = tokenizer(text)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids


def render(prompt, response, tokenizer, tools: list | None = None) -> list[int] | str:
    """One side's token ids: the prompt's messages then the response's (text becomes a user or an assistant message),
    rendered by the chat template; a text response with no prompt is that text with the tokenizer's special tokens
    and the end token once (TRL's `processing_class(text + eos_token)`: a Llama model reads its BOS, as GRPO's reward
    model reads a text row, `trainer.reward_model`). A str: why the side is unusable (malformed; or a message its chat
    template leaves out, such as Mistral v0.3's system message before an answer, dropped as SFT drops such a row:
    `data.sft.unrendered`). `tools`, the row's tool schemas, are offered to
    the chat template (TRL passes a row's `tools`; GRPO's reward model reads a tool episode's prompt, which offers them).
    A response whose messages already begin with the prompt's is the whole conversation (the prompt column beside
    sides that hold it, as HuggingFaceH4/ultrafeedback_binarized's `prompt` text beside `chosen` [user, assistant]):
    the prompt is not rendered twice, as TRL's `maybe_extract_prompt` reads that form."""
    if prompt is None and isinstance(response, str):
        ids = text_ids(response, tokenizer)
        return ids if ids[-1:] == [tokenizer.eos_token_id] else ids + [tokenizer.eos_token_id]
    messages = (as_messages(prompt, "user") if prompt is not None else []), as_messages(response, "assistant")
    if messages[0] is None or not messages[1]:
        return MALFORMED
    conversation = messages[1] if messages[1][: len(messages[0])] == messages[0] else messages[0] + messages[1]
    rendered = encode.chat_text(conversation, tokenizer, tools)
    return unrendered(conversation, rendered) or encode.encode_texts([rendered], tokenizer)[0]


MALFORMED = "malformed or missing side"


def check_columns(rows: list[dict], data, path: str, split: str) -> bool:
    """Refuse rows without the columns `data.chosen_field` and `data.rejected_field` name, or without a
    `data.prompt_field` the user set; whether the rows have a prompt column."""
    if not rows:
        raise UserError(f"`{path}` ({split}) holds no rows; point `--data.path` at a preference set.")
    columns = sorted({key for row in rows for key in row})
    for key, name in (("data.chosen_field", data.chosen_field), ("data.rejected_field", data.rejected_field)):
        if name not in columns:
            raise UserError(f"`{key}` is {name!r}, but `{path}` ({split}) has no such column; its columns are "
                            f"{columns}. Set `--{key}` to the column holding that side of each pair.")
    has_prompt = data.prompt_field in columns
    if not has_prompt and data.prompt_field != PreferenceDataConfig.prompt_field:  # set by the user: a typo, not a form
        raise UserError(f"`data.prompt_field` is {data.prompt_field!r}, but `{path}` ({split}) has no such column; its "
                        f"columns are {columns}. Set `--data.prompt_field` to the column holding each pair's prompt, or "
                        "leave it unset when each side is a whole conversation.")
    return has_prompt


def load_pairs(path: str, split: str, data, tokenizer) -> tuple[list[Pair], DropReport]:
    """The rows of `path` (`data.path`'s forms) as tokenized pairs, each offering its row's `tools` (as SFT reads them);
    rows whose sides or tools are missing, malformed, alike or longer than `data.max_seq_len` are dropped and counted
    (a UserError when none is left), as are text sides without the prompt the set's prompt column gives others."""
    rows = conversation_data.load_split(data, path, split)
    has_prompt = check_columns(rows, data, path, split)
    report, pairs = DropReport(rows_read=len(rows)), []
    for index, row in enumerate(rows):
        prompt = row.get(data.prompt_field) if has_prompt else None
        tools, tools_problem = conversation_data.row_tools(row.get("tools"))
        given = [row.get(name) for name in (data.chosen_field, data.rejected_field)]
        sides = [render(prompt, side, tokenizer, tools) for side in given]
        # A set with a prompt column whose row has none: its text sides would be scored as bare text.
        unprompted = has_prompt and prompt is None and any(isinstance(side, str) for side in given)
        problem = (tools_problem or (f"missing {data.prompt_field!r}" if unprompted else None)
                   or next((side for side in sides if isinstance(side, str)), None))
        reason = (problem if problem
                  else "chosen and rejected alike" if sides[0] == sides[1]
                  else f"longer than data.max_seq_len={data.max_seq_len}" if max(map(len, sides)) > data.max_seq_len
                  else None)
        if reason:
            report.drop(index, reason)
            continue
        pairs.append(Pair(*sides))
        report.kept_rows.append(index)
    if not pairs:
        raise UserError(f"`{path}` ({split}) gave no usable pair: {report.summary()}. Check `--data.chosen_field`, "
                        "`--data.rejected_field` and `--data.prompt_field`, or raise `--data.max_seq_len`.")
    return pairs, report


def collate_pairs(pairs: list[Pair], seq_len: int, pad_id: int) -> dict:
    """Rows chosen, rejected, chosen, ... (a pair's sides adjacent), right-padded to `seq_len` (`collate_sides`)."""
    return collate_sides([side for pair in pairs for side in (pair.chosen, pair.rejected)], seq_len, pad_id)


def collate_sides(sides: list[list[int]], seq_len: int, pad_id: int) -> dict:
    """Token id rows right-padded to `seq_len`: `tokens`, `position_ids` and `padding_mask` (True after a row's last
    token) [rows, seq], as a reward model's forward takes them."""
    tokens = torch.full((len(sides), seq_len), pad_id, dtype=torch.int64)  # [rows, seq]
    for row, ids in enumerate(sides):
        tokens[row, : len(ids)] = torch.tensor(ids)
    lengths = torch.tensor([len(ids) for ids in sides])
    positions = torch.arange(seq_len)
    return {"tokens": tokens, "position_ids": positions.repeat(len(sides), 1), "attention_mask": None,
            "padding_mask": positions[None, :] >= lengths[:, None]}


def held_out_pairs(data, tokenizer) -> list[Pair]:
    """The held-out pairs: `data.eval_path`, else the test split of `data.path`; none when it has no test split. Its
    start-up line counts the pairs used and dropped, as the training split's does."""
    from data import prompts as prompt_data

    def load(path: str, split: str) -> list[Pair]:
        pairs, report = load_pairs(path, split, data, tokenizer)
        log.info("pairs %s (%s): %d used; %s", path, split, len(pairs), report.summary())
        return pairs

    return prompt_data.held_out_split(data, load) or []
