"""Run by tests/test_levers.py in the shared launch (shared_launch.py, 2 processes): sequence parallelism, recomputation
and overlap, end to end:
1. SFT through the entry point's `main`, TP=2, fp32, 5 steps: sequence parallelism off, on, and on with
   `model.recompute=selective` and `full`; the test compares per-step losses, grad norms and exported HF weights.
2. One forward/backward of the same batch at TP=2 with recompute none / selective / full: every parameter gradient.
3. SFT at DP=2 with communication overlap (`overlap_grad_reduce` and `overlap_param_gather`, the GPU default, forced
   on through `ddp.override_ddp_config`) and without: per-step losses and exported weights.
4. Greedy generation at TP=2 with sequence parallelism against `transformers.generate`, then 2 GRPO steps at TP=2
   with sequence parallelism (rollouts with it off, training with it back on).
Rank 0 writes `<out>/results.json`; the runs write their own `metrics.jsonl` and `hf/`.
"""

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from config import cli
from config.loops import SFTConfig
from model import build, generate, parallel
from model.tiny import ensure_tiny_checkpoint
from trainer import grpo, sft

PROMPTS = ["Tom has 3 apples and buys 5 more. How many apples does Tom have now?", "What is 12 + 7?",
           "Anna had 9 books and lost 4 of them. How many books are left?"]
NEW_TOKENS = 16
COMMON = ["--model.dtype=fp32", "--train.steps=5", "--train.global_batch_size=8", "--train.micro_batch_size=2",
          "--train.eval_samples=0", "--optim.lr=1e-3", "--optim.warmup_steps=1", "--data.max_seq_len=64"]
SFT_RUNS = {  # name: arguments beyond COMMON
    "tp2_sp_off": ["--parallel.tp=2", "--parallel.sequence_parallel=false"],
    "tp2_sp_on": ["--parallel.tp=2"],
    "tp2_sp_selective": ["--parallel.tp=2", "--model.recompute=selective", "--model.recompute_modules=[core_attn,mlp]"],
    "tp2_sp_full": ["--parallel.tp=2", "--model.recompute=full"],
    "dp2": [],
    "dp2_overlap": ["--ddp.override_ddp_config={overlap_grad_reduce: true, overlap_param_gather: true}"],
}
GRADIENT_RECOMPUTES = {"none": [], "selective": ["--model.recompute=selective", "--model.recompute_modules=[core_attn,mlp]"],
                       "full": ["--model.recompute=full", "--model.recompute_num_layers=2"]}


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint's safetensors files."""
    return {name: tensor for path in sorted(directory.glob("*.safetensors")) for name, tensor in load_file(str(path)).items()}


def reference_completions(path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Chat prompts and transformers' greedy completions of them (computed before megatron's parallel state exists)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
               for text in PROMPTS]
    prompts = [prompt if isinstance(prompt, list) else prompt["input_ids"] for prompt in prompts]
    completions = [model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
                   for prompt in prompts]
    return prompts, completions


def run_sft(name: str, out: Path, data: str) -> dict:
    """One SFT run through the entry point; its per-step losses and grad norms, and its CPU seconds."""
    started = time.process_time()
    sft.main([f"--data.path={data}", f"--train.out_dir={out / name}", *COMMON, *SFT_RUNS[name]])
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [row["loss"] for row in rows if "loss" in row],
            "grad_norms": [row["grad_norm"] for row in rows if "grad_norm" in row],
            "cpu_seconds": round(time.process_time() - started, 1)}


def export_difference(first: Path, second: Path) -> dict:
    """Largest absolute difference between two exported HF checkpoints, tensor by tensor."""
    a, b = hf_weights(first), hf_weights(second)
    return {"names_equal": sorted(a) == sorted(b), "tensors": len(a),
            "max_abs_diff": max((a[name] - b[name]).abs().max().item() for name in a)}


def recompute_gradients(model_path: Path, tokenizer, data: str) -> dict:
    """Every parameter gradient of one forward/backward at TP=2 with sequence parallelism, per recompute setting:
    the largest absolute difference from `none`, and the losses."""
    from data import batches

    results, baseline = {}, None
    for name, arguments in GRADIENT_RECOMPUTES.items():
        config, _ = cli.parse_args(SFTConfig, [f"--data.path={data}", "--parallel.tp=2", *COMMON, *arguments], "levers")
        config.validate(int(os.environ["WORLD_SIZE"]))
        parallel.init_distributed(config.parallel, config.train.seed)
        policy = build.build_policy(config, model_path, tokenizer, trainable=False)
        model = policy.chunks[0]
        examples = sft.load_data(config, tokenizer, 1).train[:4]
        seq_len = batches.padded_length(examples, config.data.max_seq_len, config.parallel.sequence_multiple)
        batch = batches.collate(examples, seq_len, tokenizer.pad_token_id)
        per_token = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                          labels=batch["labels"])  # [batch, seq]
        loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        gradients = {param_name: param.grad.detach().clone() for param_name, param in model.named_parameters()}
        if baseline is None:
            baseline = gradients
        results[name] = {"loss": loss.item(), "parameters": len(gradients),
                         "max_abs_grad_diff": max((gradients[key] - baseline[key]).abs().max().item() for key in baseline),
                         "bit_identical": all(torch.equal(gradients[key], baseline[key]) for key in baseline)}
    return results


def greedy_with_sequence_parallel(model_path: Path, tokenizer, prompts: list, expected: list) -> dict:
    """Greedy completions at TP=2 with sequence parallelism against transformers', and the switch restored after."""
    config, _ = cli.parse_args(SFTConfig, ["--parallel.tp=2", *COMMON], "levers")
    parallel.init_distributed(config.parallel, config.train.seed)
    policy = build.build_policy(config, model_path, tokenizer, trainable=False)
    completions = generate.generate(policy.chunks, prompts, max_new_tokens=NEW_TOKENS, end_ids=tokenizer.eos_token_id,
                                    vocab_size=policy.vocab_size)
    bare = parallel.unwrap(policy.chunks[0])
    return {"greedy_equal": completions == expected, "generated_tokens": sum(map(len, completions)),
            "sequence_parallel_during_training": bool(policy.provider.sequence_parallel),
            "sequence_parallel_restored": bool(bare.config.sequence_parallel and bare.output_layer.sequence_parallel)}


def varied_reward(completion: str, reference: str) -> float:
    """A reward that differs between completions of an untrained model, so GRPO's advantages (and updates) are not zero."""
    return float(sum(map(ord, completion)) % 2)


def run_grpo(out: Path, model_path: Path, data: str) -> dict:
    """Two GRPO steps at TP=2 with sequence parallelism (KL reference on): per-step losses, KL and grad norms."""
    grpo.main([f"--model.path={model_path}", f"--data.path={data}", f"--train.out_dir={out / 'grpo'}", "--parallel.tp=2",
               "--train.steps=2", "--train.global_batch_size=8", "--train.micro_batch_size=4", "--grpo.n_samples=4",
               "--grpo.max_new_tokens=8", "--data.max_seq_len=64", "--train.eval_samples=0", "--optim.warmup_steps=0",
               "--grpo.reward=levers_worker:varied_reward"])  # this file's directory is on sys.path
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    return {key: [row[key] for row in rows if key in row] for key in ("loss", "kl", "grad_norm", "response_len")}


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="data.path (a directory with train and test splits)")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def prepare(args) -> tuple[list[list[int]], list[list[int]]]:
    return reference_completions(ensure_tiny_checkpoint())


def run(args, references: tuple[list[list[int]], list[list[int]]]) -> None:
    out = Path(args.out)
    model_path = ensure_tiny_checkpoint()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    prompts, expected = references
    results = {}
    phases = {**{f"sft_{name}": (lambda name=name: run_sft(name, out, args.data)) for name in SFT_RUNS},
              "recompute_gradients": lambda: recompute_gradients(model_path, tokenizer, args.data),
              "greedy_sp": lambda: greedy_with_sequence_parallel(model_path, tokenizer, prompts, expected),
              "grpo_sp": lambda: run_grpo(out, model_path, args.data)}
    for name, phase in phases.items():
        started = time.time()
        try:
            results[name] = phase()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["wall_seconds"] = round(time.time() - started, 1)
    for first, second in (("tp2_sp_off", "tp2_sp_on"), ("dp2", "dp2_overlap")):
        if all("error" not in results[f"sft_{name}"] for name in (first, second)):
            results[f"export_{first}_vs_{second}"] = export_difference(out / first / "hf", out / second / "hf")
    if int(os.environ["RANK"]) == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
