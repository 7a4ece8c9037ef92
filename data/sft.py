"""SFT data: conversations (`data.conversations`) tokenized with a loss mask, cached, and ordered into batches.

Truncation policy: a tokenized sample longer than `max_seq_len + 1` tokens is cut from the right to
`max_seq_len + 1` tokens (inputs are `ids[:-1]`, labels `ids[1:]`, so both then fit in `max_seq_len`)
and counted as truncated; if the cut leaves no loss token among the labels the sample is dropped and
counted. A conversation whose turn pieces tokenize differently from its whole rendering (a response
starting with a newline merges with the header's) is dropped and counted rather than masked by guess, and so
is one with a message its chat template does not write (a role the template does not know).
Every row read is either used or counted in the `DropReport` under one reason.

Tool use: each assistant turn is learned from after its header through the eos token that closes it, its rendered tool
calls included; tool results and the template's text around them are not.

Tokenized examples are kept in flat arrays (`TokenizedExamples`) and in a cache (`cached_examples`) keyed by everything
tokenizing reads, so a restarted or repeated run skips the work.

Batching (padding, packing, collating) is `data.batches`, which GRPO's rollouts share.
"""

import array
import collections.abc
import json
import logging
import pathlib

import numpy
import torch

from config.errors import UserError
from config import hf
from config.hf import TEMPLATE_VARIABLES, special_texts, turn_end
from data import batches
from data.batches import Example
from data.conversations import DropReport, conversation_tools, says_something
from data.encode import (TOKENIZE_CHUNK, building, cache_key, chat_text, encode_batch, encode_texts, read_cached_arrays,
                         template_error, with_progress, write_cached_arrays)

log = logging.getLogger(__name__)

# --- tokenization -----------------------------------------------------------------------------


def tokenize_conversation(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """Return `(input_ids, loss_mask)` with 1 exactly on each assistant turn after its header, through its eos token.

    The learned part is the turn's content, its rendered tool calls, and the end-of-turn token that closes it."""
    tokenized = tokenize_conversations([messages], tokenizer)[0]
    if isinstance(tokenized, str):
        raise template_error(tokenizer, "a token of the whole text crosses the edge of an assistant turn"
                                        if tokenized == MERGED else tokenized)
    return tokenized


# Why `tokenize_conversations` drops a conversation whose token crosses the edge of a learned span.
MERGED = "tokens merge across a turn boundary"


def tokenize_conversations(conversations: list[list[dict]], tokenizer) -> list[tuple[list[int], list[int]] | str]:
    """Tokenize like `tokenize_conversation`, the whole renderings in one batched call; for a conversation that cannot
    be learned as the data gives it, the reason it is dropped: a message its rendering leaves out (`unrendered`), an
    assistant turn with nothing to learn but its end (`empty_turn`), or a token across the edge of a learned span
    (`MERGED`: a response starting with a newline merges with the header's).

    The ids are those of the whole rendering, so a tokenizer that writes a word differently at the start of a text
    (SentencePiece's leading space, Mistral's and Llama 2's) gets the ids the model reads; the mask comes from each
    token's characters."""
    split = [split_turns(messages, tokenizer) for messages in conversations]
    if not getattr(tokenizer, "is_fast", False):
        tokenized = [tokenize_pieces(spans, rendered, tokenizer) for spans, rendered in split]
    else:
        encodings = encode_batch([rendered for _, rendered in split], tokenizer)
        tokenized = [token_mask(encoding.ids, encoding.offsets, spans, len(rendered))
                     for (spans, rendered), encoding in zip(split, encodings)]
    return [unrendered(messages, rendered) or empty_turn(messages) or (MERGED if pair is None else pair)
            for messages, (_, rendered), pair in zip(conversations, split, tokenized)]


def empty_turn(messages: list[dict]) -> str | None:
    """Why a conversation is not learned as the data gives it: a learned assistant turn with nothing in it (blank
    content, no tool calls, no reasoning), whose learned span is the end-of-turn token alone: the model was taught to
    close its turn at once, where the same turn as a prompt/response pair is dropped as an empty response. None when
    every learned turn has something."""
    for message in messages:
        said = says_something(message) or (message.get("reasoning_content") or "").strip()
        if message["role"] == "assistant" and message.get("weight") != 0 and not said:
            return "an empty assistant turn"
    return None


def unrendered(messages: list[dict], rendered: str) -> str | None:
    """Why a conversation's rendering is not the conversation the data gives: the first message, other than the
    assistant's, whose content it leaves out (as written, trimmed, or escaped as a template's `tojson` writes it), or
    None. Qwen's templates write nothing for a role they do not know (`function`, `developer`), so the answer after
    such a message was learned without it."""
    for message in messages:
        content = message["content"].strip()
        if message["role"] == "assistant" or not content or content in rendered:
            continue
        if not any(form in rendered for form in (json.dumps(content)[1:-1], json.dumps(content, ensure_ascii=False)[1:-1])):
            return f"a {message['role']!r} message the chat template does not render"
    return None


def token_mask(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
               length: int) -> tuple[list[int], list[int]] | None:
    """`(ids, loss_mask)`: 1 on tokens whose characters lie in `spans`, None when a token has characters on both sides
    of a span's edge. Characters a token's offsets leave out (trimmed whitespace) belong to the token after them; a
    token whose characters an earlier one already took (byte pieces of one character) follows that token."""
    learned = bytearray(length)
    for start, end in spans:
        learned[start:end] = b"\x01" * (end - start)
    mask, covered, flag = [], 0, learned[0] if length else 0
    for _, end in offsets:
        if end > covered:
            chars = set(learned[covered:end])
            if len(chars) > 1:
                return None
            flag, covered = chars.pop(), end
        mask.append(flag)
    return ids, mask


def tokenize_pieces(spans: list[tuple[int, int]], rendered: str, tokenizer) -> tuple[list[int], list[int]] | None:
    """A slow tokenizer's (no offsets): each piece between the spans' edges tokenized alone, None unless together they
    are the whole rendering's ids."""
    edges = sorted({0, len(rendered), *(edge for span in spans for edge in span)})
    input_ids, loss_mask = [], []
    for start, end, ids in zip(edges, edges[1:], encode_texts([rendered[a:b] for a, b in zip(edges, edges[1:])], tokenizer)):
        input_ids += ids
        loss_mask += [int(any(a <= start < b for a, b in spans))] * len(ids)
    return (input_ids, loss_mask) if input_ids == encode_texts([rendered], tokenizer)[0] else None


def split_turns(messages: list[dict], tokenizer) -> tuple[list[tuple[int, int]], str]:
    """Return the character spans learned in the whole rendering of `messages`, and that rendering.

    Each assistant turn is found where the whole conversation puts it: after the rendering of the turns before it with
    the generation prompt (which must be how the whole rendering starts). Its learned span runs from there through
    the special token that closes it, which is the first one after the content when the turn is rendered last. A
    template that renders a turn differently once more turns follow (Qwen3 drops a think block from every turn before
    the last user turn) is learned as the whole conversation shows it."""
    tools = conversation_tools(messages)
    rendered = chat_text(messages, tokenizer, tools)
    # A turn of weight 0 (OpenAI's fine-tuning form) is context only, as the user's turns are.
    turns = [index for index, message in enumerate(messages)
             if message["role"] == "assistant" and message.get("weight") != 0]
    contexts = [chat_text(messages[:index], tokenizer, tools) for index in turns]
    spans = []
    for index, context, following in zip(turns, contexts, [*contexts[1:], rendered]):
        prompted = chat_text(messages[:index], tokenizer, tools, add_generation_prompt=True)
        # The turn as the generation prompt is answered: the whole rendering when it is the last turn (a render less
        # a conversation, a quarter of a prompt/response pair's).
        last = rendered if index + 1 == len(messages) else chat_text(messages[: index + 1], tokenizer, tools)
        if not (rendered.startswith(context) and len(context) >= (spans[-1][1] if spans else 0)):
            system = any(message["role"] == "system" for message in messages)
            raise template_error(tokenizer, "rendering more turns rewrites earlier ones" + (
                " (this conversation has a system message, which some templates write only before the last user turn, "
                "Mistral v0.3's among them: fold it into the first user message, or leave it out)" if system else ""))
        if not (prompted.startswith(context) and rendered.startswith(prompted) and following.startswith(prompted)):
            header = prompted[len(context) :] if prompted.startswith(context) else prompted
            variables = getattr(tokenizer, TEMPLATE_VARIABLES, None)
            raise template_error(tokenizer, f"its generation prompt {header!r} is not how it renders an assistant turn "
                                            "once written (DeepSeek-R1's opens a think block only in the prompt" + (
                                                f"; here with `data.chat_template_kwargs={variables}`, whose prompt "
                                                "Qwen3 writes on the last turn only: leave the key out for rows of "
                                                "several assistant turns" if variables else "") + ")")
        # Up to the next assistant turn's context: this turn, and the turns after it that are not the assistant's.
        turn, alone, content = rendered[len(prompted) : len(following)], last[len(prompted) :], messages[index]["content"]
        if content not in turn:  # a template that trims (Llama 3's `| trim`) shows the trimmed text
            content = content.strip()
        # What a template writes between the header and the content (Qwen3's <think> block on the last turn) is
        # learned with it: after the generation prompt the model writes it itself.
        start, start_alone = turn.find(content), alone.find(content)
        # The turn's end (`closing_token`): the special token after the content that closes the turn. A template that
        # rewrites the content (Qwen3 moves a `<think>...</think>` at its start into a block of its own) shows it
        # nowhere whole: the turn is learned as rendered, through the template's turn end.
        if start < 0 or start_alone < 0:
            start, content, end = 0, "", turn_end(tokenizer)
        else:
            end = closing_token(tokenizer, alone[start_alone + len(content) :])
        if not (last.startswith(prompted) and end and end in turn[start + len(content) :] and end in alone):
            raise template_error(tokenizer, "an assistant turn is not header + content (+ tool calls) + "
                                            "end-of-turn token")
        # Learn the content, the rendered tool calls, and the token that ends the turn, so generation knows when
        # to stop; the search starts after the content, so content quoting the end text does not end it early.
        spans.append((len(prompted), len(prompted) + turn.index(end, start + len(content)) + len(end)))
    return spans, rendered


def closing_token(tokenizer, after: str) -> str | None:
    """The special token that closes an assistant turn, of `after`, the turn's text after its content when it is
    rendered last: the first special token there (the end token, or the template's own, such as ChatML's <|im_end|>
    under a base model's tokenizer whose end token is <|endoftext|>), unless more follow it. A tool call may open with
    a special token of its own (Mistral's `[TOOL_CALLS]`, Llama 3.1's `<|python_tag|>`): there the turn closes at the
    template's turn end (`turn_end`) when the turn writes it, else at its last special token, so the call and the
    token that ends it are learned, not the opening token alone."""
    specials = [special for special in special_texts(tokenizer) if special and special in after]
    if len(specials) < 2:
        return specials[0] if specials else None
    closing = turn_end(tokenizer)
    if closing in after:
        return closing
    return max((after.rfind(special), len(special), special) for special in specials)[2]


class TokenizedExamples(collections.abc.Sequence):
    """Tokenized examples held as three flat arrays (every example's ids one after another, their loss masks, where
    each starts) instead of a Python list per example: about 5 bytes a token where lists of ints take 40-50, on every
    rank. Indexing gives an `Example`; a slice, a list of them."""

    def __init__(self, input_ids: numpy.ndarray, loss_mask: numpy.ndarray, starts: numpy.ndarray):
        self.input_ids, self.loss_mask, self.starts = input_ids, loss_mask, starts

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[number] for number in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"example {index} of {len(self)}")
        start, end = self.starts[index % len(self)], self.starts[index % len(self) + 1]
        return Example(self.input_ids[start:end].tolist(), self.loss_mask[start:end].tolist())

    def __eq__(self, other) -> bool:
        return isinstance(other, collections.abc.Sequence) and list(self) == list(other)


def build_examples(conversations: list[list[dict]], tokenizer, max_seq_len: int, report: DropReport) -> TokenizedExamples:
    """Tokenize conversations, truncate them to `max_seq_len + 1` tokens and drop those left with no loss token; each
    example is appended to flat arrays as it comes, so no list per example is held."""
    if not report.kept_rows:
        # A report that did not come from `to_conversations` counts conversations as its rows.
        report.rows_read, report.kept_rows = len(conversations), list(range(len(conversations)))
    input_ids_flat, loss_mask_flat, starts, kept_rows = array.array("i"), bytearray(), [0], []
    # Chunks keep the batched tokenizer calls fast without holding every rendering at once.
    tokenized = (pair for start in range(0, len(conversations), TOKENIZE_CHUNK)
                 for pair in tokenize_conversations(conversations[start : start + TOKENIZE_CHUNK], tokenizer))
    for row, pair in with_progress(zip(report.kept_rows, tokenized, strict=True), len(conversations),
                                   "conversations tokenized"):
        if isinstance(pair, str):
            report.drop(row, pair)
            continue
        input_ids, loss_mask = pair
        truncated = len(input_ids) > max_seq_len + 1
        input_ids, loss_mask = input_ids[: max_seq_len + 1], loss_mask[: max_seq_len + 1]
        # The first token is never a label, so its mask does not count.
        if not any(loss_mask[1:]):
            report.drop(row, "no loss tokens after truncation")
            continue
        report.truncated += truncated
        input_ids_flat.extend(input_ids)
        loss_mask_flat.extend(loss_mask)
        starts.append(len(input_ids_flat))
        kept_rows.append(row)
    report.kept_rows = kept_rows
    if not kept_rows:
        raise UserError(f"No usable SFT example is left after tokenizing: {report.summary()}. Raise data.max_seq_len "
                        f"(now {max_seq_len}) if samples lost every response token, or change data.path (or the "
                        "model, when its chat template merges tokens across every turn boundary).")
    return TokenizedExamples(numpy.frombuffer(input_ids_flat, numpy.int32), numpy.frombuffer(loss_mask_flat, numpy.uint8),
                             numpy.array(starts, numpy.int64))


def warn_if_reasoning_unrendered(conversations: list[list[dict]], tokenizer) -> None:
    """Say so when the chat template leaves out the `reasoning_content` the data gives (a template without think
    blocks, such as Qwen2.5's): it is then not learned. Read on the first conversation whose last assistant turn has
    some (earlier turns' a template may drop by design, as Qwen3's does)."""
    for messages in conversations:
        last = next((message for message in reversed(messages) if message["role"] == "assistant"), {})
        reasoning = (last.get("reasoning_content") or "").strip()
        if reasoning:
            if reasoning not in chat_text(messages, tokenizer, conversation_tools(messages)):
                log.warning("the chat template of %s does not render the assistant turns' `reasoning_content`: it is "
                            "not learned. Use a model whose template writes it (Qwen3's think blocks), or put the "
                            "reasoning into the content", tokenizer.name_or_path)
            return


# --- cache of tokenized examples -----------------------------------------------------------------

CACHE_FOLDER = "sft-examples"


def examples_cache_key(conversations: list[list[dict]], tokenizer, max_seq_len: int, report: DropReport) -> str | None:
    """A digest of everything `build_examples` reads, or None for a slow tokenizer: the conversations and their tools,
    the report's row numbering so far, `max_seq_len`, the tokenizer (`tokenizer_digest_parts`, the first
    conversation rendered) and the turn-splitting code (this module and `config.hf`)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    state = {"conversations": conversations, "tools": [conversation_tools(messages) for messages in conversations],
             "max_seq_len": max_seq_len, "rows_read": report.rows_read,
             "kept_rows": report.kept_rows, "dropped": sorted(report.dropped_by_reason.items()),
             "first_drops": report.first_drops, "truncated": report.truncated}
    first = chat_text(conversations[0], tokenizer, conversation_tools(conversations[0])) if conversations else ""
    # The turn-splitting code is this module and `config.hf`, whose special-token helpers find where each turn ends.
    return cache_key(state, tokenizer, first, pathlib.Path(__file__).read_text(), pathlib.Path(hf.__file__).read_text())


def cached_examples(conversations: list[list[dict]], tokenizer, max_seq_len: int, report: DropReport,
                    cache_dir: pathlib.Path | None) -> TokenizedExamples:
    """`build_examples`, read from `cache_dir` when these conversations were tokenized the same way before (the
    report then reads as if tokenized now); otherwise built and written there. None: no cache.

    One process builds a missing entry while the others sharing the cache (the run's ranks, a run beside it) wait for it
    and read it (`encode.building`); each write is atomic, so ranks and nodes agree. A damaged entry is rebuilt; a cache
    that cannot be written is left out with a warning."""
    warn_if_reasoning_unrendered(conversations, tokenizer)
    key = examples_cache_key(conversations, tokenizer, max_seq_len, report) if cache_dir is not None else None
    if key is None:
        return build_examples(conversations, tokenizer, max_seq_len, report)
    examples = restored_examples(read_cached_arrays(cache_dir, CACHE_FOLDER, key), report)
    if examples is None:
        with building(cache_dir, CACHE_FOLDER, key):
            # Another rank (or run) may have built the entry while this one waited for it.
            examples = restored_examples(read_cached_arrays(cache_dir, CACHE_FOLDER, key), report)
            if examples is None:
                examples = build_examples(conversations, tokenizer, max_seq_len, report)
                restored = {"kept_rows": report.kept_rows, "truncated": report.truncated,
                            "dropped": sorted(report.dropped_by_reason.items()), "first_drops": report.first_drops}
                write_cached_arrays(cache_dir, CACHE_FOLDER, key,
                                    {"input_ids": examples.input_ids, "loss_mask": examples.loss_mask,
                                     "starts": examples.starts, "report": numpy.array(json.dumps(restored))})
                return examples
    log.info("tokenized examples read from the cache %s (data.cache=false tokenizes anew)",
             cache_dir / CACHE_FOLDER / f"{key}.npz")
    return examples


def restored_examples(stored: dict | None, report: DropReport) -> TokenizedExamples | None:
    """The examples of a cache entry, with `report` set as it read when they were tokenized; None for a missing or
    damaged entry (`report` left as it was)."""
    try:
        examples = TokenizedExamples(stored["input_ids"], stored["loss_mask"], stored["starts"])
        restored = json.loads(str(stored["report"]))
        kept_rows, truncated = restored["kept_rows"], restored["truncated"]
        dropped, first_drops = collections.Counter(dict(restored["dropped"])), [tuple(drop) for drop in restored["first_drops"]]
        whole = examples.starts[-1] == len(examples.input_ids) == len(examples.loss_mask) and len(examples) == len(kept_rows)
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    if not whole:
        return None
    report.kept_rows, report.truncated, report.dropped_by_reason, report.first_drops = kept_rows, truncated, dropped, first_drops
    return examples


# --- order ------------------------------------------------------------------------------------


def rows_left_out_note(num_examples: int, global_batch_size: int) -> str:
    """The start-up data line's note on the rows each epoch leaves out (`BatchSchedule` takes whole global batches):
    empty when the global batch size divides the examples."""
    left_out = num_examples % global_batch_size
    if num_examples < global_batch_size or not left_out:
        return ""
    return (f"; {left_out} rows an epoch are left out (reshuffled each epoch): an epoch trains on "
            f"{num_examples - left_out}, whole batches of train.global_batch_size={global_batch_size}")


class BatchSchedule:
    """Seeded, per-epoch reshuffled order of example indices, split into this data-parallel rank's microbatches.

    The batch sizes divide as start-up validation checked (`TrainerConfig.validate`)."""

    def __init__(self, num_examples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, contents: str = ""):
        if num_examples < global_batch_size:
            raise UserError(f"The data has {num_examples} usable examples, fewer than one global batch; lower "
                            f"train.global_batch_size (now {global_batch_size}) or add data.")
        self.micro_batch_size, self.dp_rank, self.dp_size, self.seed = micro_batch_size, dp_rank, dp_size, seed
        self.num_examples, self.global_batch_size = num_examples, global_batch_size
        self.contents = contents  # a digest of the examples (`model.collectives.content_digest`), said when it changes
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        # The incomplete tail of each epoch is dropped so that every global batch is full (the start-up data line
        # says how many rows: `rows_left_out_note`).
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
        return {"epoch": self.epoch, "batches_consumed_in_epoch": self.batches_consumed_in_epoch, "seed": self.seed,
                "examples": self.num_examples, "contents": self.contents}

    def load_state_dict(self, state: dict) -> None:
        """Continue the order from a checkpoint's position, with the checkpoint's seed; said when the data now holds
        other examples (the order of the epoch's rest then picks others: `batches.changed_data_note`)."""
        if note := batches.changed_data_note("examples", state, self.num_examples, self.contents):
            log.info(note)
        if state["batches_consumed_in_epoch"] > self.batches_per_epoch:
            raise UserError(f"The checkpoint's data position ({state['batches_consumed_in_epoch']} batches into the "
                            f"epoch) is past this data's {self.batches_per_epoch} batches per epoch; resume with the "
                            "same data.path and train.global_batch_size it was saved with.")
        self.epoch, self.batches_consumed_in_epoch, self.seed = (
            state["epoch"], state["batches_consumed_in_epoch"], state["seed"])
        self.order_epoch = -1  # the seed may have changed, so the cached order is stale

