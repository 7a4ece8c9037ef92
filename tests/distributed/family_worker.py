"""Run by tests/test_model_families.py in the shared launch (shared_launch.py, 2 processes), once for every model
family.

For each `--model NAME=DIR`: HF -> Megatron logit parity, greedy generation against `transformers.generate` and the
export round trip, at TP=2; then a few SFT steps through the SFT entry point's `main` (DP=2). Each rank writes
`<out>/<NAME>/rank<R>.json`, and the SFT its `<out>/<NAME>/sft/metrics.jsonl`; the test asserts on those files.
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

from config.errors import UserError
from config.sections import ParallelConfig
from model import generate, parallel, providers, wrapping
from trainer import sft

PROMPTS = [
    "Tom has 3 apples and buys 5 more. How many apples does Tom have now?",
    "Anna had 9 books and lost 4 of them.",
    "What is 12 + 7?",
]
NEW_TOKENS = 16
SFT_ARGS = ["--train.steps=6", "--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.eval_samples=8",
            "--optim.lr=1e-3", "--optim.warmup_steps=1"]


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint's safetensors files, as stored on disk."""
    return {name: tensor for path in sorted(directory.glob("*.safetensors")) for name, tensor in load_file(str(path)).items()}


def reference_outputs(path: Path) -> dict:
    """transformers' logits on random tokens and greedy completions of chat prompts, for one checkpoint."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    # Longer than the tiny checkpoints' sliding windows, so a family's windowed attention is exercised.
    tokens = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))  # [batch, seq]
    with torch.no_grad():
        logits = model(tokens).logits  # [batch, seq, vocab]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
               for text in PROMPTS]
    prompts = [prompt if isinstance(prompt, list) else prompt["input_ids"] for prompt in prompts]
    completions = []
    for prompt in prompts:
        output = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        completions.append(output[0, len(prompt):].tolist())
    reference = {"tokens": tokens, "logits": logits, "prompts": prompts, "completions": completions, "vocab": vocab,
                 "eos_id": tokenizer.eos_token_id}
    rope = model.config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        # How far the logits move without the rope scaling: shows the parity check would see it ignored.
        config = transformers.AutoConfig.from_pretrained(path)
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
        unscaled = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
        with torch.no_grad():
            reference["rope_scaling_effect"] = (unscaled(tokens).logits - logits).abs().max().item()
    return reference


def check_conversion(path: Path, reference: dict, out_dir: Path, tp: int) -> dict:
    """Megatron logits and greedy completions against the reference, and the export's tensors against the checkpoint's."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    runtime = parallel.init_distributed(ParallelConfig(tp=tp), seed=7)
    try:
        bridge = providers.auto_bridge(path)
        provider = providers.configure_provider(bridge, dtype="fp32", tp=tp, pp=1, vpp=None, seq_length=64)
        chunks = wrapping.build_chunks(provider)
        tokens, vocab = reference["tokens"], reference["vocab"]
        positions = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
        chunks[0].eval()
        with torch.no_grad():
            logits = chunks[0](input_ids=tokens, position_ids=positions, attention_mask=None)
        logits = gather_from_tensor_model_parallel_region(logits)[..., :vocab]  # [batch, seq, vocab]
        completions = generate.generate(chunks, reference["prompts"], max_new_tokens=NEW_TOKENS,
                                        end_ids=reference["eos_id"], vocab_size=vocab)
        result = {"max_abs_logit_diff": (logits - reference["logits"]).abs().max().item(),
                  "greedy_equal": completions == reference["completions"],
                  "generated_tokens": sum(len(completion) for completion in completions)}
        providers.export_hf(bridge, chunks, out_dir / "export")
        torch.distributed.barrier()
        if runtime.is_main:
            original, exported = hf_weights(path), hf_weights(out_dir / "export")
            shared = set(original) & set(exported)
            result["round_trip_tensors"] = len(shared)
            result["round_trip_mismatched_names"] = sorted(set(original) ^ set(exported))
            result["round_trip_bit_identical"] = all(torch.equal(original[name], exported[name]) for name in shared)
        return result
    finally:
        parallel.shutdown(runtime)


def run_family(name: str, path: Path, reference: dict, out_dir: Path, tp: int, sft_data: str) -> dict:
    """Conversion checks, then the SFT entry point; a refusal or a crash is recorded rather than raised."""
    result = {"family": name, "rope_scaling_effect": reference.get("rope_scaling_effect")}
    started = time.process_time()
    try:
        result.update(check_conversion(path, reference, out_dir, tp))
    except UserError as error:
        result["conversion_refused"] = str(error)
    except Exception:
        result["conversion_error"] = traceback.format_exc()
    result["conversion_cpu_seconds"] = round(time.process_time() - started, 1)
    started = time.process_time()
    try:
        sft.main([f"--model.path={path}", f"--data.path={sft_data}", f"--train.out_dir={out_dir / 'sft'}", *SFT_ARGS])
    except UserError as error:
        result["sft_refused"] = str(error)
    except Exception:
        result["sft_error"] = traceback.format_exc()
    finally:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():  # main() stopped before its own shutdown
            parallel_state.destroy_model_parallel()
    result["sft_cpu_seconds"] = round(time.process_time() - started, 1)
    return result


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", required=True, help="NAME=DIR, repeated")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--sft-data", required=True, help="data.path for the SFT steps (train and test splits)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.models = {name: Path(directory) for name, directory in (item.split("=", 1) for item in args.model)}
    return args


def prepare(args) -> dict[str, dict]:
    """Every family's transformers reference (before megatron's parallel state first exists)."""
    started = time.process_time()
    references = {name: reference_outputs(path) for name, path in args.models.items()}
    print(f"[family] references: {time.process_time() - started:.1f} CPU s", flush=True)
    return references


def run(args, references: dict[str, dict]) -> None:
    started = time.process_time()
    for name, path in args.models.items():
        out_dir = Path(args.out) / name
        result = run_family(name, path, references[name], out_dir, args.tp, args.sft_data)
        rank = int(os.environ["RANK"])
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
        print(f"[family] {name} rank {rank}: " + ", ".join(f"{key}={value}" for key, value in result.items()
                                                         if not key.endswith(("_error", "_refused"))), flush=True)
    print(f"[family] every family: {time.process_time() - started:.1f} CPU s", flush=True)
