"""Run by tests/test_grpo_e2e.py in the shared launch (2 processes): the output layer applied only at the read
positions (`model.output`) against the full projection, and GRPO groups laid out with their prompt once
(`grpo.share_prompts`, `data.batches.collate_shared`) against a row per completion, at TP=1 (DP=2) and TP=2 with
sequence parallelism, fp32.

One batch of the tiny model's arithmetic rows, the loss read on the second half of each row (as a completion after its
prompt): per-token log-probs and entropy (GRPO's `token_logprobs` and `chunked_entropy`), a loss of both over the read
positions, its backward. Then groups of 4 completions of one prompt each, through GRPO's own `read_logits`, a row each
and shared. Rank 0 writes `<out>/results.json`: per layout the loss of each way, the largest relative differences of
the read log-probs, of the loss and of every parameter's gradient, and the logits' and inputs' sizes.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import transformers

from config import cli
from config.loops import GRPOConfig
from data import batches
from data.arithmetic import generate_problems
from model import build, output, parallel
from model.tiny import ensure_tiny_checkpoint
from trainer.grpo_math import chunked_entropy
from trainer.grpo_update import read_logits, token_logprobs

TEMPERATURE = 0.9


def loss_and_gradients(model, batch: dict, read: output.ReadPositions | None) -> tuple[torch.Tensor, dict, int]:
    """(per-token log-probs [batch, seq], the loss and every parameter's gradient, the logits' positions): the full
    projection when `read` is None, else only the read positions."""
    from megatron.core import parallel_state

    model.zero_grad(set_to_none=True)
    group = parallel_state.get_tensor_model_parallel_group()
    mask = batch["loss_mask"]  # [batch, seq]
    if read is None:
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
        logprobs = token_logprobs(logits, batch["labels"], TEMPERATURE)  # [batch, seq]
        entropy = chunked_entropy(logits, TEMPERATURE, group)  # [batch, seq]
    else:
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                       output_processor=output.project_positions, output_processor_context=read)
        logprobs = read.scatter(token_logprobs(logits, read.pick(batch["labels"]), TEMPERATURE))  # [batch, seq]
        entropy = read.scatter(chunked_entropy(logits, TEMPERATURE, group))  # [batch, seq]
    return finish(model, logprobs, entropy, mask, logits)


def finish(model, logprobs: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor):
    """The loss over the read positions, its backward: (log-probs, loss and gradients, the logits' positions)."""
    from megatron.core import parallel_state

    loss = ((logprobs + 0.1 * entropy) * mask).sum() / mask.sum()
    loss.backward()
    # Under sequence parallelism a norm's weight gradient on each rank is its slice of the sequence's share, summed over
    # the tensor-parallel ranks by megatron-core's finalize_model_grads: summed here, so layouts that slice differently
    # compare.
    for param in model.parameters():
        if param.grad is not None and getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
    gradients = {name: param.grad.detach().clone() for name, param in model.named_parameters() if param.grad is not None}
    return logprobs.detach(), {"loss": loss.detach(), "gradients": gradients}, logits.shape[:-1].numel()


def grouped_loss_and_gradients(model, batch: dict) -> tuple[torch.Tensor, dict, int]:
    """`loss_and_gradients` through GRPO's `read_logits` (a row per completion, or the prompts shared)."""
    from megatron.core import parallel_state

    model.zero_grad(set_to_none=True)
    read = batch["read"]
    logits = read_logits(model, batch)  # [1, read, vocab shard]
    logprobs = read.scatter(token_logprobs(logits, read.pick(batch["labels"]), TEMPERATURE))  # [rows, seq]
    entropy = read.scatter(chunked_entropy(logits, TEMPERATURE, parallel_state.get_tensor_model_parallel_group()))
    return finish(model, logprobs, entropy, batch["loss_mask"], logits)


def relative(first: torch.Tensor, second: torch.Tensor) -> float:
    return ((first - second).abs().max() / first.abs().max().clamp(min=1e-30)).item()


def compare_shared(config, runtime, model, tokenizer) -> dict:
    """Two groups of 4 completions of one prompt, a row per completion against the prompt once per group."""
    groups = []
    for row in generate_problems(2, seed=11 + runtime.dp_rank):
        prompt = tokenizer(f"{row['question']}\n")["input_ids"]
        for tail in ("", " so", " is the answer", " at last, I think"):
            completion = tokenizer(f"{row['answer']}{tail}")["input_ids"]
            groups.append(batches.Example(prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    units = [groups[:4], groups[4:]]
    pad = batches.padded_size_for(config)
    seq_len = pad(max(len(example.input_ids) - 1 for example in groups))
    rowwise = batches.to_device(batches.collate(groups, seq_len, tokenizer.pad_token_id), runtime.device)
    rowwise["read"] = output.ReadPositions.where(rowwise["loss_mask"])
    shared = batches.to_device(batches.collate_shared(units, seq_len, pad(max(map(batches.shared_length, units))),
                                                      tokenizer.pad_token_id), runtime.device)
    shared["read"] = output.ReadPositions.where(shared["loss_mask"], shared["hidden_index"], shared["tokens"].size(1))
    row_logprobs, row, row_positions = grouped_loss_and_gradients(model, rowwise)
    shared_logprobs, once, shared_positions = grouped_loss_and_gradients(model, shared)
    mask = rowwise["loss_mask"] > 0
    return {"shared_loss_relative": relative(row["loss"], once["loss"]),
            "shared_logprobs_relative": relative(row_logprobs[mask], shared_logprobs[mask]),
            "shared_gradient_relative": max(relative(row["gradients"][name], once["gradients"][name])
                                            for name in row["gradients"]),
            "shared_positions_read": [int(row_positions), int(shared_positions)],
            "shared_input_positions": [rowwise["tokens"].numel(), shared["tokens"].numel()]}


def compare(tp: int, model_path: Path, tokenizer) -> dict:
    """The two ways at one layout."""
    config, _ = cli.parse_args(GRPOConfig, [f"--model.path={model_path}", "--model.dtype=fp32", f"--parallel.tp={tp}",
                                            "--data.max_seq_len=128"], "projection")
    config.validate(int(os.environ["WORLD_SIZE"]))
    runtime = parallel.init_distributed(config.parallel, config.train.seed)
    policy = build.build_policy(config, model_path, tokenizer, trainable=False)
    model = policy.chunks[0].eval()
    rows = generate_problems(4, seed=5 + runtime.dp_rank)  # each data-parallel rank its own rows
    examples = []
    for row in rows:
        ids = tokenizer(f"{row['question']}\n{row['answer']}")["input_ids"]
        examples.append(batches.Example(ids, [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)))
    seq_len = batches.padded_length(examples, config.data.max_seq_len, config.parallel.sequence_multiple)
    batch = batches.to_device(batches.collate(examples, seq_len, tokenizer.pad_token_id), runtime.device)
    read = output.ReadPositions.where(batch["loss_mask"])
    full_logprobs, full, full_positions = loss_and_gradients(model, batch, None)
    read_logprobs, picked, read_positions = loss_and_gradients(model, batch, read)
    mask = batch["loss_mask"] > 0
    return {"loss_full": full["loss"].item(), "loss_read": picked["loss"].item(),
            "loss_relative": relative(full["loss"], picked["loss"]),
            "logprobs_relative": relative(full_logprobs[mask], read_logprobs[mask]),
            "gradient_relative": max(relative(full["gradients"][name], picked["gradients"][name]) for name in full["gradients"]),
            "parameters": len(full["gradients"]), "gradients_equal_names": sorted(full["gradients"]) == sorted(picked["gradients"]),
            "positions_full": int(full_positions), "positions_read": int(read_positions), "read_tokens": int(mask.sum()),
            "sequence_parallel": bool(policy.provider.sequence_parallel), **compare_shared(config, runtime, model, tokenizer)}


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def run(args) -> None:
    model_path = ensure_tiny_checkpoint()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    results = {f"tp{tp}": compare(tp, model_path, tokenizer) for tp in (1, 2)}
    if int(os.environ["RANK"]) == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
