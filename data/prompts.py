"""Prompts for generation: the turns before a conversation's last assistant turn, with that turn as the reference.

Both loops build prompts here: GRPO for its rollouts, and both for the held-out evaluation, whose accuracy is
the share of greedy completions the reward function gives full marks. A set of prompts is held in flat arrays
(`PromptSet`), its token ids cached as SFT's tokenized examples are (`data.encode`).
"""

import array
import collections.abc
import dataclasses
import logging
import pathlib
import pickle

import numpy

from config import console
from config.errors import UserError
from config.sections import BUNDLED_DATA
from data import conversations as conversation_data, encode, local_files

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


class PromptSet(collections.abc.Sequence):
    """Prompts held as flat arrays instead of a `Prompt` per row: every prompt's token ids one after another (int32)
    and the rest of each (reference, turns, its own tools, data row) pickled one after another into a byte array,
    with where each starts and ends. Every rank holds the whole set (each step draws from all of it), so 100,000
    prompts cost about their token and text bytes, not a Python object per token. Indexing builds the `Prompt`; a
    slice is a set viewing the same arrays. `tools` (None: each row's own) are offered with every prompt."""

    def __init__(self, token_ids: numpy.ndarray, token_spans: numpy.ndarray, records: numpy.ndarray,
                 record_spans: numpy.ndarray, own_tools: numpy.ndarray, tools: list | None):
        self.token_ids, self.token_spans = token_ids, token_spans  # [tokens] int32; [prompts, 2] (start, end)
        self.records, self.record_spans = records, record_spans  # [bytes] uint8; [prompts, 2] (start, end)
        self.own_tools, self.tools = own_tools, tools  # [prompts] bool: the row offers tools of its own

    def __len__(self) -> int:
        return len(self.token_spans)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.subset(numpy.arange(len(self))[index])
        if not -len(self) <= index < len(self):
            raise IndexError(f"prompt {index} of {len(self)}")
        (start, end), (record_start, record_end) = self.token_spans[index], self.record_spans[index]
        reference, messages, own_tools, row = pickle.loads(self.records[record_start:record_end].tobytes())
        tools = own_tools if self.tools is None else self.tools
        return Prompt(self.token_ids[start:end].tolist(), reference, messages, tools or None, row)

    def __eq__(self, other) -> bool:
        return isinstance(other, collections.abc.Sequence) and list(self) == list(other)

    def subset(self, indices: numpy.ndarray) -> "PromptSet":
        """The prompts at `indices`, in that order, viewing the same token and record arrays."""
        return PromptSet(self.token_ids, self.token_spans[indices], self.records, self.record_spans[indices],
                         self.own_tools[indices], self.tools)

    def lengths(self) -> numpy.ndarray:
        """Each prompt's number of tokens."""
        return self.token_spans[:, 1] - self.token_spans[:, 0]

    def offering_tools(self) -> int:
        """How many prompts offer tools (the set's, or their rows' own)."""
        if self.tools is not None:
            return len(self) if self.tools else 0
        return int(self.own_tools.sum())


CACHE_FOLDER = "prompts"


def prompts_from_conversations(conversations: list[list[dict]], tokenizer, tools: list | None = None,
                               cache_dir: pathlib.Path | None = None, rows: list[dict] | None = None) -> PromptSet:
    """Each conversation's turns before its last assistant turn as a prompt, that turn's content as the reference,
    and the data row it came from (`rows`, one per conversation; None: none).

    A conversation's own tools are offered with its prompt; `tools` (schemas or typed, documented functions), when
    given, are offered with every prompt instead. The token ids are read from `cache_dir` when the same prompts were
    rendered with the same tokenizer before (None: no cache; see `prompt_ids`)."""
    cuts = [max(index for index, message in enumerate(turns) if message["role"] == "assistant") for turns in conversations]
    offered = [conversation_data.conversation_tools(turns) if tools is None else tools for turns in conversations]
    turns_before = [list(turns[:cut]) for turns, cut in zip(conversations, cuts)]
    token_ids, offsets = prompt_ids(turns_before, offered, tokenizer, cache_dir)
    records, record_offsets = bytearray(), [0]
    for number, (turns, cut, before, turn_tools) in enumerate(zip(conversations, cuts, turns_before, offered)):
        # One pickle per prompt: a row's strings that its turns share are stored once.
        own_tools = turn_tools if tools is None else None
        records += pickle.dumps((turns[cut]["content"], before, own_tools, None if rows is None else rows[number]))
        record_offsets.append(len(records))
    own = numpy.array([bool(turn_tools) and tools is None for turn_tools in offered], bool)
    return PromptSet(token_ids, spans(offsets), numpy.frombuffer(records, numpy.uint8), spans(record_offsets), own, tools)


def spans(offsets) -> numpy.ndarray:
    """[items, 2] (start, end) of each item from the `items + 1` offsets where each starts (the last: the end)."""
    offsets = numpy.asarray(offsets, numpy.int64)
    return numpy.stack([offsets[:-1], offsets[1:]], axis=1)


def prompt_ids(turns_before: list[list[dict]], offered: list, tokenizer,
               cache_dir: pathlib.Path | None) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Every prompt's token ids, one after another (int32), and the `prompts + 1` offsets where each starts: its turns
    rendered by the chat template with the generation header, then tokenized.

    Rendering is most of a GRPO run's data loading (about 3 s for the bundled task's 11,000 prompts), so the ids are
    kept in `cache_dir` (as SFT's tokenized examples are, one .npz) under a digest of the turns, the tools (schemas
    only: a function's rendering is not cached), the tokenizer and this code. One process renders a missing entry
    while the others sharing the cache wait for it, then read it (`encode.building`); a damaged entry is rendered
    again."""
    def render(index: int) -> str:
        return encode.chat_text(turns_before[index], tokenizer, offered[index], add_generation_prompt=True)

    schemas_only = all(isinstance(tool, dict) for tools in offered for tool in tools or ())
    key = None
    if cache_dir is not None and turns_before and schemas_only:
        key = encode.cache_key({"prompts": turns_before, "tools": offered}, tokenizer, render(0),
                               pathlib.Path(__file__).read_text())
    if key is None:
        return render_and_encode(len(turns_before), render, tokenizer)
    stored = stored_ids(cache_dir, key, len(turns_before))
    if stored is None:
        with encode.building(cache_dir, CACHE_FOLDER, key):  # one process renders; the others wait, then read its entry
            stored = stored_ids(cache_dir, key, len(turns_before))
            if stored is None:
                if (cache_dir / CACHE_FOLDER / f"{key}.npz").exists():  # said by the rank that renders it again
                    log.warning("the prompt cache entry %s is damaged: its prompts are rendered again",
                                cache_dir / CACHE_FOLDER / f"{key}.npz", extra=console.ABOUT_THIS_RANK)
                token_ids, offsets = render_and_encode(len(turns_before), render, tokenizer)
                encode.write_cached_arrays(cache_dir, CACHE_FOLDER, key, {"ids": token_ids, "offsets": offsets})
                return token_ids, offsets
    log.info("prompt tokens read from the cache %s (data.cache=false renders them anew)",
             cache_dir / CACHE_FOLDER / f"{key}.npz")
    return stored


def stored_ids(cache_dir: pathlib.Path, key: str, count: int) -> tuple[numpy.ndarray, numpy.ndarray] | None:
    """The `count` prompts' ids and offsets stored under `key`, or None when the entry is missing or damaged."""
    stored = encode.read_cached_arrays(cache_dir, CACHE_FOLDER, key)
    if stored is not None:
        token_ids, offsets = stored.get("ids"), stored.get("offsets")
        if (token_ids is not None and offsets is not None and token_ids.dtype == numpy.int32 and token_ids.ndim == 1
                and offsets.dtype == numpy.int64 and offsets.shape == (count + 1,) and offsets[0] == 0
                and offsets[-1] == len(token_ids) and (numpy.diff(offsets) >= 0).all()):
            return token_ids, offsets
    return None


def render_and_encode(count: int, render, tokenizer) -> tuple[numpy.ndarray, numpy.ndarray]:
    """`render(index)` of every prompt, tokenized a chunk at a time into one flat array (and the offsets where each
    prompt starts), so no list per prompt is held; a progress line on long work."""
    token_ids, offsets = array.array("i"), [0]
    rendered = (render(index) for index in encode.with_progress(range(count), count, "prompts rendered and tokenized"))
    while chunk := [text for _, text in zip(range(encode.TOKENIZE_CHUNK), rendered)]:
        for ids in encode.encode_texts(chunk, tokenizer):
            token_ids.extend(ids)
            offsets.append(len(token_ids))
    return numpy.frombuffer(token_ids, numpy.int32), numpy.array(offsets, numpy.int64)


def load_prompts(data, tokenizer, path: str, split: str, max_new_tokens: int, tools: list | None = None,
                 cache_dir: pathlib.Path | None = None) -> PromptSet:
    """Prompts of one split of `path`; those leaving no room for `max_new_tokens` within `data.max_seq_len` are skipped and counted.

    `tools`, when given, are offered with every prompt instead of each row's own; `cache_dir` keeps their token ids
    (see `prompts_from_conversations`)."""
    max_tokens = data.max_seq_len - max_new_tokens
    rows = conversation_data.load_split(data, path, split)
    conversations, report = conversation_data.to_conversations(
        rows, prompt_field=data.prompt_field, response_field=data.response_field, messages_field=data.messages_field or None,
        source=f"`{path}` ({split})", reference_last=True)
    every = prompts_from_conversations(conversations, tokenizer, tools, cache_dir, [rows[index] for index in report.kept_rows])
    prompts = every.subset(numpy.flatnonzero(every.lengths() <= max_tokens))
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
    rows are the training rows); a bad `data.eval_path`, or a broken held-out file of the folder `data.path`, is the
    user's error.
    """
    refuse_held_out_files_trained_on(data)
    local = pathlib.Path(data.path).expanduser()
    if not data.eval_path and local.is_file():
        log.warning("no held-out split in %s (one file: its rows are the training rows): evaluation is skipped; set "
                    "data.eval_path to held-out rows, or make data.path a folder with train* and test* files", data.path)
        return None
    # A folder that has the split's files: an error in reading them is theirs, not a missing split.
    has_split = not data.eval_path and data.path not in BUNDLED_DATA and local.is_dir() and held_out_files(local, data)
    try:
        return load(data.eval_path or data.path, data.eval_split)
    except UserError as error:
        if data.eval_path:  # the loaders name data.path; here the file is data.eval_path's
            raise UserError(str(error).replace("data.path", "data.eval_path")) from None
        if has_split:
            raise
        log.warning("no held-out split found, so evaluation is skipped: %s", error)
        return None


def held_out_files(folder: pathlib.Path, data) -> bool:
    """Whether the data folder `folder` has files of the held-out split `data.eval_split`."""
    try:
        return bool(local_files.split_files(folder, local_files.folder_files(folder), data.eval_split, True))
    except UserError:  # no such split
        return False


def refuse_held_out_files_trained_on(data) -> None:
    """A UserError when the held-out split (`data.eval_path`, else the `data.eval_split` files of the folder
    `data.path`) is, or holds, a file that the training split of the folder `data.path` reads (a folder without train*
    files trains on every file not named after a held-out split; `train*` also reads `train_holdout.jsonl`): its rows
    would be trained on and then scored as held-out ones."""
    folder, held_out = (pathlib.Path(path).expanduser().resolve() for path in (data.path, data.eval_path or data.path))
    if not (data.path not in BUNDLED_DATA and folder.is_dir() and held_out.exists()):
        return
    try:  # the files the held-out split reads
        read = [held_out] if held_out.is_file() else local_files.split_files(
            held_out, local_files.folder_files(held_out), data.eval_split, True)
    except UserError:  # no such split: the held-out load says so
        return
    files = [file for file in read if file.is_relative_to(folder)]
    trained = [file for file in files if local_files.reads_any(folder, [file], [(data.train_split, False)])]
    if not trained:
        return
    reads = (f"its files named {data.train_split}*, else every file not named after a held-out split: test*, eval*, "
             "valid*, dev, val")
    if data.eval_path:
        raise UserError(f"`data.eval_path={data.eval_path}` holds {trained[0].relative_to(folder)}, which the training "
                        f"split of `data.path={data.path}` reads too ({reads}): the held-out figures "
                        "would be measured on rows the run trains on. Move the held-out file out of that folder, or "
                        f"name it {data.eval_split}.jsonl (a folder's `data.eval_split` files are held out).")
    raise UserError(f"`data.eval_split={data.eval_split}` reads {trained[0].relative_to(folder)} of "
                    f"`data.path={data.path}`, which the training split reads too ({reads}): the held-out figures "
                    f"would be measured on rows the run trains on. Name the training rows' file {data.train_split}.jsonl "
                    "(or set `--data.train_split` to its name, one the held-out file's name does not start with), or "
                    "move the held-out file out of the folder and set `--data.eval_path` to it.")


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
