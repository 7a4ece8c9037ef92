"""A GRPO step's micro-batches as tensors: which rows go together (`train.micro_batch_size` rows, or a token budget;
with the prompts shared, whole groups), and each micro-batch's collated input, the loss's layout, the sampler's
log-probs and a Mixture-of-Experts rollout's routes (`trainer.grpo_update` adds the forwards' log-probs)."""

import torch

from data import batches
from model import collectives
from trainer.grpo_sampling import StepBatch


def microbatch_rows(step_batch: StepBatch, config, share_prompts: bool) -> list[list[int]]:
    """The step batch's rows of each micro-batch, within each of the `grpo.mini_batches`: `train.micro_batch_size`
    rows in order (with the prompts shared, groups ordered by their shared row's length, so a micro-batch's shared rows
    are of similar length), or grouped by length (`train.micro_batch_tokens`, `data.batches.token_budget_microbatches`;
    with the prompts shared, each group's rows stay together, budgeted as the one row they are laid out in); either
    way every mini-batch has the same number of micro-batches on every rank."""
    examples, budget = step_batch.examples, config.train.micro_batch_tokens
    per_mini_batch = len(examples) // config.grpo.mini_batches
    mini_batches = [list(range(start, start + per_mini_batch)) for start in range(0, len(examples), per_mini_batch)]
    pad = batches.padded_size_for(config)
    if not share_prompts:
        if not budget:
            size = config.train.micro_batch_size
            return [list(range(start, min(start + size, len(examples)))) for start in range(0, len(examples), size)]
        lengths = [len(example.input_ids) - 1 for example in examples]
        return batches.token_budget_microbatches(lengths, mini_batches, budget, pad, collectives.world_max)
    units, unit_mini_batches = [], []
    for rows in mini_batches:
        found = batches.prompt_units(examples, rows, config.grpo.n_samples, config.data.max_seq_len)
        unit_mini_batches.append(list(range(len(units), len(units) + len(found))))
        units += found
    lengths = [batches.shared_length([examples[row] for row in unit]) for unit in units]
    if budget:
        return batches.token_budget_microbatches(lengths, unit_mini_batches, budget, pad, collectives.world_max, units)
    size = config.train.micro_batch_size
    microbatches = []
    for numbers in unit_mini_batches:
        rows = [row for number in sorted(numbers, key=lambda number: -lengths[number]) for row in units[number]]
        microbatches += [rows[start : start + size] for start in range(0, len(rows), size)]
    return microbatches


def collate_rows(step_batch: StepBatch, rows: list[int], seq_len: int, config, share_prompts: bool, pad_id: int) -> dict:
    """One micro-batch's tensors: the model's input (with the prompts shared, a row per group, `batches.collate_shared`),
    the loss's [rows, seq_len] layout, the sampler's log-probs and a Mixture-of-Experts rollout's routes."""
    examples = [step_batch.examples[row] for row in rows]
    if share_prompts:
        units = [[step_batch.examples[row] for row in unit]
                 for unit in batches.prompt_units(step_batch.examples, rows, config.grpo.n_samples, config.data.max_seq_len)]
        packed_len = batches.padded_size_for(config)(max(batches.shared_length(unit) for unit in units))
        batch = batches.collate_shared(units, seq_len, packed_len, pad_id)
    else:
        batch = batches.collate(examples, seq_len, pad_id)
    batch["sampler_logprobs"] = label_aligned([step_batch.sampler_logprobs[row] for row in rows], seq_len)  # [micro, seq]
    if step_batch.routes is not None:
        routes, routed = input_aligned_routes([step_batch.routes[row] for row in rows], seq_len)
        if share_prompts:  # laid out as the input: each position's routes from its place in the layout
            source = batch["source_index"]  # [units, packed]
            routes = routes.flatten(0, 1)[source.clamp(min=0)]  # [units, packed, layers, top-k]
            routed = routed.flatten()[source.clamp(min=0)] & (source >= 0)  # [units, packed]
        batch["routes"], batch["routed"] = routes, routed
    return batch


def label_aligned(values: list[list[float]], seq_len: int) -> torch.Tensor:
    """Per-input-id values (one list per example) laid out like `batches.collate`'s labels: [rows, seq], 0 on pads."""
    # One tensor from padded lists: a tensor per row cost a few small operators a row.
    rows = [row_values[1:] + [0.0] * (seq_len - len(row_values) + 1) for row_values in values]
    return batches.rows_tensor(rows, seq_len, torch.float32)


def input_aligned_routes(routes: list[torch.Tensor], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's rollout routes ([ids, layers, top-k]) laid out like `batches.collate`'s input tokens (every id
    but the last): [rows, seq, layers, top-k], and [rows, seq] True where a route was recorded (not on pads)."""
    layers, topk = routes[0].shape[1:]
    out = torch.zeros(len(routes), seq_len, layers, topk, dtype=routes[0].dtype)
    routed = torch.zeros(len(routes), seq_len, dtype=torch.bool)
    for row, taken in enumerate(routes):
        out[row, : len(taken) - 1] = taken[:-1]
        routed[row, : len(taken) - 1] = True
    return out, routed
