"""Run by tests/test_lora.py in the shared launch (shared_launch.py, 2 processes): LoRA SFT through the entry point's
`main`, at TP=1 (DP=2, the distributed optimizer), TP=2 and PP=2.

Per layout: 6 steps straight, then 3 steps (`train.exit_interval`) and a resume to 6, into another directory. After
the straight run, with the trained policy still in memory:
- every base tensor is bit-identical to a fresh build from the checkpoint (only adapters trained);
- with the adapters switched off the logits equal the fresh build's exactly (GRPO's KL reference);
- the first rank with the logits (the last pipeline stage) saves the trainer's logits of a batch, which the test
  compares with `hf/` (merged) in transformers and with base + `hf_adapter/` in peft.
Then 2 steps with adapters on the MLPs only, with and without selective recomputation of the MLPs (`RECOMPUTED`).
Rank 0 writes `<out>/results.json`.
"""

import argparse
import json
from pathlib import Path

import torch

from config import cli
from config.loops import SFTConfig
from model import parallel, wrapping
from tests.distributed.parity_worker import megatron_logits
from trainer import sft

COMMON = ["--peft.method=lora", "--model.dtype=fp32", "--train.steps=6", "--train.global_batch_size=8",
          "--train.micro_batch_size=2", "--train.eval_samples=8", "--train.eval_interval=3", "--optim.lr=1e-2",
          "--optim.warmup_steps=1", "--ckpt.save_interval=3", "--data.max_seq_len=64"]
# TP=1 runs two data-parallel ranks under the distributed optimizer (the adapters' state sharded over them); PP=2
# puts each half of the layers, with its adapters, on one rank.
LAYOUTS = {"tp1": ["--parallel.tp=1", "--parallel.use_distributed_optimizer=true"], "tp2": ["--parallel.tp=2"],
           "pp2": ["--parallel.pp=2"]}
# Adapters on the MLPs only, 2 steps at TP=1, with and without the MLPs recomputed: the recomputed MLPs' inputs come
# through frozen layers only (their adapters trained nothing, grad_norm 0, before model/lora.py made them require grad).
MLP_ONLY = ["--peft.target_modules=[linear_fc1,linear_fc2]", "--train.steps=2", *LAYOUTS["tp1"]]
RECOMPUTED = {"mlp_only": [], "mlp_only_recomputed": ["--model.recompute=selective", "--model.recompute_modules=[mlp]"]}


def logits(chunks: list, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits of a batch (tensor-parallel shards gathered), [batch, seq, vocab], through the pipeline
    schedule: on the last pipeline stage (None on the others)."""
    with torch.no_grad():
        return megatron_logits(chunks, tokens)


def base_tensors(chunks: list) -> dict[str, torch.Tensor]:
    """Every non-adapter parameter under its base name (LoRA's wrapper adds `.to_wrap`)."""
    return {name.replace(".to_wrap", ""): param.detach().clone() for name, param in parallel.unwrap(chunks[0]).named_parameters()
            if ".adapter." not in name}


def check(policy, out_dir: Path, vocab: int) -> dict:
    """The straight run's policy against a fresh build, and its exports against transformers and peft. Each rank checks
    its own base tensors; the logits are checked where they exist (the last pipeline stage). Collective: every rank's
    findings, combined."""
    fresh = wrapping.build_chunks(policy.provider)
    trained, untouched = base_tensors(policy.chunks), base_tensors(fresh)
    tokens = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = logits(policy.chunks, tokens)
    with policy.adapters_disabled():
        adapters_off = logits(policy.chunks, tokens)
    base = logits(fresh, tokens)
    result = {"base_names_equal": sorted(trained) == sorted(untouched),
              "base_bit_identical": all(torch.equal(trained[name], untouched[name]) for name in untouched),
              "trainable": sorted({name.split(".adapter.")[-1] for name, param in policy.chunks[0].named_parameters()
                                   if param.requires_grad})}
    if ours is not None:
        ours, adapters_off, base = ours[..., :vocab], adapters_off[..., :vocab], base[..., :vocab]
        result |= {"adapters_off_equals_base": torch.equal(adapters_off, base),
                   "adapters_change_logits": not torch.equal(ours, adapters_off)}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (result, ours is not None))
    holder = next(rank for rank, (_, holds) in enumerate(everyone) if holds)
    if torch.distributed.get_rank() == holder:  # compared in the test's own process: transformers loaded after
        # megatron's set-up breaks Qwen2's rotary
        torch.save({"tokens": tokens, "logits": ours}, out_dir / "trainer_logits.pt")
    combined = {}
    for rank_result, _ in everyone:
        for key, value in rank_result.items():
            combined[key] = combined.get(key, value) if isinstance(value, list) else combined.get(key, True) and value
    return combined


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def run(args) -> None:
    out = Path(args.out)
    is_main = torch.distributed.get_rank() == 0
    results = {}
    for name, layout in LAYOUTS.items():
        straight, split = out / name / "straight", out / name / "split"
        argv = [*COMMON, *layout, f"--train.out_dir={straight}"]
        policy = sft.main(argv)
        parallel.init_distributed(cli.parse_args(SFTConfig, argv, "trainer.sft")[0].parallel, seed=0)  # main tore it down
        results[name] = check(policy, straight, policy.vocab_size)
        del policy
        sft.main([*COMMON, *layout, f"--train.out_dir={split}", "--train.exit_interval=3"])
        sft.main([*COMMON, *layout, f"--train.out_dir={split}", "--resume-from-checkpoint", "latest"])
    for name, recompute in RECOMPUTED.items():
        sft.main([*COMMON, *MLP_ONLY, *recompute, f"--train.out_dir={out / name}"])
    if is_main:
        (out / "results.json").write_text(json.dumps(results))
