"""Reward-model training: `torchrun --nproc-per-node N -m trainer.rm [--config FILE] [--key=value ...]`.

parse -> validate -> build -> resume -> loop -> save, as SFT. The model is the starting checkpoint with a scalar head
in place of its output layer (`model.score_head`): a new head on a causal LM (normal, std `initializer_range`, from
`train.seed`), or a reward model's own. Each pair's two sides are adjacent rows of a micro-batch, scored at their
last token; the loss is Bradley-Terry's -log sigmoid(r_chosen - r_rejected), summed per micro-batch and divided once
by the global batch's pair count (megatron-core's `finalize_model_grads`), so data parallelism and gradient
accumulation leave it unchanged. Rows report the pair accuracy (chosen scored above rejected) and the margin; the
final model is exported as a Hugging Face `...ForSequenceClassification` with one label.
"""

import dataclasses
import functools
import os

import torch

from ckpt import checkpoint
from config import cli, console, process
from config.loops import RMConfig
from data import batches, preferences, sft as sft_data
from model import build, collectives, parallel, score_head
from trainer import default_start, metrics, preference_set
from trainer.metrics import log

# The sums each micro-batch reports, in order; the row's figures are their ratios to the pair count.
SUMS = ("loss", "pairs", "accuracy", "margin", "chosen_score", "rejected_score")


@dataclasses.dataclass
class RMData:
    """Tokenized training and held-out pairs."""

    train: list[preferences.Pair]
    eval: list[preferences.Pair]


def load_data(config, tokenizer, data_parallel_size: int) -> RMData:
    """Every user error in the data is raised here, before a model is built. The held-out pairs are trimmed to whole
    micro-batches on every data-parallel rank."""
    data = config.data
    train, report = preferences.load_pairs(data.path, data.train_split, data, tokenizer)
    log.info("pairs %s (train): %d used; %s%s", data.path, len(train), report.summary(),
             sft_data.rows_left_out_note(len(train), config.train.global_batch_size))
    held_out = []
    if config.train.eval_samples:
        loaded = preferences.held_out_pairs(data, tokenizer)
        whole = data_parallel_size * config.train.micro_batch_size
        held_out = loaded[: min(config.train.eval_samples, len(loaded)) // whole * whole]
        if loaded and not held_out:
            log.warning("held-out pair accuracy skipped: %d held-out pairs are fewer than one micro-batch per "
                        "data-parallel rank (%d)", len(loaded), whole)
    return RMData(train, held_out)


def collate_microbatches(pairs: list, microbatch_indices: list[list[int]], config, pad_id: int,
                         device) -> tuple[list[dict], int]:
    """A step's micro-batches of pairs (each padded to its own longest side; with pipeline stages, which exchange fixed
    shapes, all to the step's), and the step's padded length."""
    groups = [[pairs[index] for index in indices] for indices in microbatch_indices]
    pad = batches.padded_size_for(config)
    longest = [max(len(side) for pair in group for side in (pair.chosen, pair.rejected)) for group in groups]
    seq_len = pad(max(longest))
    collated = [preferences.collate_pairs(group, seq_len if parallel.fixed_microbatch_shape() else pad(length), pad_id)
                for group, length in zip(groups, longest)]
    return [batches.to_device(batch, device) for batch in collated], seq_len


# ---------------------------------------------------------------- loss


def pair_loss(scores: torch.Tensor):
    """(loss sum, pair count, report) of a micro-batch's scores [2 x pairs] (chosen, rejected, ...): Bradley-Terry's
    -log sigmoid(r_chosen - r_rejected) summed over its pairs; megatron-core divides by the global pair count."""
    chosen, rejected = scores[0::2], scores[1::2]  # [pairs]
    margin = chosen - rejected
    loss_sum = -torch.nn.functional.logsigmoid(margin).sum()
    pairs = torch.tensor(margin.numel(), dtype=torch.int)
    sums = torch.stack([loss_sum, pairs.float(), (margin > 0).float().sum(), margin.sum(), chosen.sum(), rejected.sum()])
    return loss_sum, pairs, {"rm": sums.detach()}


def forward_step(pad_id: int, data_iterator, model):
    """One micro-batch through the model: its rows' scores at their last token (`model.score_head`)."""
    return score_head.forward_scores(model, next(data_iterator), pad_id), pair_loss


def run_microbatches(chunks, microbatches: list[dict], seq_len: int, pad_id: int, forward_only: bool) -> dict:
    """Forward (and backward) micro-batches through megatron-core's pipeline schedule; the `SUMS` over them and over
    the data-parallel ranks, known to every rank."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iterators = [iter(microbatches) for _ in chunks]
    reports = get_forward_backward_func()(
        forward_step_func=functools.partial(forward_step, pad_id), data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks, num_microbatches=len(microbatches), seq_length=seq_len,
        micro_batch_size=microbatches[0]["tokens"].size(0), forward_only=forward_only)
    totals = torch.zeros(len(SUMS), dtype=torch.float64)
    for report in reports:
        totals += report["rm"].to("cpu", torch.float64)
    return dict(zip(SUMS, collectives.last_stage_sum(totals.tolist())))


def figures(sums: dict, prefix: str = "") -> dict:
    """Per-pair means of the sums: loss, accuracy (chosen above rejected), margin, the sides' mean scores."""
    pairs = max(sums["pairs"], 1.0)
    return {f"{prefix}{name}": sums[name] / pairs for name in SUMS if name != "pairs"}


def train_step(policy, microbatches: list[dict], seq_len: int, timer) -> tuple[dict, float | None, float]:
    """One optimizer step over a global batch's micro-batches, timed as the step's `forward_backward` and `optimizer`
    phases; the step's sums, grad norm (None: the update was skipped) and the rate it used."""
    with timer.phase("forward_backward"):
        for chunk in policy.chunks:
            chunk.zero_grad_buffer()
        policy.optimizer.zero_grad()
        sums = run_microbatches(policy.chunks, microbatches, seq_len, policy.tokenizer.pad_token_id, forward_only=False)
    with timer.phase("optimizer"):
        grad_norm = policy.optimizer_step()  # None: skipped (fp16 overflow), and the LR schedule stays
        lr = policy.next_lr(applied=grad_norm is not None)
    return sums, grad_norm, lr


def evaluate(policy, data: RMData, config, runtime) -> dict:
    """Held-out loss, pair accuracy (`eval_accuracy`), margin and scores, forward only; each data-parallel rank scores
    an equal share, in micro-batches of `train.micro_batch_size` pairs."""
    if not data.eval:
        return {}
    share = data.eval[runtime.dp_rank :: runtime.dp_size]
    micro = config.train.micro_batch_size
    indices = [list(range(start, start + micro)) for start in range(0, len(share), micro)]
    microbatches, seq_len = collate_microbatches(share, indices, config, policy.tokenizer.pad_token_id, runtime.device)
    with build.eval_mode(policy.chunks[0]):
        sums = run_microbatches(policy.chunks, microbatches, seq_len, policy.tokenizer.pad_token_id, forward_only=True)
    return figures(sums, "eval_")


def step_row(step: int, policy, sums: dict, grad_norm: float | None, lr: float, microbatches: list[dict], timer,
             epoch: int) -> dict:
    """One metrics.jsonl row: the pairs' loss, accuracy, margin and scores, lr, grad norm, throughput (padding
    included; its share is `padding_share`), the step's phases. Collective."""
    padded, input_tokens = (policy.global_tokens(count) for count in batches.padding_counts(microbatches))
    return {"step": step, **figures(sums), "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": input_tokens / timer.seconds, "step_time_s": timer.seconds, "epoch": epoch,
            "padding_share": padded / max(input_tokens, 1), **timer.phases,
            **policy.loss_scale_figures(int(grad_norm is None)), **metrics.peak_memory_gib()}


# ---------------------------------------------------------------- main


def prepare_start(config, world_size: int, startup):
    """The process group; the default SFT when the run starts from it and it is missing; the embedded preference set
    when it is the data and is missing. The runtime, or None when the default SFT stopped on a signal (saved)."""
    if config.starts_from_default_sft():
        sft = default_start.validate(world_size, config.model.path, config.data, "trainer.rm")
        default_start.check_outputs_apart(config, sft, "trainer.rm")
    else:
        default_start.say_earlier_start(config.model.path, "trainer.rm")
    runtime = parallel.init_distributed(config.parallel, config.train.seed)
    checkpoint.check_shared_directories(config)
    startup.mark("process group")
    if config.starts_from_default_sft() and not default_start.train_default_sft(config, program="trainer.rm"):
        parallel.shutdown(runtime)
        return None
    if preference_set.missing(config.data.path):
        log.info("%s does not exist yet: sampling it from %s", config.data.path, config.model.path)
        preference_set.build_preference_set(config, build.resolve_model_path(config), runtime)
        startup.mark("preference set")
    elif runtime.is_main:
        preference_set.warn_if_stale(config.data.path, build.resolve_model_path(config), config)
    return runtime


def main(argv: list[str]):
    """Parse -> validate -> build -> resume -> loop -> save; returns the trained reward model (None when nothing was
    left to do)."""
    # ---- parse, and every check that needs no model
    startup = metrics.StartupTimes()
    console.setup()  # first: a check below may warn, once (rank 0), or per rank where it is that rank's own
    config, resume = cli.parse_args(RMConfig, argv, "trainer.rm")
    checkpoint.catch_stop_signals()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(world_size)
    checkpoint.check_output_dir(config, resume, process.is_global_rank_zero())
    startup.mark("config")
    if (runtime := prepare_start(config, world_size, startup)) is None:
        return None
    # Loaded after the process group formed: a rank's user error is every rank's (`agreed`), none waits for it.
    model_path = collectives.agreed(build.resolve_model_path, config)
    checkpointer = collectives.agreed(checkpoint.Checkpointer, config, resume, model_path)
    if checkpointer.finished():
        parallel.shutdown(runtime)
        return None
    tokenizer = collectives.agreed(build.load_tokenizer, model_path, "model.path", config.data.chat_template_kwargs)
    data = collectives.agreed(load_data, config, tokenizer, runtime.dp_size)
    contents = collectives.content_digest(data.train)  # hashed once: compared across ranks, kept in checkpoints
    collectives.check_same_everywhere(config, {"data.path": contents})
    startup.mark("tokenizer and data")

    # ---- build (a reward model's own head, or a new one on a causal LM)
    schedule = sft_data.BatchSchedule(len(data.train), config.train.global_batch_size, config.train.micro_batch_size,
                                         runtime.dp_rank, runtime.dp_size, config.train.seed, contents)
    view, weight = score_head.causal_view(model_path, "model.path")
    policy = build.build_policy(config, view, tokenizer, on_phase=startup.mark, score_head=(config.train.seed, weight))

    # ---- resume
    checkpointer.track(policy, lr_schedule=policy.lr_schedule, data=schedule)
    start_step = checkpointer.resume()
    startup.mark("resume")

    # ---- loop, and save (checkpoints when due; after the last step also the model as an HF checkpoint)
    with metrics.MetricsWriter(config, runtime.is_main, start_step) as writer, checkpointer.kept_on_agreed_stop():
        startup.mark("loggers")
        if start_step == 0 and (baseline := evaluate(policy, data, config, runtime)):
            writer.write({"step": 0, **baseline})  # the new head: chance, the figure the run is judged against
            startup.mark("baseline evaluation")
        startup.report()
        for step in range(start_step + 1, config.train.steps + 1):
            with metrics.StepTimer() as timer:
                with timer.phase("data"):
                    microbatches, seq_len = collate_microbatches(data.train, schedule.next_global_batch(), config,
                                                                 tokenizer.pad_token_id, runtime.device)
                sums, grad_norm, lr = train_step(policy, microbatches, seq_len, timer)
            row = step_row(step, policy, sums, grad_norm, lr, microbatches, timer, schedule.epoch)
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
