"""Supervised fine-tuning: `torchrun --nproc-per-node N -m trainer.sft [--config FILE] [--key=value ...]`.

parse -> validate -> build -> resume -> loop -> save. The loss is the mean over the response tokens of the
whole global batch (summed per microbatch, divided once by the global token count in megatron-core's
`finalize_model_grads`), so data parallelism and gradient accumulation leave it unchanged.
"""

import contextlib
import dataclasses
import functools
import os

import torch

from ckpt import checkpoint
from config import cli, console, process
from config.loops import SFTConfig
from config.sections import DEFAULT_REWARD
from data import batches, conversations as conversation_data, prompts as prompt_data, rewards, sft as sft_data
from model import build, collectives, moe, output, parallel
from trainer import evaluation, metrics
from trainer.metrics import log


# ---------------------------------------------------------------- data


@dataclasses.dataclass
class SFTData:
    """Tokenized training and held-out examples, and the held-out prompts whose greedy answers are graded."""

    train: list[batches.Example]
    eval: list[batches.Example]
    eval_prompts: prompt_data.PromptSet | list


def load_data(config, tokenizer, data_parallel_size: int) -> SFTData:
    """Every user error in the data is raised here, before a model is built."""
    data = config.data

    def examples(path: str, split: str, training: bool = False):
        rows = conversation_data.load_split(data, path, split, sft_targets=True)
        conversations, report = conversation_data.to_conversations(
            rows, prompt_field=data.prompt_field, response_field=data.response_field, messages_field=data.messages_field or None,
        source=f"`{path}` ({split})")
        rows = list(report.kept_rows)  # each conversation's row
        built = sft_data.cached_examples(conversations, tokenizer, data.max_seq_len, report,
                                         process.cache_dir() if data.cache else None)
        left_out = sft_data.rows_left_out_note(len(built), config.train.global_batch_size) if training else ""
        log.info("data %s (%s): %d samples used; %s%s", path, split, len(built), report.summary(), left_out)
        kept = set(report.kept_rows)  # the held-out accuracy reads the rows the held-out loss does, and no other
        return built, [conversation for conversation, row in zip(conversations, rows) if row in kept]

    train, _ = examples(data.path, data.train_split, training=True)
    held_out = prompt_data.held_out_split(data, examples) or ([], [])
    eval_examples = prompt_data.trim_for_data_parallel(held_out[0], config.train.eval_samples, data_parallel_size,
                                                       prompt_data.held_out_source(data))
    eval_conversations = prompt_data.trim_for_data_parallel(held_out[1], config.train.eval_samples, data_parallel_size)
    eval_prompts = prompt_data.prompts_from_conversations(eval_conversations, tokenizer)
    # The default reward grades GSM8K-style `#### N` answers; references without one leave nothing to grade.
    ungraded = sum(not rewards.has_answer_format(prompt.reference) for prompt in eval_prompts)
    if ungraded:
        log.info("no held-out accuracy: %d of the %d held-out answers of %s have no GSM8K `#### N` line, which the "
                 "accuracy grades (the held-out loss is computed)", ungraded, len(eval_prompts),
                 prompt_data.held_out_source(data))
        eval_prompts = []
    if offering := (eval_prompts.offering_tools() if eval_prompts else 0):
        # A completion that calls a tool is no answer to grade: eval_accuracy is the share answered without a call.
        log.warning("held-out accuracy: %d of the %d held-out prompts of %s offer tools (the rows' `tools`), which SFT's "
                    "evaluation does not run: a completion that calls one is scored as its answer, wrong, so "
                    "eval_accuracy counts only answers given without a call. GRPO with `--grpo.tools` evaluates with "
                    "the tools run (`eval_tool_call_rate` beside it)", offering, len(eval_prompts),
                    prompt_data.held_out_source(data))
    return SFTData(train, eval_examples, eval_prompts)


def token_budget_indices(examples, microbatch_indices: list[list[int]], config) -> list[list[int]]:
    """A step's micro-batches regrouped by length under `train.micro_batch_tokens` (as they are without it)."""
    if not config.train.micro_batch_tokens:
        return microbatch_indices
    rows = [index for indices in microbatch_indices for index in indices]
    lengths = {index: len(examples[index].input_ids) - 1 for index in rows}  # input positions
    return batches.token_budget_microbatches(lengths, [rows], config.train.micro_batch_tokens,
                                             batches.padded_size_for(config), collectives.world_max)


def collate_microbatches(examples, microbatch_indices, config, pad_id, device) -> tuple[list[dict], int]:
    """Collated microbatches for one step (each padded to its own longest row; with pipeline stages, which exchange
    fixed shapes, all to the step's), and the step's padded length."""
    groups = [[examples[index] for index in indices] for indices in microbatch_indices]
    if config.data.pack:
        # A microbatch's samples share as few rows as fit, padded to its own longest row; the row count varies, which
        # only the non-pipelined schedule allows (validated at start-up).
        rows = [batches.pack(group, config.data.max_seq_len) for group in groups]
        lengths = [batches.padded_size_for(config)(max(sum(len(example.input_ids) - 1 for example in row) for row in packed))
                   for packed in rows]
        collated = [batches.collate_packed(packed, length, pad_id) for packed, length in zip(rows, lengths)]
        seq_len = max(lengths)
    else:
        pad = batches.padded_length_for(config)
        seq_len = pad([example for group in groups for example in group])
        # Each microbatch padded to its own longest row; pipeline stages exchange one shape, so there the step's.
        collated = [batches.collate(group, seq_len if parallel.fixed_microbatch_shape() else pad(group), pad_id)
                    for group in groups]
    collated = [batches.to_device(batch, device) for batch in collated]
    for batch in collated:  # the only positions projected onto the vocabulary: those the loss reads (`model.output`)
        batch["read"] = output.ReadPositions.where(batch["loss_mask"])
    return collated, seq_len


# ---------------------------------------------------------------- loss


def masked_token_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """(loss sum, token count, report) over response tokens; megatron-core divides by the global count."""
    # per_token_loss, loss_mask: [batch, seq]
    loss_sum = (per_token_loss.float() * loss_mask).sum()
    tokens = loss_mask.sum().to(torch.int)
    return loss_sum, tokens, {"loss": torch.stack([loss_sum.detach(), tokens.detach().float()])}


def forward_step(data_iterator, model):
    """One microbatch through the model: the per-token loss [batch, seq] of its response tokens, the output layer
    applied at those positions only (`model.output`)."""
    batch = next(data_iterator)
    per_token_loss = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                           attention_mask=batch["attention_mask"], labels=batch["labels"],
                           padding_mask=moe.routing_padding_mask(batch, model),
                           output_processor=output.loss_at_positions, output_processor_context=batch["read"])
    return per_token_loss, functools.partial(masked_token_loss, batch["loss_mask"])


def run_microbatches(chunks, microbatches: list[dict], seq_len: int, forward_only: bool) -> tuple[float, float]:
    """Forward (and backward) a step's microbatches through megatron-core's pipeline schedule; returns (loss sum, tokens)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # One iterator per model chunk: with virtual pipeline stages each chunk reads the same microbatches.
    iterators = [iter(microbatches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=seq_len,
        micro_batch_size=microbatches[0]["tokens"].size(0),
        forward_only=forward_only,
    )
    return collectives.reduce_loss_over_data_parallel(losses)


def train_step(policy, microbatches: list[dict], seq_len: int, timer) -> tuple[float, float, float | None, float]:
    """One optimizer step over a global batch's microbatches, timed as the step's `forward_backward` and `optimizer`
    phases (`timer`, a `trainer.metrics.StepTimer`); returns (loss sum, response tokens, grad norm (None: the update
    was skipped), the rate used)."""
    with timer.phase("forward_backward"):
        for chunk in policy.chunks:
            chunk.zero_grad_buffer()
        policy.optimizer.zero_grad()
        policy.routing_figures.start_step()
        moe.weigh_router_losses(policy.chunks, microbatches, lambda batch: batch["loss_mask"].sum())
        loss_sum, tokens = run_microbatches(policy.chunks, microbatches, seq_len, forward_only=False)
    with timer.phase("optimizer"):
        grad_norm = policy.optimizer_step()  # None: skipped (fp16 overflow), and the LR schedule stays
        lr = policy.next_lr(applied=grad_norm is not None)
    return loss_sum, tokens, grad_norm, lr


# ---------------------------------------------------------------- evaluation


def evaluate(policy, data: SFTData, config, runtime) -> dict:
    """Held-out loss, and the held-out accuracy both loops report (the default reward's full marks for greedy answers)."""
    if not data.eval:
        return {}
    # Every data-parallel rank scores an equal share (load_data trimmed the set to a multiple of the DP size),
    # so all ranks run the same number of batches and the DP sums stay collective.
    interleaved = config.parallel.pp if len(policy.chunks) > 1 else 0
    share = interleaved_share(data.eval[runtime.dp_rank :: runtime.dp_size], interleaved)
    calls = held_out_calls(share, config, interleaved)
    loss_sum, tokens = 0.0, 0.0
    with contextlib.ExitStack() as modes:
        for chunk in policy.chunks:  # dropout off (LoRA's `peft.dropout`): the held-out loss of the model, not of a draw
            modes.enter_context(build.eval_mode(chunk))
        for call in calls:
            microbatches, seq_len = collate_microbatches(share, call, config, policy.tokenizer.pad_token_id, runtime.device)
            batch_loss, batch_tokens = run_microbatches(policy.chunks, microbatches, seq_len, forward_only=True)
            loss_sum, tokens = loss_sum + batch_loss, tokens + batch_tokens
    accuracy = evaluation.held_out_metrics(policy, data.eval_prompts, rewards.get_reward(DEFAULT_REWARD), runtime, config,
                                           max_new_tokens=config.data.max_seq_len // 2)
    return {**({"eval_loss": loss_sum / max(tokens, 1)} if calls else {}), **accuracy}


def interleaved_share(share: list, interleaved: int) -> list:
    """This rank's held-out rows, under the interleaved schedule (`interleaved` = parallel.pp) filled up to a multiple
    of PP rows with copies of the last one that the loss does not read (loss mask 0): its calls take a multiple of PP
    one-row micro-batches, and the held-out loss (a sum over the response tokens) is unchanged."""
    if not interleaved or len(share) % interleaved == 0:
        return share
    filler = batches.Example(share[-1].input_ids, [0] * len(share[-1].loss_mask))
    return share + [filler] * (-len(share) % interleaved)


def held_out_calls(share, config, interleaved: int) -> list[list[list[int]]]:
    """This rank's held-out rows (`share`) as the forward-only calls `evaluate` makes, each a list of micro-batches (row
    indices into `share`). Under `train.micro_batch_tokens`, one call of micro-batches within the training's token
    budget (collective: the count is agreed over the ranks), where `train.micro_batch_size` rows a forward passed it
    (32 rows of `data.max_seq_len` tokens by default); else that many rows a call. The interleaved schedule (virtual
    pipeline stages, `interleaved` = parallel.pp) takes a multiple of PP micro-batches a call, all of one shape: there
    each call's rows (`train.micro_batch_size` rounded down to a multiple of PP, at least PP; `interleaved_share` made
    the rows a multiple of PP) go in as one-row micro-batches."""
    if config.train.micro_batch_tokens:
        return [token_budget_indices(share, [list(range(len(share)))], config)]
    size = config.train.micro_batch_size
    if interleaved:
        size = max(interleaved, size - size % interleaved)
    ranges = [range(start, min(start + size, len(share))) for start in range(0, len(share), size)]
    return [[[row] for row in rows] if interleaved else [list(rows)] for rows in ranges]


def step_row(step: int, policy, runtime, loss_sum: float, tokens: float, grad_norm: float | None, lr: float,
             microbatches: list[dict], seq_len: int, timer, epoch: int) -> dict:
    """One metrics.jsonl row: loss over the global batch's response tokens, throughput (padding included; the padded
    share of the positions fed is `padding_share`), the step's phases (rank 0's
    `data_time_s`, `forward_backward_time_s`, `optimizer_time_s`), MoE routing (`model.moe`), and on GPUs memory and
    (bf16, fp16) MFU. Collective."""
    padded, input_tokens = (policy.global_tokens(count) for count in batches.padding_counts(microbatches))
    row = {"step": step, "loss": loss_sum / max(tokens, 1), "lr": lr,
           "grad_norm": grad_norm, "tokens_per_s": input_tokens / timer.seconds, "step_time_s": timer.seconds,
           "epoch": epoch, "padding_share": padded / max(input_tokens, 1), **timer.phases,
           **policy.loss_scale_figures(int(grad_norm is None)), **policy.routing_figures.step_figures()}
    # The peaks are bf16's: fp32 products (TF32 off) run at under a tenth of them, so an fp32 run reports no MFU.
    if (peak := metrics.peak_flops()) and (policy.provider.bf16 or policy.provider.fp16):
        per_token = metrics.model_flops_per_token(policy.hf_config, seq_len, frozen_base=policy.lora is not None)
        row["mfu"] = row["tokens_per_s"] * per_token / (peak * runtime.world_size)
    return {**row, **metrics.peak_memory_gib()}


# ---------------------------------------------------------------- main


def main(argv: list[str]):
    """Parse -> validate -> build -> resume -> loop -> save; returns the trained policy (None when nothing was left to do)."""
    # ---- parse, and every check that needs no model
    startup = metrics.StartupTimes()
    console.setup()  # first: a check below may warn, once (rank 0), or per rank where it is that rank's own
    config, resume = cli.parse_args(SFTConfig, argv, "trainer.sft")
    checkpoint.catch_stop_signals()  # a stop signal from here on is honoured at the first step's end
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(world_size)
    checkpoint.check_output_dir(config, resume, process.is_global_rank_zero())
    model_path = build.resolve_model_path(config)
    checkpointer = checkpoint.Checkpointer(config, resume, model_path)
    if checkpointer.finished():
        return None
    startup.mark("config")
    tokenizer = build.load_tokenizer(model_path, template_variables=config.data.chat_template_kwargs)
    data = load_data(config, tokenizer, config.parallel.data_parallel_size(world_size))
    startup.mark("tokenizer and data")

    # ---- build
    runtime = parallel.init_distributed(config.parallel, config.train.seed)
    checkpoint.check_shared_directories(config)
    contents = collectives.content_digest(data.train)  # hashed once: compared across ranks, kept in checkpoints
    collectives.check_same_everywhere(config, {"data.path": contents})
    startup.mark("process group")
    schedule = sft_data.BatchSchedule(len(data.train), config.train.global_batch_size, config.train.micro_batch_size,
                                      runtime.dp_rank, runtime.dp_size, config.train.seed, contents)
    policy = build.build_policy(config, model_path, tokenizer, on_phase=startup.mark)

    # ---- resume
    checkpointer.track(policy, lr_schedule=policy.lr_schedule, data=schedule)
    start_step = checkpointer.resume()
    startup.mark("resume")

    # ---- loop, and save (checkpoints when due; after the last step also the model as an HF checkpoint)
    with metrics.MetricsWriter(config, runtime.is_main, start_step) as writer, checkpointer.kept_on_agreed_stop():
        startup.mark("loggers")
        if start_step == 0 and (baseline := evaluate(policy, data, config, runtime)):
            writer.write({"step": 0, **baseline})  # the untrained model: the baseline the run is judged against
            startup.mark("baseline evaluation")
        startup.report()
        for step in range(start_step + 1, config.train.steps + 1):
            with metrics.StepTimer() as timer:
                with timer.phase("data"):
                    indices = token_budget_indices(data.train, schedule.next_global_batch(), config)
                    microbatches, seq_len = collate_microbatches(data.train, indices, config, tokenizer.pad_token_id,
                                                                 runtime.device)
                loss_sum, tokens, grad_norm, lr = train_step(policy, microbatches, seq_len, timer)
            row = step_row(step, policy, runtime, loss_sum, tokens, grad_norm, lr, microbatches, seq_len, timer,
                           schedule.epoch)
            metrics.stop_if_diverged(row, writer, checkpointer)  # NaN or infinite gradients: nothing more is saved
            if config.train.evaluates_at(step) and data.eval:
                row.update(metrics.timed("eval", evaluate, policy, data, config, runtime, into=row))
            stop = metrics.timed("checkpoint", checkpointer.maybe_save_or_export, step, row, into=row)
            writer.write(row)
            if stop:
                break
    checkpointer.export_if_already_finished(start_step)
    parallel.shutdown(runtime)
    return policy


if __name__ == "__main__":
    cli.run_cli(main)
