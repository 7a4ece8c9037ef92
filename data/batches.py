"""Batches of tokenized samples, shared by SFT and GRPO's rollouts: pad or pack them into rows, collate the rows into
the tensors a forward takes, move them to the device.

Packing shifts each sample on its own (inputs `ids[:-1]`, labels `ids[1:]` per sample), so no label ever
crosses into the next sample and per-token losses equal the unpacked ones.
"""

import dataclasses
import functools
import math

import torch


@dataclasses.dataclass
class Example:
    """One tokenized sample: `input_ids` and a same-length 0/1 `loss_mask`."""

    input_ids: list[int]
    loss_mask: list[int]


def padded_length(examples: list[Example], max_seq_len: int, multiple: int = 1) -> int:
    """The row length a batch of these examples is padded to: the longest input, rounded up to 8 and to `multiple`
    (sequence parallelism's), at most `max_seq_len` (which start-up checks is a multiple of `multiple`)."""
    longest = max(len(example.input_ids) - 1 for example in examples)
    step = math.lcm(8, multiple)
    return min(max_seq_len, step * math.ceil(longest / step))


def padded_length_for(config):
    """`padded_length` at the run's `data.max_seq_len` and sequence multiple (sequence parallelism's)."""
    return functools.partial(padded_length, max_seq_len=config.data.max_seq_len,
                             multiple=config.parallel.sequence_multiple)


def token_budget_microbatches(examples: list[Example], mini_batches: list[list[int]], budget: int, pad,
                              agree_max) -> list[list[int]]:
    """`train.micro_batch_tokens`: each mini-batch's example indices grouped into micro-batches of at most `budget`
    tokens, rows x the padded length `pad(examples)` (verl's `ppo_max_token_len_per_gpu`): longest first, each
    micro-batch filled with the next-longest rows while they fit, so rows of similar length share one. Every mini-batch
    is then split to the same number of micro-batches, `agree_max(the largest count)` (the most over the data-parallel
    ranks, whose forwards must pair up), by halving the micro-batch of most rows. A row longer than the budget goes
    alone (start-up checks the budget holds `data.max_seq_len`)."""
    grouped = []
    for indices in mini_batches:
        order = sorted(indices, key=lambda index: (-len(examples[index].input_ids), index))
        groups: list[list[int]] = []
        for index in order:
            if groups and (len(groups[-1]) + 1) * pad([examples[groups[-1][0]]]) <= budget:
                groups[-1].append(index)
            else:
                groups.append([index])
        grouped.append(groups)
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


def fill_rows(rows_of_examples: list[list[Example]], seq_len: int, pad_id: int) -> tuple[dict, torch.Tensor]:
    """Lay samples out left to right in each row; return the tensors and each position's sample index (-1 = pad)."""
    batch = len(rows_of_examples)
    tokens = torch.full((batch, seq_len), pad_id, dtype=torch.int64)  # [batch, seq]
    labels = torch.full((batch, seq_len), pad_id, dtype=torch.int64)  # [batch, seq]
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.float32)  # [batch, seq]
    position_ids = torch.zeros(batch, seq_len, dtype=torch.int64)  # [batch, seq]
    # Padding is one more segment that attends only to itself, so no attention row is fully masked.
    segment_ids = torch.full((batch, seq_len), -1, dtype=torch.int64)  # [batch, seq]
    for row, examples in enumerate(rows_of_examples):
        start = 0
        for segment, example in enumerate(examples):
            # Each sample is shifted on its own, so its last input predicts its own last token, never
            # the next sample's first: per-token losses match the unpacked batch exactly.
            end = start + len(example.input_ids) - 1
            if end > seq_len:
                raise ValueError(f"samples of {end} input tokens do not fit seq_len={seq_len}")
            tokens[row, start:end] = torch.tensor(example.input_ids[:-1])
            labels[row, start:end] = torch.tensor(example.input_ids[1:])
            loss_mask[row, start:end] = torch.tensor(example.loss_mask[1:], dtype=torch.float32)
            position_ids[row, start:end] = torch.arange(end - start)
            segment_ids[row, start:end] = segment
            start = end
        position_ids[row, start:] = torch.arange(seq_len - start)
    # padding_mask: True after a row's last sample (Mixture-of-Experts routers leave those positions out).
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "padding_mask": segment_ids < 0}, segment_ids


def to_device(batch: dict, device) -> dict:
    """Move a collated batch's tensors to the training device."""
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
