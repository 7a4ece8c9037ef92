"""Prompts for generation: the turns before a conversation's last assistant turn, with that turn as the reference.

Both loops build prompts here: GRPO for its rollouts, and both for the held-out evaluation, whose accuracy is
the share of greedy completions the reward function gives full marks.
"""

import dataclasses
import logging
import pathlib

from config.errors import UserError
from data import conversations as conversation_data, encode

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


CACHE_FOLDER = "prompts"


def prompts_from_conversations(conversations: list[list[dict]], tokenizer, tools: list | None = None,
                               cache_dir: pathlib.Path | None = None) -> list[Prompt]:
    """Each conversation's turns before its last assistant turn as a prompt, that turn's content as the reference.

    A conversation's own tools are offered with its prompt; `tools` (schemas or typed, documented functions), when
    given, are offered with every prompt instead. The token ids are read from `cache_dir` when the same prompts were
    rendered with the same tokenizer before (None: no cache; see `prompt_ids`)."""
    cuts = [max(index for index, message in enumerate(turns) if message["role"] == "assistant") for turns in conversations]
    offered = [conversation_data.conversation_tools(turns) if tools is None else tools for turns in conversations]
    turns_before = [list(turns[:cut]) for turns, cut in zip(conversations, cuts)]
    ids = prompt_ids(turns_before, offered, tokenizer, cache_dir)
    return [Prompt(prompt_ids, turns[cut]["content"], before, turn_tools or None)
            for prompt_ids, turns, cut, before, turn_tools in zip(ids, conversations, cuts, turns_before, offered)]


def prompt_ids(turns_before: list[list[dict]], offered: list, tokenizer, cache_dir: pathlib.Path | None) -> list[list[int]]:
    """Each prompt's token ids: its turns rendered by the chat template with the generation header, then tokenized.

    Rendering is most of a GRPO run's data loading (about 3 s for the bundled task's 11,000 prompts), so the ids are
    kept in `cache_dir` (as SFT's tokenized examples are) under a digest of the turns, the tools (schemas only: a
    function's rendering is not cached), the tokenizer and this code. One process renders a missing entry while the
    others sharing the cache wait for it, then read it (`encode.building`)."""
    def render(index: int) -> str:
        return encode.chat_text(turns_before[index], tokenizer, offered[index], add_generation_prompt=True)

    schemas_only = all(isinstance(tool, dict) for tools in offered for tool in tools or ())
    key = None
    if cache_dir is not None and turns_before and schemas_only:
        key = encode.cache_key({"prompts": turns_before, "tools": offered}, tokenizer, render(0),
                            pathlib.Path(__file__).read_text())
    if key is None:
        return render_and_encode(turns_before, render, tokenizer)
    ids = stored_ids(cache_dir, key, len(turns_before))
    if ids is None:
        with encode.building(cache_dir, CACHE_FOLDER, key):  # one process renders; the others wait, then read its entry
            ids = stored_ids(cache_dir, key, len(turns_before))
            if ids is None:
                ids = render_and_encode(turns_before, render, tokenizer)
                encode.write_cached(cache_dir, CACHE_FOLDER, key, {"ids": ids})
                return ids
    log.info("prompt tokens read from the cache %s (data.cache=false renders them anew)",
             cache_dir / CACHE_FOLDER / f"{key}.json")
    return ids


def stored_ids(cache_dir: pathlib.Path, key: str, count: int) -> list[list[int]] | None:
    """The `count` prompts' ids stored under `key`, or None when the entry is missing or damaged."""
    stored = encode.read_cached(cache_dir, CACHE_FOLDER, key)
    if isinstance(stored, dict) and isinstance(stored.get("ids"), list) and len(stored["ids"]) == count:
        return stored["ids"]
    return None


def render_and_encode(turns_before: list, render, tokenizer) -> list[list[int]]:
    """`render(index)` of every prompt, tokenized, with a progress line on long work."""
    texts = [render(index) for index in encode.with_progress(range(len(turns_before)), len(turns_before), "prompts rendered")]
    return encode.encode_texts(texts, tokenizer)


def load_prompts(data, tokenizer, path: str, split: str, max_new_tokens: int, tools: list | None = None,
                 cache_dir: pathlib.Path | None = None) -> list[Prompt]:
    """Prompts of one split of `path`; those leaving no room for `max_new_tokens` within `data.max_seq_len` are skipped and counted.

    `tools`, when given, are offered with every prompt instead of each row's own; `cache_dir` keeps their token ids
    (see `prompts_from_conversations`)."""
    max_tokens = data.max_seq_len - max_new_tokens
    rows = conversation_data.load_split(data, path, split)
    conversations, report = conversation_data.to_conversations(
        rows, prompt_field=data.prompt_field, response_field=data.response_field, messages_field=data.messages_field or None,
        source=f"`{path}` ({split})")
    every = prompts_from_conversations(conversations, tokenizer, tools, cache_dir)
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
    """`load(path, split)` of the held-out data: `data.eval_split` of `data.eval_path`, else of `data.path`, else None.

    A missing test split of `data.path` only skips evaluation (said as a warning); a single local file has none (its
    rows are the training rows); a bad `data.eval_path` is the user's error.
    """
    if not data.eval_path and pathlib.Path(data.path).expanduser().is_file():
        log.warning("no held-out split in %s (one file: its rows are the training rows): evaluation is skipped; set "
                    "data.eval_path to held-out rows, or make data.path a folder with train* and test* files", data.path)
        return None
    try:
        return load(data.eval_path or data.path, data.eval_split)
    except UserError as error:
        if data.eval_path:  # the loaders name data.path; here the file is data.eval_path's
            raise UserError(str(error).replace("data.path", "data.eval_path")) from None
        log.warning("no held-out split found, so evaluation is skipped: %s", error)
        return None


def held_out_source(data) -> str:
    """The held-out rows' file and split, as warnings name them (`data.eval_path`, else `data.path`)."""
    return f"`{data.eval_path or data.path}` ({data.eval_split})"


def trim_for_data_parallel(items: list, limit: int, data_parallel_size: int, source: str | None = None) -> list:
    """At most `limit` items, a multiple of the data-parallel size, so every rank scores an equal share.

    When the rounding down drops rows it says so, naming the held-out rows' `source`, and a warning says that
    nothing is evaluated when it drops them all (None: silent, for a second trim of the same rows)."""
    wanted = min(limit, len(items))
    kept = items[: wanted // data_parallel_size * data_parallel_size]
    if source is None or len(kept) == wanted:
        return kept
    if not kept:
        needs = ([f"give {source} at least {data_parallel_size} rows"] if len(items) < data_parallel_size else []) + (
            [f"raise train.eval_samples to at least {data_parallel_size}"] if limit < data_parallel_size else [])
        log.warning("nothing is evaluated: %s gives held-out rows: %d (train.eval_samples=%d), fewer than the "
                    "data-parallel size %d, and every rank scores an equal share; %s, or use fewer data-parallel ranks",
                    source, wanted, limit, data_parallel_size, " and ".join(needs))
    else:
        log.info("held-out %s: %d of its %d rows are evaluated (train.eval_samples=%d), a multiple of the data-parallel "
                 "size %d so that every rank scores an equal share", source, len(kept), wanted, limit, data_parallel_size)
    return kept
