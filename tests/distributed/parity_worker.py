"""Run by tests/test_model_path.py in a shared launch (shared_launch.py): HF -> Megatron parity, round trip,
generation.

Each rank writes `<out>/rank<R>.json` with what it measured; the test asserts on those files.
"""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from safetensors.torch import load_file

from config.sections import ParallelConfig
from model import generate, output, parallel, providers, wrapping
from model.tiny import ensure_tiny_checkpoint

PROMPTS = [
    "Tom has 3 apples and buys 5 more. How many apples does Tom have now?",
    "Anna had 9 books and lost 4 of them. How many books are left?",
    "Sam has 4 bags with 6 coins in each bag. How many coins does Sam have in total?",
]


def megatron_logits(chunks, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits [batch, seq, vocab] on the last pipeline stage (None elsewhere), via the pipeline schedule."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)

    def forward_step(iterator, model):
        batch = next(iterator)
        output = model(input_ids=batch, position_ids=positions, attention_mask=None)
        return output, lambda output_tensor, non_loss_data=True: output_tensor

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([tokens]), model=chunks, num_microbatches=1,
        seq_length=tokens.size(1), micro_batch_size=tokens.size(0), forward_only=True, collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(outputs[0])


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes, measured in turn (results in <out>/tp<T>/)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def prepare(args) -> SimpleNamespace:
    """The tiny checkpoint, its tokenizer, and transformers' logits, greedy and early-stopped completions of it."""
    path = ensure_tiny_checkpoint()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    # The reference is loaded before megatron's parallel state exists: transformers 5.12 leaves
    # Qwen2's rotary `inv_freq` buffer uninitialised when loading after initialize_model_parallel.
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = reference.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference_logits = reference(tokens).logits
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
               for text in PROMPTS]
    prompts = [prompt if isinstance(prompt, list) else prompt["input_ids"] for prompt in prompts]
    reference_completions = []
    for prompt in prompts:
        output = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        reference_completions.append(output[0, len(prompt):].tolist())
    # A stop token the prompts reach at different steps (the random model never emits the real EOS): the first
    # row to stop finishes early, so the batch is compacted while the others go on.
    stop = reference_completions[0][4]
    stopped_completions = [
        reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=stop,
                           pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist() for prompt in prompts]
    return SimpleNamespace(path=path, tokenizer=tokenizer, tokens=tokens, logits=reference_logits, prompts=prompts,
                           completions=reference_completions, stop=stop, stopped_completions=stopped_completions)


def run(args, expected: SimpleNamespace) -> None:
    for tp in [int(size) for size in args.tp.split(",")]:
        out = Path(args.out) / f"tp{tp}"
        out.mkdir(parents=True, exist_ok=True)
        runtime = measure(expected.path, expected.tokenizer, tp, args.pp, out, expected)
    if args.pp > 1:
        losses = {vpp: training_losses(expected.path, args.pp, vpp) for vpp in (1, 2)}
        Path(args.out, f"vpp-rank{runtime.rank}.json").write_text(json.dumps(losses))
    parallel.shutdown(runtime)


def training_losses(path, pp: int, vpp: int) -> list[float]:
    """(loss sum, tokens) of one forward and backward of 4 microbatches through the pipeline schedule (1F1B, or
    interleaved at vpp > 1, whose activations and gradients cross between the stages together)."""
    from data import batches
    from trainer.sft import run_microbatches

    parallel.init_distributed(ParallelConfig(pp=pp, vpp=vpp), seed=7)
    provider = providers.configure_provider(providers.auto_bridge(path), dtype="fp32", tp=1, pp=pp, vpp=vpp if vpp > 1 else None,
                                        seq_length=64, transformer_overrides={"calculate_per_token_loss": True})
    chunks = wrapping.build_chunks(provider)
    seeded = torch.Generator().manual_seed(0)
    examples = [batches.Example(torch.randint(3, 200, (20,), generator=seeded).tolist(), [1] * 20) for _ in range(16)]
    microbatches = [batches.collate(examples[start : start + 4], 32, 0) for start in range(0, 16, 4)]
    for batch in microbatches:  # as the loop's collation marks them: the positions the loss reads
        batch["read"] = output.ReadPositions.where(batch["loss_mask"])
    return list(run_microbatches(chunks, microbatches, 32, forward_only=False))


def measure(path, tokenizer, tp: int, pp: int, out: Path, expected: SimpleNamespace):
    """One layout's parity, generation and round trip against transformers' figures (`expected`); writes
    `out/rank<R>.json`."""
    tokens, reference_logits, prompts, stop = expected.tokens, expected.logits, expected.prompts, expected.stop
    reference_completions, stopped_completions = expected.completions, expected.stopped_completions
    vocab = reference_logits.size(-1)
    runtime = parallel.init_distributed(ParallelConfig(tp=tp, pp=pp), seed=7)
    bridge = providers.auto_bridge(path)
    provider = providers.configure_provider(bridge, dtype="fp32", tp=tp, pp=pp, vpp=None, seq_length=64)
    chunks = wrapping.build_chunks(provider)
    result = {"rank": runtime.rank, "world_size": runtime.world_size}

    logits = megatron_logits(chunks, tokens)
    if logits is not None:
        result["max_abs_logit_diff"] = (logits[..., :vocab] - reference_logits).abs().max().item()
        print(f"[parity] TP={tp} PP={pp} rank {runtime.rank}: max |logits - transformers| = "
              f"{result['max_abs_logit_diff']:.3g}", flush=True)

    # Generation at PP=2 passes each forward stage to stage; every rank gets the same completions.
    kwargs = dict(max_new_tokens=16, end_ids=tokenizer.eos_token_id, vocab_size=vocab)
    result["greedy_equal"] = generate.generate(chunks, prompts, **kwargs) == reference_completions
    first = generate.generate(chunks, prompts, temperature=1.0, top_p=0.9, top_k=50, seed=11, **kwargs)
    second = generate.generate(chunks, prompts, temperature=1.0, top_p=0.9, top_k=50, seed=11, **kwargs)
    other = generate.generate(chunks, prompts, temperature=1.0, seed=12, **kwargs)
    result["sampling_reproducible"] = first == second
    result["sampling_seed_matters"] = first != other
    stopped = generate.generate(chunks, prompts, **{**kwargs, "end_ids": stop})
    result["stop_lengths"] = [len(completion) for completion in stopped]
    result["greedy_equal_with_early_stops"] = stopped == stopped_completions
    # samples=N: one prefill per prompt, its N rows in a row; greedy rows repeat the prompt's completion.
    grouped = generate.generate(chunks, prompts, samples=3, **{**kwargs, "end_ids": stop})
    result["samples_greedy_repeat"] = grouped == [completion for completion in stopped for _ in range(3)]
    sampled = [generate.generate(chunks, prompts, samples=4, temperature=1.0, seed=5, **{**kwargs, "end_ids": stop})
               for _ in range(2)]
    result["samples_reproducible"] = sampled[0] == sampled[1]
    result["samples_differ_within_groups"] = sum(len({tuple(row) for row in sampled[0][i : i + 4]})
                                                 for i in range(0, len(sampled[0]), 4))
    result["sampled"] = sampled[0]
    # A checkpoint whose generation_config.json declares two end ids (as Qwen2.5-Instruct's does): generation
    # stops at either, here at the second; a completion that reaches the budget without one is truncated.
    declared = out / f"two-end-ids-rank{runtime.rank}"
    declared.mkdir()
    (declared / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, stop]}))
    end_ids = generate.end_token_ids(declared, tokenizer)
    engine = generate.Engine(chunks, vocab, end_ids)
    two_ends = engine.generate(prompts, max_new_tokens=16)
    result["end_ids"] = list(end_ids) == [tokenizer.eos_token_id, stop]
    result["stops_at_second_end_id"] = two_ends == stopped_completions
    result["truncated"] = [engine.truncated(completion, 16) for completion in two_ends]
    result["truncated_by_hand"] = [len(completion) == 16 and completion[-1] not in (tokenizer.eos_token_id, stop)
                                   for completion in two_ends]

    export_dir = out / "export"
    providers.export_hf(bridge, chunks, export_dir)
    torch.distributed.barrier()
    if runtime.is_main:
        original = load_file(str(path / "model.safetensors"))
        exported = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
        state = exported.state_dict()
        result["round_trip_max_abs_diff"] = max((state[name] - tensor).abs().max().item() for name, tensor in original.items())
        result["round_trip_missing"] = sorted(set(original) - set(state))
        result["round_trip_tied"] = exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    Path(out, f"rank{runtime.rank}.json").write_text(json.dumps(result))
    return runtime

