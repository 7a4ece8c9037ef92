"""Batches of tokenized samples, shared by SFT and GRPO's rollouts: pad or pack them into rows, collate the rows into
the tensors a forward takes, move them to the device.

Packing shifts each sample on its own (inputs `ids[:-1]`, labels `ids[1:]` per sample), so no label ever
crosses into the next sample and per-token losses equal the unpacked ones.
"""

import dataclasses
import functools
import math

import numpy
import torch


NUMPY_DTYPES = {torch.int64: numpy.int64, torch.float32: numpy.float32}  # what `rows_tensor` is asked for


def changed_data_note(what: str, saved: dict, count: int, contents: str) -> str | None:
    """A sentence saying how the data a resumed run reads differs from the data its checkpoint was trained on
    (`saved`: its "examples" count and "contents" digest; checkpoints saved before the digest have none), or None.
    The order of an epoch indexes the data by position, so other data at the same positions repeats some rows of the
    epoch and leaves others out."""
    if saved.get("examples", count) != count:
        change = f"holds {count} {what} and the checkpoint's held {saved['examples']}"
    elif saved.get("contents") and contents and saved["contents"] != contents:
        change = f"holds as many {what} as the checkpoint's ({count}), but other ones or in another order"
    else:
        return None
    return (f"the data {change} (its path, rows, max_seq_len or packing changed): the rest of this epoch follows "
            f"another order, so some of its {what} may repeat and others be left out; the epochs after it are whole")


@dataclasses.dataclass
class Example:
    """One tokenized sample: `input_ids` and a same-length 0/1 `loss_mask`."""

    input_ids: list[int]
    loss_mask: list[int]


def padded_size(longest: int, max_seq_len: int, multiple: int = 1) -> int:
    """The row length `longest` input positions are padded to: rounded up to 8 and to `multiple` (sequence
    parallelism's), at most `max_seq_len` (which start-up checks is a multiple of `multiple`)."""
    step = math.lcm(8, multiple)
    return min(max_seq_len, step * math.ceil(longest / step))


def padded_length(examples: list[Example], max_seq_len: int, multiple: int = 1) -> int:
    """The row length a batch of these examples is padded to: `padded_size` of the longest input."""
    return padded_size(max(len(example.input_ids) - 1 for example in examples), max_seq_len, multiple)


def padded_length_for(config):
    """`padded_length` at the run's `data.max_seq_len` and sequence multiple (sequence parallelism's)."""
    return functools.partial(padded_length, max_seq_len=config.data.max_seq_len,
                             multiple=config.parallel.sequence_multiple)


def padded_size_for(config):
    """`padded_size` at the run's `data.max_seq_len` and sequence multiple (sequence parallelism's)."""
    return functools.partial(padded_size, max_seq_len=config.data.max_seq_len, multiple=config.parallel.sequence_multiple)


def token_budget_microbatches(lengths, mini_batches: list[list[int]], budget: int, pad, agree_max,
                              members: list[list[int]] | None = None) -> list[list[int]]:
    """`train.micro_batch_tokens`: each mini-batch's row indices grouped into micro-batches of at most `budget`
    tokens, rows x the padded length `pad(the longest row's input positions)` (verl's `ppo_max_token_len_per_gpu`):
    longest first (`lengths[index]`, a row's input positions), each micro-batch filled with the next-longest rows while they
    fit, so rows of similar length share one. Every mini-batch is then split to the same number of micro-batches,
    `agree_max(the largest count)` (the most over the data-parallel ranks, whose forwards must pair up), by halving
    the micro-batch of most rows. A row longer than the budget goes alone (start-up checks the budget holds
    `data.max_seq_len`). With `members`, index i is one row of the model's input holding the rows `members[i]` (a GRPO
    group with its prompt once): the micro-batches list those rows, and halving splits them."""
    grouped = []
    for indices in mini_batches:
        order = sorted(indices, key=lambda index: (-lengths[index], index))
        groups: list[list[int]] = []
        for index in order:
            if groups and (len(groups[-1]) + 1) * pad(lengths[groups[-1][0]]) <= budget:
                groups[-1].append(index)
            else:
                groups.append([index])
        grouped.append(groups if members is None else [[row for index in group for row in members[index]]
                                                         for group in groups])
    count = agree_max(max(len(groups) for groups in grouped))
    for groups in grouped:
        while len(groups) < count:  # never short of rows: every rank's mini-batch has as many as the others'
            largest = max(range(len(groups)), key=lambda number: len(groups[number]))
            rows = groups[largest]
            groups[largest : largest + 1] = [rows[: (len(rows) + 1) // 2], rows[(len(rows) + 1) // 2 :]]
    return [group for groups in grouped for group in groups]


def padding_counts(microbatches: list[dict]) -> list[float]:
    """[padded positions, all positions] of collated micro-batches: what `padding_share` in metrics.jsonl divides."""
    return [float(sum(int(batch["padding_mask"].sum()) for batch in microbatches)),
            float(sum(batch["tokens"].numel() for batch in microbatches))]


def collate(examples: list[Example], seq_len: int, pad_id: int) -> dict:
    """Right-pad examples into `tokens`, `labels`, `loss_mask`, `position_ids` and `padding_mask` of shape [batch, seq]."""
    batch, _ = fill_rows([[example] for example in examples], seq_len, pad_id)
    # Plain causal attention is the model's default, and right padding never precedes a real token.
    return batch | {"attention_mask": None}


def pack(examples: list[Example], seq_len: int) -> list[list[Example]]:
    """Group examples into rows of at most `seq_len` input tokens, first fit, in order."""
    rows: list[list[Example]] = []
    free: list[int] = []  # input tokens still free in each row
    for example in examples:
        length = len(example.input_ids) - 1
        if length > seq_len:
            raise ValueError(f"an example of {length} input tokens does not fit seq_len={seq_len}")
        row = next((index for index, space in enumerate(free) if space >= length), None)
        if row is None:
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append(example)
        free[row] -= length
    return rows


def collate_packed(rows_of_examples: list[list[Example]], seq_len: int, pad_id: int) -> dict:
    """Collate packed rows: positions restart per sample; `attention_mask` is block-diagonal causal, True = masked."""
    batch, segment_ids = fill_rows(rows_of_examples, seq_len, pad_id)
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # [batch, query, key]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()  # [query, key]
    return batch | {"attention_mask": ~(same_segment & causal)[:, None]}  # mask: [batch, 1, query, key]


def common_prefix(examples: list[Example]) -> int:
    """How many input positions (`input_ids[:-1]`) all the examples share from their start."""
    first = examples[0].input_ids
    length = len(first) - 1
    for example in examples[1:]:
        length = _shared_start(first, example.input_ids, length)
    return length


def _shared_start(first: list[int], ids: list[int], limit: int) -> int:
    """How many input positions `ids` shares with `first` from the start, at most `limit`."""
    limit, length = min(limit, len(ids) - 1), 0
    while length < limit and ids[length] == first[length]:
        length += 1
    return length


def shared_length(examples: list[Example]) -> int:
    """Input positions of examples laid out in one row with their common prefix once: the prefix, then each one's own."""
    return sum(len(example.input_ids) - 1 for example in examples) - (len(examples) - 1) * common_prefix(examples)


def prompt_units(examples: list[Example], rows: list[int], group_size: int, limit: int) -> list[list[int]]:
    """`rows` (in order) as units of one shared row each: consecutive rows of one prompt group (`row // group_size`),
    as many as fit `limit` input positions laid out with their common prefix once (`shared_length`)."""
    units: list[list[int]] = []
    prefix = total = 0  # the last unit's common prefix and its rows' input positions
    for row in rows:
        ids = examples[row].input_ids
        if units and units[-1][0] // group_size == row // group_size:
            shared = _shared_start(examples[units[-1][0]].input_ids, ids, prefix)
            if total + len(ids) - 1 - len(units[-1]) * shared <= limit:
                units[-1].append(row)
                prefix, total = shared, total + len(ids) - 1
                continue
        units.append([row])
        prefix = total = len(ids) - 1
    return units


def collate_shared(units: list[list[Example]], seq_len: int, packed_len: int, pad_id: int) -> dict:
    """Collate rows whose units share a prefix (a GRPO group's prompt): the model's input has one row per unit, the
    prefix once and then each example's own positions, while the loss's tensors keep `collate`'s layout.

    Model input, [units, packed_len]: `tokens`, `position_ids` (each example's own positions continue from the prefix,
    so every token has the position it has in its own row; `model.shared_prefix` rotates by them), `padding_mask`, and
    `attention_mask` [units, 1, packed, packed] (True = masked): causal, each example seeing the prefix and itself.
    Every token so has the context it has alone, and so the same hidden state. The loss's layout, [rows, seq_len]:
    `labels` and `loss_mask` as `collate`'s; `hidden_index` [rows, seq_len], each position's place in the flattened
    [units x packed_len] input (the prefix's for a position within it: one hidden state read by every example);
    `source_index` [units, packed_len], each input position's place in the flattened [rows x seq_len] layout (-1 on
    padding), to lay per-token inputs such as routes out like `tokens`."""
    layout = collate([example for unit in units for example in unit], seq_len, pad_id)
    tokens, positions, segments, sources, hidden = [], [], [], [], []
    row = 0
    for number, unit in enumerate(units):
        prefix, base = common_prefix(unit), number * packed_len
        unit_tokens, unit_positions = list(unit[0].input_ids[:prefix]), list(range(prefix))
        unit_segments, unit_sources = [0] * prefix, list(range(row * seq_len, row * seq_len + prefix))
        for segment, example in enumerate(unit, start=1):
            length, start = len(example.input_ids) - 1, len(unit_tokens)
            unit_tokens += example.input_ids[prefix:length]
            unit_positions += range(prefix, length)
            unit_segments += [segment] * (length - prefix)
            unit_sources += range(row * seq_len + prefix, row * seq_len + length)
            own = range(base + start, base + start + length - prefix)
            hidden.append([*range(base, base + prefix), *own] + [0] * (seq_len - length))
            row += 1
        if len(unit_tokens) > packed_len:
            raise ValueError(f"a unit of {len(unit_tokens)} input positions does not fit packed_len={packed_len}")
        fill = packed_len - len(unit_tokens)
        tokens.append(unit_tokens + [pad_id] * fill)
        positions.append(unit_positions + list(range(fill)))
        segments.append(unit_segments + [-1] * fill)
        sources.append(unit_sources + [-1] * fill)
    segment_ids = rows_tensor(segments, packed_len, torch.int64)  # [units, packed]: 0 the prefix, -1 padding
    # A query sees the earlier keys of the prefix and of its own segment (padding: of the padding, never empty).
    causal = torch.ones(packed_len, packed_len, dtype=torch.bool).tril()  # [query, key]
    keys, queries = segment_ids[:, None, :], segment_ids[:, :, None]
    allowed = causal & ((keys == 0) | (keys == queries))  # [units, query, key]
    return {"tokens": rows_tensor(tokens, packed_len, torch.int64), "position_ids": rows_tensor(positions, packed_len, torch.int64),
            "padding_mask": segment_ids < 0, "attention_mask": ~allowed[:, None], "labels": layout["labels"],
            "loss_mask": layout["loss_mask"], "hidden_index": rows_tensor(hidden, seq_len, torch.int64),
            "source_index": rows_tensor(sources, packed_len, torch.int64)}


def fill_rows(rows_of_examples: list[list[Example]], seq_len: int, pad_id: int) -> tuple[dict, torch.Tensor]:
    """Lay samples out left to right in each row; return the tensors and each position's sample index (-1 = pad)."""
    # Built as Python lists, one tensor per field: a tensor per sample and field cost 6 small operators a sample.
    tokens, labels, loss_mask, position_ids, segment_ids = [], [], [], [], []  # each [batch][seq]
    for examples in rows_of_examples:
        row_tokens, row_labels, row_loss_mask, row_positions, row_segments = [], [], [], [], []
        for segment, example in enumerate(examples):
            # Each sample is shifted on its own, so its last input predicts its own last token, never
            # the next sample's first: per-token losses match the unpacked batch exactly.
            length = len(example.input_ids) - 1
            if len(row_tokens) + length > seq_len:
                raise ValueError(f"samples of {len(row_tokens) + length} input tokens do not fit seq_len={seq_len}")
            row_tokens += example.input_ids[:-1]
            row_labels += example.input_ids[1:]
            row_loss_mask += example.loss_mask[1:]
            row_positions += range(length)
            row_segments += [segment] * length
        # Padding is one more segment that attends only to itself, so no attention row is fully masked.
        fill = seq_len - len(row_tokens)
        tokens.append(row_tokens + [pad_id] * fill)
        labels.append(row_labels + [pad_id] * fill)
        loss_mask.append(row_loss_mask + [0] * fill)
        position_ids.append(row_positions + list(range(fill)))
        segment_ids.append(row_segments + [-1] * fill)
    segment_ids = rows_tensor(segment_ids, seq_len, torch.int64)
    # padding_mask: True after a row's last sample (Mixture-of-Experts routers leave those positions out).
    return {"tokens": rows_tensor(tokens, seq_len, torch.int64), "labels": rows_tensor(labels, seq_len, torch.int64),
            "loss_mask": rows_tensor(loss_mask, seq_len, torch.float32),
            "position_ids": rows_tensor(position_ids, seq_len, torch.int64), "padding_mask": segment_ids < 0}, segment_ids


def rows_tensor(rows: list[list], seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Equal-length lists of Python numbers as one [rows, seq_len] tensor of `dtype` (no rows: an empty one of that
    shape), through numpy, which converts a list faster than `torch.tensor` does (the same values)."""
    return torch.from_numpy(numpy.array(rows, dtype=NUMPY_DTYPES[dtype]).reshape(len(rows), seq_len))


def to_device(batch: dict, device) -> dict:
    """Move a collated batch's tensors to the training device."""
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
