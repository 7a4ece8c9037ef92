"""The output layer applied only at the positions a loss reads (TRL's `logits_to_keep`, for every position rather than a
suffix).

A GRPO micro-batch reads a log-prob, an entropy and a gap only at its trained tokens, and SFT's loss only at the
response's: the prompts' positions, the tool messages' and the padding's are masked out of every term, yet projecting
them onto the vocabulary (151,936 ids for Qwen2.5) is most of a small model's forward. megatron-core 0.19's `GPTModel.forward(..., output_processor=...)` hands
the decoder's hidden states [sequence, batch, hidden] to a hook instead of its output layer; `project_positions` is
the hook: `project_positions` (GRPO's log-probs) and `loss_at_positions` (SFT's loss) pick the read positions' hidden
states and apply the model's own output layer (its weight, tied or
not, vocab-parallel under tensor parallelism) to them alone. Under sequence parallelism the hidden states are first
gathered along the sequence, and the layer runs as without sequence parallelism (its backward all-reduces the input's
gradient over the tensor-parallel ranks; the gather's backward then takes this rank's part of the sequence).

`ReadPositions` names the positions of a [batch, sequence] micro-batch: the logits come back as [1, positions, vocab
shard], and `scatter` lays per-position values back out as [batch, sequence] (zero elsewhere), so every term of the
loss reads as before. When the model's input is laid out otherwise than the loss (GRPO's groups with their prompt once,
`data.batches.collate_shared`), each position also names where its hidden state is in the input: several positions
may read one hidden state (a prompt's last, for each completion's first token), and their gradients add up there.
"""

import dataclasses

import torch


@dataclasses.dataclass
class ReadPositions:
    """The (row, column) positions of a [batch, sequence] micro-batch whose log-probs are read, in row-major order."""

    rows: torch.Tensor  # [positions]
    columns: torch.Tensor  # [positions]
    shape: tuple[int, int]  # [batch, sequence]
    hidden_rows: torch.Tensor  # [positions]: each position's row in the model's input
    hidden_columns: torch.Tensor  # [positions]: and its column there

    @classmethod
    def where(cls, mask: torch.Tensor, hidden_index: torch.Tensor | None = None, width: int = 0) -> "ReadPositions":
        """The positions where `mask` ([batch, sequence]) is non-zero; at least one (a micro-batch with nothing to train
        still runs the layer, so every rank's backward reaches the same parameters). Their hidden states are at the
        same places of the input, or at `hidden_index` [batch, sequence] of the input flattened, rows of `width`."""
        rows, columns = mask.nonzero(as_tuple=True)
        if rows.numel() == 0:
            rows, columns = torch.zeros(1, dtype=torch.long, device=mask.device), torch.zeros(1, dtype=torch.long, device=mask.device)
        if hidden_index is None:
            return cls(rows, columns, tuple(mask.shape), rows, columns)
        flat = hidden_index[rows, columns]
        return cls(rows, columns, tuple(mask.shape), flat // width, flat % width)

    def pick(self, values: torch.Tensor) -> torch.Tensor:
        """[batch, sequence, ...] values at the positions: [1, positions, ...]."""
        return values[self.rows, self.columns].unsqueeze(0)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[1, positions] values laid out as [batch, sequence], zero at every other position (differentiable)."""
        full = torch.zeros(self.shape, dtype=values.dtype, device=values.device)
        return full.index_put((self.rows, self.columns), values.reshape(-1))


def project_positions(*, hidden_states, output_layer, output_weight, runtime_gather_output, scale_logits, context,
                      **_) -> torch.Tensor:
    """megatron-core's `output_processor`: the logits [1, positions, vocab shard] at `context`'s `ReadPositions`."""
    logits = _logits_at(context, hidden_states, output_layer, output_weight, runtime_gather_output, scale_logits)
    return logits.transpose(0, 1).contiguous()  # [1, positions, vocab shard]


def loss_at_positions(*, hidden_states, output_layer, output_weight, runtime_gather_output, scale_logits, labels,
                      compute_language_model_loss, context, **_) -> torch.Tensor:
    """megatron-core's `output_processor` for a loss on the labels: the model's own per-token loss (its cross entropy,
    fused where configured) at `context`'s `ReadPositions`, laid out as [batch, sequence] (zero elsewhere)."""
    logits = _logits_at(context, hidden_states, output_layer, output_weight, runtime_gather_output, scale_logits)
    return context.scatter(compute_language_model_loss(context.pick(labels), logits))  # [batch, sequence]


def _logits_at(read: ReadPositions, hidden_states, output_layer, output_weight, runtime_gather_output,
               scale_logits) -> torch.Tensor:
    """The output layer at the read positions: logits [positions, 1, vocab shard] (megatron's [sequence, batch] order)."""
    from megatron.core import parallel_state, tensor_parallel

    # hidden_states: [sequence (/ tp under sequence parallelism), batch, hidden]
    sequence_parallel = output_layer.sequence_parallel
    if sequence_parallel:
        # Its backward only splits: the layer below, run without sequence parallelism, all-reduces the input's gradient
        # over the tensor-parallel ranks itself (a reduce-scatter here as well would count it tp times).
        hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=False,
            group=parallel_state.get_tensor_model_parallel_group())  # [sequence, batch, hidden]
    picked = hidden_states[read.hidden_columns, read.hidden_rows].unsqueeze(1)  # [positions, 1, hidden]
    output_layer.sequence_parallel = False  # the positions are whole on every rank now
    try:
        logits, _ = output_layer(picked, weight=output_weight, runtime_gather_output=runtime_gather_output)
    finally:
        output_layer.sequence_parallel = sequence_parallel
    return scale_logits(logits)  # [positions, 1, vocab shard]
