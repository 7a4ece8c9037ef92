"""Prompts for generation: the turns before a conversation's last assistant turn, with that turn as the reference.

Both loops build prompts here: GRPO for its rollouts, and both for the held-out evaluation, whose accuracy is
the share of greedy completions the reward function gives full marks.
"""

import dataclasses
import logging

from config.errors import UserError
from data import sft

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prompt:
    """A tokenized prompt (chat template applied, generation header included), the reference answer, and its sources.

    `messages` are the turns rendered; `tools` the tools offered with them (None: none), so a caller can render
    the same prompt again with turns appended."""

    ids: list[int]
    reference: str
    messages: list[dict]
    tools: list | None
    row: dict | None = None  # the data row it came from (an environment's `reset(row)` reads it)


def prompts_from_conversations(conversations: list[list[dict]], tokenizer, tools: list | None = None) -> list[Prompt]:
    """Each conversation's turns before its last assistant turn as a prompt, that turn's content as the reference.

    A conversation's own tools are offered with its prompt; `tools` (schemas or typed, documented functions), when
    given, are offered with every prompt instead."""
    cuts = [max(index for index, message in enumerate(turns) if message["role"] == "assistant") for turns in conversations]
    offered = [sft.conversation_tools(turns) if tools is None else tools for turns in conversations]
    texts = [sft.chat_text(turns[:cut], tokenizer, turn_tools, add_generation_prompt=True)
             for turns, cut, turn_tools in zip(conversations, cuts, offered)]
    ids = sft.encode_texts(texts, tokenizer)
    return [Prompt(prompt_ids, turns[cut]["content"], list(turns[:cut]), turn_tools or None)
            for prompt_ids, turns, cut, turn_tools in zip(ids, conversations, cuts, offered)]


def load_prompts(data, tokenizer, path: str, split: str, max_new_tokens: int, tools: list | None = None) -> list[Prompt]:
    """Prompts of one split of `path`; those leaving no room for `max_new_tokens` within `data.max_seq_len` are skipped and counted.

    `tools`, when given, are offered with every prompt instead of each row's own (see `prompts_from_conversations`)."""
    max_tokens = data.max_seq_len - max_new_tokens
    rows = sft.load_rows(path, split=split, hub_config=data.hub_config or None)
    conversations, report = sft.to_conversations(
        rows, prompt_field=data.prompt_field, response_field=data.response_field, messages_field=data.messages_field or None)
    every = prompts_from_conversations(conversations, tokenizer, tools)
    for prompt, index in zip(every, report.kept_rows, strict=True):
        prompt.row = rows[index]
    prompts = [prompt for prompt in every if len(prompt.ids) <= max_tokens]
    log.info("prompts %s (%s): %d used; %s; %d skipped as longer than %d tokens (data.max_seq_len - grpo.max_new_tokens)",
             path, split, len(prompts), report.summary(), len(every) - len(prompts), max_tokens)
    if not prompts:
        raise UserError(f"Every prompt of {path} ({split}) is longer than {max_tokens} tokens, which leaves no room for "
                        f"`grpo.max_new_tokens={max_new_tokens}` within `data.max_seq_len={data.max_seq_len}`. "
                        "Raise `--data.max_seq_len` or lower `--grpo.max_new_tokens`.")
    return prompts


def held_out_split(data, load):
    """`load(path, split)` of the held-out data: `data.eval_path`, else the test split of `data.path`, else None.

    A missing test split of `data.path` only skips evaluation; a bad `data.eval_path` is the user's error.
    """
    try:
        return load(data.eval_path or data.path, "test")
    except UserError:
        if data.eval_path:
            raise
        log.info("no held-out split found for %s: evaluation is skipped (set data.eval_path)", data.path)
        return None


def trim_for_data_parallel(items: list, limit: int, data_parallel_size: int) -> list:
    """At most `limit` items, a multiple of the data-parallel size, so every rank scores an equal share."""
    return items[: min(limit, len(items)) // data_parallel_size * data_parallel_size]
