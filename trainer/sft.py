"""Supervised fine-tuning: `torchrun --nproc-per-node N -m trainer.sft [--config FILE] [--key=value ...]`.

parse -> init -> build -> resume -> loop -> save -> cleanup. The loss is the mean over the response
tokens of the whole global batch (summed per microbatch, divided once by the global token count in
megatron-core's `finalize_model_grads`), so data parallelism and gradient accumulation leave it unchanged.
"""

import functools
import math
import os
from pathlib import Path

import torch

from ckpt import checkpoint
from data import sft as sft_data
from data.arithmetic import extract_final_answer
from model import build, generate, parallel
from trainer import common, config as config_module, precision
from trainer.common import log
from trainer.config import SFTConfig
from trainer.errors import UserError


# ---------------------------------------------------------------- data


def load_data(config, tokenizer, data_parallel_size: int):
    """Tokenized training and held-out examples; every user error here is raised before a model is built."""
    data = config.data

    def examples(path: str, split: str):
        rows = sft_data.load_rows(path, split=split, hub_config=data.hub_config or None)
        conversations, report = sft_data.to_conversations(
            rows, prompt_field=data.prompt_field, response_field=data.response_field, messages_field=data.messages_field or None)
        built = sft_data.build_examples(conversations, tokenizer, data.max_seq_len, report)
        log.info("data %s (%s): %d samples used; %s", path, split, len(built), report.summary())
        return built, conversations

    train_examples, _ = examples(data.path, "train")
    eval_path = data.eval_path or data.path
    try:
        eval_examples, eval_conversations = examples(eval_path, "test")
    except UserError:
        if data.eval_path:
            raise
        log.info("no held-out split found for %s: evaluation is skipped (set data.eval_path)", data.path)
        eval_examples, eval_conversations = [], []
    # A multiple of the data-parallel size, so every rank scores an equal share.
    count = min(config.train.eval_samples, len(eval_examples)) // data_parallel_size * data_parallel_size
    return train_examples, eval_examples[:count], eval_conversations[:count]


def collate_microbatches(examples, microbatch_indices, config, pad_id, device) -> tuple[list[dict], int]:
    """Collated microbatches for one step, all padded to one length (pipeline stages exchange fixed shapes)."""
    groups = [[examples[index] for index in indices] for indices in microbatch_indices]
    if config.data.pack:
        # A microbatch's samples share as few rows as fit; the row count varies, which only the
        # non-pipelined schedule allows (validated at start-up).
        seq_len = config.data.max_seq_len
        batches = [sft_data.collate_packed(sft_data.pack(group, seq_len), seq_len, pad_id) for group in groups]
    else:
        longest = max(len(example.input_ids) - 1 for group in groups for example in group)
        seq_len = min(config.data.max_seq_len, 8 * math.ceil(longest / 8))
        batches = [sft_data.collate(group, seq_len, pad_id) for group in groups]
    return [common.to_device(batch, device) for batch in batches], seq_len


# ---------------------------------------------------------------- loss


def masked_token_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """(loss sum, token count, report) over response tokens; megatron-core divides by the global count."""
    # per_token_loss, loss_mask: [batch, seq]
    loss_sum = (per_token_loss.float() * loss_mask).sum()
    tokens = loss_mask.sum().to(torch.int)
    return loss_sum, tokens, {"loss": torch.stack([loss_sum.detach(), tokens.detach().float()])}


def forward_step(data_iterator, model):
    """One microbatch through the model; with labels, megatron-core returns the per-token loss [batch, seq]."""
    batch = next(data_iterator)
    per_token_loss = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                           attention_mask=batch["attention_mask"], labels=batch["labels"])
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
    return common.reduce_loss_over_data_parallel(losses)


def train_step(chunks, optimizer, lr_schedule, microbatches: list[dict], seq_len: int) -> tuple[float, float, float]:
    """One optimizer step over a global batch's microbatches; returns (loss sum, response tokens, grad norm)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss_sum, tokens = run_microbatches(chunks, microbatches, seq_len, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    lr_schedule.step(increment=1)
    return loss_sum, tokens, float(grad_norm or 0.0)


# ---------------------------------------------------------------- evaluation


def evaluate(chunks, eval_examples, eval_conversations, config, runtime, tokenizer, vocab_size) -> dict:
    """Held-out loss, and greedy exact-match accuracy of the final `#### N` answer when the data has that format."""
    if not eval_examples:
        return {}
    from megatron.core import parallel_state

    metrics = {}
    micro = config.train.micro_batch_size
    # Every data-parallel rank scores an equal share (load_data trimmed the set to a multiple of the
    # DP size), so all ranks run the same number of batches and the DP sums stay collective.
    share = eval_examples[runtime.dp_rank :: runtime.dp_size]
    loss_sum, tokens = 0.0, 0.0
    for start in range(0, len(share), micro):
        group = share[start : start + micro]
        batches, seq_len = collate_microbatches(group, [list(range(len(group)))], config, tokenizer.pad_token_id, runtime.device)
        batch_loss, batch_tokens = run_microbatches(chunks, batches, seq_len, forward_only=True)
        loss_sum, tokens = loss_sum + batch_loss, tokens + batch_tokens
    metrics["eval_loss"] = loss_sum / max(tokens, 1)
    references = [conversation[-1]["content"] for conversation in eval_conversations]
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 and all("####" in reference for reference in references):
        prompts = [tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=True)
                   for conversation in eval_conversations]
        prompts = [prompt if isinstance(prompt, list) else prompt["input_ids"] for prompt in prompts]
        mine = list(range(runtime.dp_rank, len(prompts), runtime.dp_size))
        completions = generate.generate(chunks, [prompts[index] for index in mine], max_new_tokens=config.data.max_seq_len // 2,
                                        eos_id=tokenizer.eos_token_id, vocab_size=vocab_size)
        correct = sum(
            extract_final_answer(tokenizer.decode(completion, skip_special_tokens=True)) == extract_final_answer(references[index])
            for index, completion in zip(mine, completions)
        )
        correct, = common.all_reduce_sum([float(correct)], parallel_state.get_data_parallel_group())
        metrics["eval_accuracy"] = correct / len(prompts)
    return metrics


# ---------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    """Parse -> init -> build -> resume -> loop -> save -> cleanup."""
    import transformers

    # ---- parse, and every check that needs no model
    config, resume = config_module.parse_args(SFTConfig, argv, "trainer.sft")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config_module.validate_startup(config, world_size)
    precision.validate(config)
    if config.data.pack and config.parallel.pp > 1:
        raise UserError("`data.pack=true` gives microbatches a varying number of rows, which pipeline parallelism cannot "
                        "exchange between stages. Use `--data.pack=false` with `parallel.pp` > 1.")
    common.setup_logging(int(os.environ.get("RANK", "0")) == 0)
    model_path = build.resolve_model_path(config.model.path)
    out_dir = Path(config.train.out_dir)
    checkpoint_dir, fingerprint, resume_path, resume_step = checkpoint.find_resume_point(config, resume, model_path)
    if resume_step >= config.train.steps:
        log.info("this run already finished all %d steps (checkpoint %s); nothing to do", config.train.steps, resume_path)
        return
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    data_parallel_size = world_size // (config.parallel.tp * config.parallel.pp)
    train_examples, eval_examples, eval_conversations = load_data(config, tokenizer, data_parallel_size)

    # ---- init
    vpp = config.parallel.vpp if config.parallel.vpp > 1 else None
    runtime = parallel.init_distributed(config.parallel.tp, config.parallel.pp, vpp, config.train.seed)
    schedule = sft_data.BatchSchedule(len(train_examples), config.train.global_batch_size, config.train.micro_batch_size,
                                      runtime.dp_rank, runtime.dp_size, config.train.seed)

    # ---- build
    optimizer_config = precision.optimizer_config(config)
    ddp_config = precision.ddp_config(config, optimizer_config, build.environment_ddp_defaults())
    bridge = build.auto_bridge(model_path)
    provider = build.configure_provider(
        bridge, dtype=config.model.dtype, tp=config.parallel.tp, pp=config.parallel.pp, vpp=vpp,
        seq_length=config.data.max_seq_len, attention=config.model.attention,
        transformer_overrides={"calculate_per_token_loss": True, **precision.transformer_overrides(config)})
    chunks = build.build_chunks(provider, ddp_config)
    optimizer, lr_schedule = common.build_optimizer_and_schedule(chunks, optimizer_config, config)
    build.attach_training_hooks(provider, chunks, optimizer)
    log.info("resolved optimizer and DDP settings:\n%s", precision.settings_table(optimizer_config, ddp_config))
    hf_config = bridge.hf_pretrained.config.to_dict()

    # ---- resume
    start_step = 0
    if resume_path:
        state = checkpoint.load(resume_path, chunks, optimizer)
        lr_schedule.load_state_dict(state["lr_schedule"])
        schedule.load_state_dict(state["data"])
        start_step = state["step"]
        log.info("resumed from %s at step %d (epoch %d)", resume_path, start_step, schedule.epoch)

    def save_checkpoint(step: int) -> None:
        state = {"step": step, "lr_schedule": lr_schedule.state_dict(), "data": schedule.state_dict(),
                 "config": config_module.to_dict(config), "fingerprint": fingerprint}
        checkpoint.save(checkpoint_dir, step, chunks, optimizer, state, config.ckpt.keep_last, runtime.is_main)

    # ---- loop
    metrics = common.MetricsWriter(out_dir, runtime.is_main, config.train.steps, start_step, config.train.log_interval)
    evaluate_now = functools.partial(evaluate, chunks, eval_examples, eval_conversations, config, runtime, tokenizer,
                                     hf_config["vocab_size"])
    if start_step == 0 and (baseline := evaluate_now()):
        metrics.write({"step": 0, **baseline})  # the untrained model: the baseline the run is judged against
    preemption, peak = checkpoint.Preemption(), common.peak_flops()
    for step in range(start_step + 1, config.train.steps + 1):
        with common.StepTimer() as timer:
            microbatches, seq_len = collate_microbatches(train_examples, schedule.next_global_batch(), config,
                                                         tokenizer.pad_token_id, runtime.device)
            loss_sum, tokens, grad_norm = train_step(chunks, optimizer, lr_schedule, microbatches, seq_len)
        input_tokens = common.all_reduce_sum([float(sum(batch["tokens"].numel() for batch in microbatches))])[0]
        input_tokens /= config.parallel.tp * config.parallel.pp  # every TP/PP rank counted the same batch
        row = {"step": step, "loss": loss_sum / max(tokens, 1), "lr": optimizer.param_groups[0]["lr"],
               "grad_norm": grad_norm, "tokens_per_s": input_tokens / timer.seconds,
               "step_time_s": timer.seconds, "epoch": schedule.epoch}
        if peak:
            row["mfu"] = row["tokens_per_s"] * common.model_flops_per_token(hf_config, seq_len) / (peak * runtime.world_size)
        if torch.cuda.is_available():  # this process's high-water mark of allocated tensors so far
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if (config.train.eval_interval and step % config.train.eval_interval == 0) or step == config.train.steps:
            row.update(evaluate_now())
        metrics.write(row)
        if checkpoint.save_if_due(step, config, preemption, save_checkpoint):
            break
    metrics.close()

    # ---- save
    if step == config.train.steps:
        common.export_final_model(bridge, chunks, tokenizer, out_dir, runtime.is_main)
    parallel.shutdown()


if __name__ == "__main__":
    config_module.run_cli(main)
