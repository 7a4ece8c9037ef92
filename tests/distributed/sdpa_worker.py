"""Run by tests/test_sdpa_attention.py in the shared launch (shared_launch.py): the SDPA layer spec against megatron-core's local one.

For each tensor-parallel size in `--tp` (one launch serves several: megatron's parallel state is torn
down and set up again in between), the tiny model is built twice from the same HF weights, once per
spec (fp32). Each rank writes `<out>/tp<T>-rank<R>.json` with what it measured:
- forward: full-vocab logits of a plain causal batch and of a packed row (block-diagonal mask);
- backward: every parameter's gradient of the summed per-token loss over both batches;
- packing: each sample of the packed row against the same sample run on its own, and the same row
  without its mask (which must differ: that is what shows the mask is applied);
- greedy KV-cache generation, dropout behaviour, and the checkpoint keys of both specs.
"""

import argparse
import json
from pathlib import Path

import torch

from config.sections import ParallelConfig
from data.batches import Example, collate, collate_packed
from model import generate, parallel, providers, wrapping
from model.tiny import ensure_tiny_checkpoint

SPECS = ("local", "sdpa")
PACKED_LENGTHS = (10, 14)  # input tokens of the two packed samples
PACKED_ROW = 28  # the row is longer than both, so it ends with padding (its own segment)


def full_logits(model, tokens, positions, mask) -> torch.Tensor:
    """Logits [batch, seq, vocab] gathered over tensor-parallel ranks."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(model(input_ids=tokens, position_ids=positions, attention_mask=mask))


def max_abs(first: torch.Tensor, second: torch.Tensor) -> float:
    """Largest absolute elementwise difference."""
    return (first - second).abs().max().item()


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes, measured in turn")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def run(args) -> None:
    path = ensure_tiny_checkpoint()
    for tp in [int(size) for size in args.tp.split(",")]:
        runtime = parallel.init_distributed(ParallelConfig(tp=tp), seed=5)
        result = compare_specs(tp, providers.auto_bridge(path))
        print(f"[sdpa] TP={tp} rank {runtime.rank}: {json.dumps(result)}", flush=True)
        Path(args.out, f"tp{tp}-rank{runtime.rank}.json").write_text(json.dumps(result))
    parallel.shutdown(runtime)


def compare_specs(tp: int, bridge) -> dict:
    """Everything the test asserts on, for one tensor-parallel size."""
    models = {}
    for spec in SPECS:
        provider = providers.configure_provider(bridge, dtype="fp32", tp=tp, pp=1, vpp=None, seq_length=64, attention=spec)
        models[spec] = parallel.unwrap(wrapping.build_chunks(provider)[0])
    result = {"tp": tp, "core_attention": {
        spec: type(model.decoder.layers[0].self_attention.core_attention).__name__ for spec, model in models.items()}}

    vocab = bridge.hf_pretrained.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (2, 24), generator=generator)  # [batch, seq]
    positions = torch.arange(24).unsqueeze(0).expand_as(tokens)
    labels = torch.randint(3, vocab, (2, 24), generator=generator)
    samples = [Example(torch.randint(3, vocab, (length + 1,), generator=generator).tolist(), [1] * (length + 1))
               for length in PACKED_LENGTHS]
    packed = collate_packed([samples], PACKED_ROW, pad_id=0)
    alone = [collate([sample], len(sample.input_ids) - 1, pad_id=0) for sample in samples]

    # ---- forward (no grad) and backward, per spec
    logits, packed_logits, grads = {}, {}, {}
    for spec, model in models.items():
        model.train()  # dropout is 0 in the tiny model's config, so train mode is deterministic
        with torch.no_grad():
            logits[spec] = full_logits(model, tokens, positions, None)
            packed_logits[spec] = full_logits(model, packed["tokens"], packed["position_ids"], packed["attention_mask"])
        model.zero_grad()
        # Mean per-token losses, as in training: gradients of order one, so 1e-5 means the same as for logits.
        plain_loss = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels).mean()
        packed_loss = model(input_ids=packed["tokens"], position_ids=packed["position_ids"],
                            attention_mask=packed["attention_mask"], labels=packed["labels"])
        (plain_loss + (packed_loss * packed["loss_mask"]).sum() / packed["loss_mask"].sum()).backward()
        grads[spec] = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    result["max_abs_logit_diff"] = max_abs(logits["sdpa"], logits["local"])
    result["max_abs_packed_logit_diff"] = max_abs(packed_logits["sdpa"], packed_logits["local"])
    result["logit_scale"] = logits["local"].abs().max().item()
    result["grad_names_equal"] = sorted(grads["sdpa"]) == sorted(grads["local"])
    result["grads_compared"] = len(grads["local"])
    result["max_abs_grad_diff"] = max(max_abs(grads["sdpa"][name], grad) for name, grad in grads["local"].items())
    result["grad_scale"] = max(grad.abs().max().item() for grad in grads["local"].values())

    # ---- packing: each sample of the row equals that sample alone; without the mask it does not
    sdpa = models["sdpa"]
    with torch.no_grad():
        unmasked = full_logits(sdpa, packed["tokens"], packed["position_ids"], None)
        start, separate, leaked = 0, [], []
        for sample, batch in zip(samples, alone):
            end = start + len(sample.input_ids) - 1
            own = full_logits(sdpa, batch["tokens"], batch["position_ids"], None)
            separate.append(max_abs(packed_logits["sdpa"][:, start:end], own))
            leaked.append(max_abs(unmasked[:, start:end], own))
            start = end
    result["packed_vs_separate_max_abs_diff"] = separate
    result["packed_without_mask_max_abs_diff"] = leaked

    # ---- KV-cache generation: prompts of 9, 5 and 7 tokens left-padded into one batch (masked prefill,
    # then one masked query at a time) give what each prompt gives alone (no pads, no mask)
    prompts = [tokens[0, :9].tolist(), tokens[1, :5].tolist(), tokens[1, 3:10].tolist()]
    completions = {spec: generate.generate([model], prompts, max_new_tokens=8, end_ids=(), vocab_size=vocab)
                   for spec, model in models.items()}
    result["greedy_equal"] = completions["sdpa"] == completions["local"]
    result["greedy_tokens"] = sum(len(completion) for completion in completions["sdpa"])
    result["batched_equals_alone"] = {
        spec: completions[spec] == [generate.generate([model], [prompt], max_new_tokens=8, end_ids=(), vocab_size=vocab)[0]
                                    for prompt in prompts] for spec, model in models.items()}
    result["masks_pads"] = {spec: generate.masks_pads(model) for spec, model in models.items()}
    # The path taken with Transformer Engine's attention (no pads, longer prompts fed one token per step).
    masks_pads, generate.masks_pads = generate.masks_pads, lambda model: False
    try:
        result["unpadded_equals_padded"] = {
            spec: generate.generate([model], prompts, max_new_tokens=8, end_ids=(), vocab_size=vocab) == completions[spec]
            for spec, model in models.items()}
    finally:
        generate.masks_pads = masks_pads

    # ---- a sliding window (4 tokens): megatron's local softmax then builds its own window mask and drops ours, so
    # that spec generates unpadded; SDPA applies both. Either way, batched prompts give what each gives alone.
    windowed = {spec: parallel.unwrap(wrapping.build_chunks(providers.configure_provider(
        bridge, dtype="fp32", tp=tp, pp=1, vpp=None, seq_length=64, attention=spec,
        transformer_overrides={"window_size": (4, 0)}))[0]) for spec in SPECS}
    result["windowed_masks_pads"] = {spec: generate.masks_pads(model) for spec, model in windowed.items()}
    result["windowed_batched_equals_alone"] = {
        spec: generate.generate([model], prompts, max_new_tokens=8, end_ids=(), vocab_size=vocab)
        == [generate.generate([model], [prompt], max_new_tokens=8, end_ids=(), vocab_size=vocab)[0] for prompt in prompts]
        for spec, model in windowed.items()}

    # ---- attention dropout: only in training, drawn from the model-parallel RNG stream
    for layer in sdpa.decoder.layers:
        layer.self_attention.core_attention.dropout_p = 0.5
    with torch.no_grad():
        first, second = (full_logits(sdpa, tokens, positions, None) for _ in range(2))
        sdpa.eval()
        evaluated = full_logits(sdpa, tokens, positions, None)
    result["dropout_train_calls_differ"] = max_abs(first, second)
    result["dropout_eval_vs_no_dropout"] = max_abs(evaluated, logits["sdpa"])

    # ---- checkpoints: the SDPA module holds no state, so both specs shard the same tensors
    keys = {spec: sorted(model.sharded_state_dict().keys()) for spec, model in models.items()}
    result["checkpoint_keys_equal"] = keys["sdpa"] == keys["local"]
    result["checkpoint_keys"] = len(keys["local"])
    return result

