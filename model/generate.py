"""Batched generation by the megatron-core policy itself, with megatron-core's KV cache (StaticInferenceContext).

Prompts of different lengths are left-padded, as `transformers` does: one prefill covers every prompt, then
each step decodes one token per row. The pads are hidden from attention by a boolean `attention_mask`
(prefill: causal and not a pad key; decode: not a pad key); rotary embeddings depend only on the distance
between query and key, so a row's shift by its pads leaves its attention unchanged. Batches whose prompts
all have one length need no mask at all.

What a rollout does not pay for:
- a prompt's prefill more than once: with `samples=N` each distinct prompt is prefilled once and its cached
  keys/values are copied to its N rows, which then sample independently (GRPO's groups);
- finished rows: once an eighth of the live rows have ended at EOS, the batch and its cache are compacted
  to the live rows;
- rotating cached keys again: without Transformer Engine the layers cache keys after the rotary embedding
  (`model.attention.RotateOnceSelfAttention`).

Transformer Engine's attention is told `no_mask` by megatron-core while decoding and would ignore the mask,
so with that layer spec prompts are not padded: the common prefix is prefilled, and rows with longer
prompts advance through the rest one token per step (megatron-core's own static batching).

Sequence parallelism is off while generating, as megatron-core's own static-batching generation turns it off
(`set_model_to_sequence_parallel`, for all but MoE layers): a decode step's one token cannot be split over the tensor-parallel ranks, and
the output layer's last-position slice assumes the whole sequence. Weights and results are the same either way.
"""

import contextlib
from pathlib import Path

import torch

from config.hf import read_hf_config, turn_end
from model import collectives, pipeline
from model.parallel import unwrap
from model.sampling import Sampling, sample_next, sampling_generator
from model.wrapping import parameters_gathered_once


def masks_pads(model) -> bool:
    """Whether every layer's core attention applies `attention_mask` while decoding.

    SDPA does (sliding windows included). megatron's local attention does only through its PyTorch softmax
    without a sliding window: its windowed path builds its own mask and drops ours, and the fused upper-triangular
    kernel ignores it, so there the prompts are not padded (as with Transformer Engine).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from model.attention import SDPACoreAttention

    def applies_mask(attention) -> bool:
        if isinstance(attention, SDPACoreAttention):
            return True
        softmax = getattr(attention, "scale_mask_softmax", None)
        return (isinstance(attention, DotProductAttention) and softmax is not None and softmax.window_size is None
                and not softmax.scaled_masked_softmax_fusion)

    return all(applies_mask(layer.self_attention.core_attention) for layer in unwrap(model).decoder.layers)


def _keep_cache_rows(context, rows: torch.Tensor) -> None:
    """Reorder (copy, drop) the batch rows of every layer's cached keys and values: row i becomes old row rows[i].

    The copies keep batch-major memory (see `RotateOnceSelfAttention`) under megatron's shape. `index_select` copies
    whole rows where indexing (`[rows]`) gathers element by element (the same values, in less time)."""
    for layer, cache in context.key_value_memory_dict.items():  # each [max_seq, max_batch, groups, head dim]
        context.key_value_memory_dict[layer] = tuple(tensor.transpose(0, 1).index_select(0, rows).transpose(0, 1)
                                                     for tensor in cache)
    context.max_batch_size = len(rows)


# The module attributes megatron-core's `set_model_to_sequence_parallel` switches (megatron/core/transformer/utils.py).
SEQUENCE_PARALLEL_ATTRIBUTES = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")
# Megatron-Bridge's LoRA adapters gather and scatter the sequence themselves unless this is True.
LORA_SEQUENCE_PARALLEL_OFF = "disable_sequence_parallel_comm"


@contextlib.contextmanager
def sequence_parallel_off(model):
    """Run the model without sequence parallelism inside the block, and exactly as it was after (training keeps it).

    The same switch as megatron-core's `set_model_to_sequence_parallel`, without its cache of modules keyed by
    `id(model)`, which a later model (GRPO after its default SFT, in one process) could inherit.
    """
    bare = unwrap(model)
    if not bare.config.sequence_parallel:
        yield
        return
    saved = [(module, name, getattr(module, name)) for module in bare.modules()
             for name in (*SEQUENCE_PARALLEL_ATTRIBUTES, LORA_SEQUENCE_PARALLEL_OFF) if hasattr(module, name)]
    bare.config.sequence_parallel = False  # the config object every chunk (and the KL reference) shares
    for module, name, _ in saved:
        setattr(module, name, name == LORA_SEQUENCE_PARALLEL_OFF)
    try:
        yield
    finally:
        bare.config.sequence_parallel = True
        for module, name, value in saved:
            setattr(module, name, value)


def end_token_ids(model_path, tokenizer) -> tuple[int, ...]:
    """Every id that ends a completion: the tokenizer's EOS, each `eos_token_id` of the checkpoint's
    `generation_config.json` (an int or a list; Qwen2.5-Instruct lists two), or of its config.json where it has no
    generation_config.json (as transformers' `generate` reads them), and the token that closes an assistant turn in its
    chat template (`config.hf.turn_end`: a base model's ChatML <|im_end|>, whose EOS is <|endoftext|>)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    # Without generation_config.json transformers generates with config.json's end ids (Llama 3.1's lists three,
    # <|end_of_text|> and <|eom_id|> beside the tokenizer's <|eot_id|>): ours did not stop at those two.
    has_generation_config = (Path(model_path) / "generation_config.json").is_file()
    declared = read_hf_config(model_path, "model.path", "generation_config.json" if has_generation_config
                              else "config.json").get("eos_token_id")
    ids += declared if isinstance(declared, list) else [] if declared is None else [declared]
    if (end := turn_end(tokenizer)) is not None:
        ids.append(tokenizer.convert_tokens_to_ids(end))
    return tuple(dict.fromkeys(int(token) for token in ids))


class Completions(list):
    """Completions' token ids (a list, one per completion), with what the sampler knew of each:
    - `logprobs`: per completion, each id's log-prob under the distribution that sampled it (`sample_next`), 0.0 for
      ids given by `continue_rows` (and for every id when `Sampling.logprobs` is off);
    - `routes` (Mixture-of-Experts, when asked): per completion, [prompt + completion ids, layers, top-k] experts each
      id was routed to when it went through the model (the completion's last id never does: its row means nothing)."""

    logprobs: list[list[float]]
    routes: list[torch.Tensor] | None = None


class Engine:
    """Generation by the policy, built once: its model chunk, end ids, vocabulary and data-parallel group inside.

    Collective over the data-parallel group: every rank must call `generate` the same number of times (with its
    own prompts). Each call then runs the same number of forwards on every rank, which sharding that gathers
    parameters in every forward (Megatron-FSDP) needs: the ranks stop together (and agree on the prompt width
    where prompts are not padded).

    Multi-turn generation (`continue_rows`) agrees over the data-parallel group under any sharding: the columns a
    rank was given (tool messages) go into one forward only as far as every rank was given columns, so a run's
    windows, and with them the float rounding of every forward and the tokens sampled, are the same under DDP and
    Megatron-FSDP.
    """

    def __init__(self, chunks: list, vocab_size: int, end_ids: tuple[int, ...], group=None, data_parallel_group=None,
                 routes=None):
        self.chunks, self.vocab_size, self.end_ids, self.group = chunks, vocab_size, tuple(end_ids), group
        self.data_parallel_group = data_parallel_group
        self.routes = routes  # model.routing.Routes of a Mixture-of-Experts policy (None: dense, or not recorded)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, samples: int = 1,
                 sampling: Sampling = Sampling(), continue_rows=None, record_routes: bool = False) -> Completions:
        """Completions (token ids, up to and including the end id that ends each): `samples` per prompt, a prompt's
        consecutively; `continue_rows` (see `generate`) lets a row go on after an end id with tokens of its caller's;
        `record_routes` keeps a Mixture-of-Experts policy's routes (`Completions.routes`). Under Megatron-FSDP the
        parameters are gathered once for the call, not once a token (`wrapping.parameters_gathered_once`)."""
        with parameters_gathered_once(self.chunks):
            return generate(self.chunks, prompts, max_new_tokens=max_new_tokens, end_ids=self.end_ids,
                            vocab_size=self.vocab_size, samples=samples, temperature=sampling.temperature,
                            top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                            with_logprobs=sampling.logprobs,
                            group=self.group if continue_rows is None else self.data_parallel_group,
                            continue_rows=continue_rows, routes=self.routes if record_routes and self.routes else None)

    def truncated(self, completion: list[int], max_new_tokens: int) -> bool:
        """Whether a completion was cut at `max_new_tokens` rather than ended by an end id."""
        return len(completion) >= max_new_tokens and (not completion or completion[-1] not in self.end_ids)


def _agree(value: int, group, op) -> int:
    """`value` reduced over `group` (MAX or MIN); the value itself without a group."""
    return value if group is None else collectives.all_reduce_int(value, op, group)


@torch.no_grad()
def generate(chunks: list, prompts: list[list[int]], *, max_new_tokens: int, end_ids, vocab_size: int,
             samples: int = 1, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int = 0, group=None, continue_rows=None, routes=None, with_logprobs: bool = True) -> Completions:
    """Completions (token ids, up to and including the first of `end_ids`): `samples` per prompt, a prompt's
    consecutively, with each sampled id's log-prob (0.0 without `with_logprobs`); with `routes` (a `model.routing.Routes`),
    every id's experts.

    `continue_rows` makes completions multi-turn without knowing why: when rows sample an end id, it is called with
    `[(row, completion so far, columns left)]` (row: the completion's index in the result) and returns for each
    either None (the row ends there) or token ids to append (fewer than the columns left; none: the row samples on). Appended tokens are
    fed like a prompt's rest, one column per step beside the other rows' sampling, into the same KV cache: the
    history is never prefilled again, and every row's positions stay contiguous, so a continued completion is
    the sequence a single forward over it would see. All of a completion's tokens count in `max_new_tokens`.

    Where the layers mask pads (`masks_pads`), columns that every live row was given are fed in one forward.

    One model chunk per rank (no virtual pipeline stages); TP- and PP-aware. Every tensor- and pipeline-parallel rank
    of a model replica must call it with the same prompts and seed (tensor-parallel ranks sample identically; the last
    pipeline stage samples and sends each step's ids to the other stages), so they finish and compact identically.
    With `group` (the data-parallel group) the ranks of the group agree on when every row has ended (and, unpadded, on the widths), so each runs the same
    number of forwards whatever its own prompts (a rank whose rows have all ended keeps one row going). Padding
    stays per rank where it can, so a rank's completions do not depend on the other ranks' prompts.
    """
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.utils import InferenceMode

    if len(chunks) != 1:
        raise ValueError("generation runs on a single model chunk per rank (no virtual pipeline stages)")
    end_ids = torch.tensor([end_ids] if isinstance(end_ids, int) else list(end_ids), dtype=torch.long)  # [ends]
    filler = int(end_ids[0]) if len(end_ids) else 0  # written after a row has ended
    model = chunks[0]
    stages = pipeline.PipelineStages.of_this_rank()
    device = next(unwrap(model).parameters()).device
    end_ids = end_ids.to(device)
    lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)  # [prompts]
    padded = masks_pads(model)
    # Padded, every row's prompt ends at `width`: one prefill, then `max_new_tokens` decode steps on every rank
    # whatever its width. Unpadded, shorter rows go through the rest of their prompt one token per step, so the
    # number of forwards depends on the widths: the data-parallel ranks agree on them.
    width = int(lengths.max()) if padded else _agree(int(lengths.max()), group, torch.distributed.ReduceOp.MAX)
    # Row r's prompt occupies columns [pads[r], ends[r]); left of it are pads (zero of them without masks).
    pads = width - lengths if padded else torch.zeros_like(lengths)  # [prompts]
    ends = pads + lengths  # [rows]: one per prompt until the prefill is copied to the samples
    forced_end = ends.clone()  # [rows]: columns before it hold given tokens (the prompt, then continuations)
    first_position = int(ends.min()) if padded else _agree(int(ends.min()), group, torch.distributed.ReduceOp.MIN)
    total = width + max_new_tokens
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)  # [rows, total]
    for row, prompt in enumerate(prompts):
        tokens[row, int(pads[row]) : int(ends[row])] = torch.tensor(prompt, device=device)
    columns = torch.arange(total, device=device)  # [total]
    is_pad = columns[None, :] < pads[:, None]  # [rows, total]
    any_pads = bool(is_pad.any())
    # A decode step's mask, for every key column: its one query is past the prompts, so it sees every key but the pads.
    pad_keys = is_pad[:, None, None, :]  # [rows, 1, 1, total]
    generator = sampling_generator(seed, device)
    context = StaticInferenceContext(len(prompts), total)
    # The output: finished rows are moved here when the batch is compacted, the rest at the end.
    output = torch.zeros(len(prompts) * samples, total, dtype=torch.long, device=device)  # [prompts * samples, total]
    output_rows = torch.arange(len(prompts) * samples, device=device)  # [rows]: each live row's output row
    stop = torch.full((len(prompts),), total - 1, dtype=torch.long, device=device)  # [rows]: the column a row ended at
    output_stop = torch.zeros(len(prompts) * samples, dtype=torch.long, device=device)  # [prompts * samples]
    # The sampler's log-prob of each sampled id ([rows, total]) and, recording, each fed id's experts.
    logprobs = torch.zeros(len(prompts), total, dtype=torch.float32, device=device)
    output_logprobs = torch.zeros(len(prompts) * samples, total, dtype=torch.float32, device=device)
    route_shape = (routes.layers, routes.topk) if routes else (0, 0)
    taken = torch.zeros(len(prompts), total, *route_shape, dtype=torch.int16, device=device)  # [rows, total, layers, k]
    output_taken = torch.zeros(len(prompts) * samples, total, *route_shape, dtype=torch.int16, device=device)
    done = torch.zeros(len(prompts) * samples, dtype=torch.bool, device=device)  # [rows]
    # What the host knows without reading the device: how many rows have ended (read once a step), and the column up
    # to which some row is given tokens. Past it, with no row ended, each step just writes the sampled ids.
    finished, forced_until = 0, width
    previous, last_position = 0, total - 1
    was_training = model.training
    model.eval()
    # megatron-core's inference mode: the output layer sees only each row's last position (in the prefill too),
    # and gathers the tensor-parallel vocab shards itself.
    with InferenceMode.active(), sequence_parallel_off(model), routes.recording() if routes else contextlib.nullcontext():
        position = first_position
        while position < total:
            window = tokens[:, previous:position]  # [rows, new tokens]
            positions = columns[previous:position].expand(tokens.size(0), -1)  # [rows, new tokens]
            mask = None  # megatron's convention: True = may not attend
            if any_pads and previous > 0 and window.size(1) == 1:
                mask = pad_keys[..., :position]  # [rows, 1, 1, keys]
            elif any_pads or (previous > 0 and window.size(1) > 1):  # a multi-token window past the prefill: causal
                queries, keys = columns[previous:position], columns[:position]
                future = keys[None, :] > queries[:, None]  # [new tokens, keys]
                # A real query sees no pad key; a pad query sees the pads up to itself (never an empty row).
                mask = future[None, None] | (is_pad[:, None, None, :position] & ~is_pad[:, None, previous:position, None])
            if previous > 0:
                context.enable_decode_mode()
            logits = _stage_forward(model, stages, window, position_ids=positions, attention_mask=mask,
                                    inference_context=context)  # [rows, 1, padded vocab]; None before the last stage
            context.sequence_len_offset += window.size(1)
            if routes:
                taken[:, previous:position] = routes.recorded(*window.shape).to(taken.dtype)
            if previous == 0 and samples > 1:  # after the prefill: every prompt's row becomes its `samples` rows
                copies = torch.arange(len(prompts), device=device).repeat_interleave(samples)  # [prompts * samples]
                tokens, is_pad, ends = tokens[copies], is_pad[copies], ends[copies]
                pad_keys = is_pad[:, None, None, :]
                logits = None if logits is None else logits[copies]
                logprobs, taken = logprobs[copies], taken[copies]
                forced_end, stop = forced_end[copies], stop[copies]
                _keep_cache_rows(context, copies)
            previous = position
            next_tokens, next_logprobs = _sample(logits, stages, tokens.size(0), device, vocab_size, temperature,
                                                 top_p, top_k, generator, with_logprobs)
            if finished or position < forced_until:  # rows given a token here keep it; ended rows take the filler
                forced = position < forced_end  # [rows]
                tokens[:, position] = torch.where(forced, tokens[:, position], torch.where(done, filler, next_tokens))
                logprobs[:, position] = torch.where(forced | done, 0.0, next_logprobs)
                ended = ~forced & ~done & torch.isin(tokens[:, position], end_ids)  # [rows]
            else:  # every row takes its sampled id (the same values as above, in fewer operators)
                tokens[:, position], logprobs[:, position] = next_tokens, next_logprobs
                ended = torch.isin(next_tokens, end_ids)  # [rows]
            if continue_rows is not None and bool(ended.any()):
                ended = _continue(continue_rows, ended, tokens, ends, forced_end, output_rows, position, max_new_tokens)
                forced_until = int(forced_end.max())
            done |= ended
            # The step's one read of the device (besides multi-turn's): rows that ended may be compacted away.
            ended_before, finished = finished, int(done.sum())
            if finished > ended_before:  # `ended` rows are not done before, so some ended here
                stop.masked_fill_(ended, position)
            if _agree(int(finished == len(done)), group, torch.distributed.ReduceOp.MIN):  # every row of every rank
                last_position = position
                break
            if finished > 0 and len(done) > 1 and position + 1 < total and 8 * finished >= len(done):  # compact to the live rows
                output[output_rows[done]] = tokens[done]
                output_stop[output_rows[done]] = stop[done]
                output_logprobs[output_rows[done]], output_taken[output_rows[done]] = logprobs[done], taken[done]
                live = (~done).nonzero().squeeze(1)  # [live rows]
                finished = 0 if len(live) else 1
                if len(live) == 0:  # other ranks still generate: keep one ended row going, its output already kept
                    live = torch.zeros(1, dtype=torch.long, device=device)
                tokens, is_pad, ends, done, output_rows = tokens[live], is_pad[live], ends[live], done[live], output_rows[live]
                pad_keys = is_pad[:, None, None, :]
                forced_end, stop, logprobs, taken = forced_end[live], stop[live], logprobs[live], taken[live]
                _keep_cache_rows(context, live)
            position += 1
            if padded and continue_rows is not None and position < total:
                # Columns every live row has been given (tool messages appended at once) go into the next forward
                # together, like a prefill; the data-parallel ranks agree on the jump, so their forwards stay equal.
                given = int((forced_end - position).clamp(min=0).masked_fill(done, total).min())
                position += _agree(min(given, total - 1 - position), group, torch.distributed.ReduceOp.MIN)
    model.train(was_training)
    if stages is not None and not stages.first:
        unwrap(model).set_input_tensor(None)
    output[output_rows] = tokens
    output_stop[output_rows] = stop
    output_logprobs[output_rows], output_taken[output_rows] = logprobs, taken
    prompt_starts = pads.repeat_interleave(samples).tolist()
    prompt_ends = (pads + lengths).repeat_interleave(samples).tolist()
    # Each completion runs to the column it ended at (its end id included), or to the last one generated.
    spans = [(start, end, min(last_position, ended, end + max_new_tokens - 1) + 1)
             for start, end, ended in zip(prompt_starts, prompt_ends, output_stop.tolist())]
    completions = Completions(output[row, end:stop].tolist() for row, (_, end, stop) in enumerate(spans))
    completions.logprobs = [output_logprobs[row, end:stop].tolist() for row, (_, end, stop) in enumerate(spans)]
    if routes:
        completions.routes = [output_taken[row, start:stop].cpu() for row, (start, _, stop) in enumerate(spans)]
    return completions


def _stage_forward(model, stages, window: torch.Tensor, **inputs):
    """The policy's forward of `window` ([rows, new tokens]): its logits [rows, 1, padded vocab] (megatron-core's
    inference mode keeps only the last position). With pipeline stages, the previous stage's hidden states
    [new tokens, rows, hidden] come in and this stage's go out to the next: the logits on the last stage only (None on
    the others). Each stage's KV cache holds its own layers."""
    if stages is None:
        return model(input_ids=window, runtime_gather_output=True, **inputs)
    config = unwrap(model).config
    dtype = config.pipeline_dtype or config.params_dtype  # what megatron-core's schedule exchanges between stages
    if not stages.first:
        hidden = stages.receive((window.size(1), window.size(0), config.hidden_size), dtype, window.device)
        unwrap(model).set_input_tensor(hidden)
    output = model(input_ids=window, runtime_gather_output=True, **inputs)
    if stages.last:
        return output
    stages.send(output.to(dtype))
    return None


def _sample(logits, stages, rows: int, device, vocab_size: int, temperature: float, top_p: float, top_k: int,
            generator, with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's next id and the sampler's log-prob of it ([rows] each): sampled where the logits are (the last
    pipeline stage) and sent from there to the other stages, exactly (ids and fp32 log-probs travel as fp64)."""
    if logits is not None:
        last = logits[:, -1, :vocab_size]  # [rows, vocab]
        ids, sampled_logprobs = sample_next(last, temperature, top_p, top_k, generator, with_logprobs)
        if stages is None:
            return ids, sampled_logprobs
        both = torch.stack([ids.double(), sampled_logprobs.double()])  # [2, rows]
    else:
        both = torch.empty(2, rows, dtype=torch.float64, device=device)
    both = stages.from_last(both)
    return both[0].long(), both[1].float()


def _continue(continue_rows, ended: torch.Tensor, tokens: torch.Tensor, ends: torch.Tensor, forced_end: torch.Tensor,
              output_rows: torch.Tensor, position: int, max_new_tokens: int) -> torch.Tensor:
    """Ask `continue_rows` about the rows that just sampled an end id; write the tokens it gives after the end id
    (into `tokens` and `forced_end`, in place) and return the rows that end for good."""
    # Columns left of each row's budget (rows whose prompts are shorter than the batch's, unpadded, start earlier and
    # run past it: those have ended).
    rows = [row for row in ended.nonzero().squeeze(1).tolist() if int(ends[row]) + max_new_tokens - position - 1 > 0]
    lefts = [int(ends[row]) + max_new_tokens - position - 1 for row in rows]
    requests = [(int(output_rows[row]), tokens[row, int(ends[row]) : position + 1].tolist(), left)
                for row, left in zip(rows, lefts)]
    for row, left, appended in zip(rows, lefts, continue_rows(requests)):
        if appended is None:
            continue
        ended[row] = False
        if not appended:
            continue
        if not len(appended) < left:
            raise ValueError(f"continue_rows gave {len(appended)} tokens for a row with {left} columns left")
        tokens[row, position + 1 : position + 1 + len(appended)] = torch.tensor(appended, device=tokens.device)
        forced_end[row] = position + 1 + len(appended)
    return ended
