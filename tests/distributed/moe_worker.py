"""Run by tests/test_moe.py in the shared launch (shared_launch.py, 2 processes): expert parallelism on `tiny-moe`
through the entry points' `main`, fp32.

- SFT, 20 steps, at EP=1 (DP=2) and EP=2 (the experts split over both ranks, which also form the data-parallel group
  of the dense layers): per-step losses and gradient norms, and both HF exports.
- Generation under EP=2 with rows that finish at different times on the two ranks: rank 0 ends every row at its first
  token (every id is an end id there), rank 1 at none; both must run the same number of forwards, or rank 1's second
  forward would wait forever for rank 0's half of the expert all-to-all.
- GRPO at EP=2 with the distributed optimizer: 4 steps straight, and 2 steps (`train.exit_interval`) in another
  directory, which the test resumes to 4 in fresh processes (with `grpo_argv` of the results). A reward with signal
  in every group (`varied`), so every step trains.
Rank 0 writes `<out>/results.json`.
"""

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from config import cli
from config.loops import GRPOConfig
from model import build, parallel
from model.sampling import Sampling
from trainer import grpo, sft

SFT = ["--model.path=tiny-moe", "--model.dtype=fp32", "--train.steps=20", "--train.eval_samples=0"]
GRPO = ["--model.path=tiny-moe", "--model.dtype=fp32", "--parallel.ep=2", "--parallel.use_distributed_optimizer=true",
        "--train.steps=4", "--train.global_batch_size=32", "--train.micro_batch_size=16", "--train.eval_samples=8",
        "--grpo.max_new_tokens=16", "--grpo.reward=moe_worker:varied", "--ckpt.save_interval=1"]


def varied(completion: str, reference: str) -> float:
    """A reward that differs between the completions of one prompt (their lengths modulo 3), so advantages are non-zero
    even for the untrained tiny-moe, whose answers never earn the arithmetic reward."""
    return (len(completion) % 3) / 2


def every_rank(value) -> list:
    """`value` from every rank, in rank order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def uneven_generation(out: Path) -> dict:
    """Greedy generation at EP=2 where rank 0's rows all end at their first token and rank 1's never end early: the
    completions' lengths and the number of forwards each rank ran."""
    argv = [*GRPO, f"--train.out_dir={out / 'generation'}"]
    config = cli.parse_args(GRPOConfig, argv, "trainer.grpo")[0]
    runtime = parallel.init_distributed(config.parallel, config.train.seed)
    model_path = build.resolve_model_path(config)
    policy = build.build_policy(config, model_path, build.load_tokenizer(model_path), trainable=False)
    engine = policy.engine
    if dist.get_rank() == 0:
        engine.end_ids = tuple(range(policy.vocab_size))
    else:
        engine.end_ids = ()
    forwards = []
    hook = policy.chunks[0].register_forward_hook(lambda *_: forwards.append(1))
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    completions = engine.generate(prompts, max_new_tokens=6, samples=2, sampling=Sampling())
    hook.remove()
    parallel.shutdown(runtime)
    return {"lengths": every_rank([len(completion) for completion in completions]), "forwards": every_rank(len(forwards))}


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def run(args) -> None:
    out = Path(args.out)
    for ep in (1, 2):
        sft.main([*SFT, f"--parallel.ep={ep}", f"--train.out_dir={out / f'sft-ep{ep}'}"])
    results = {"generation": uneven_generation(out), "grpo_argv": GRPO}
    grpo.main([*GRPO, f"--train.out_dir={out / 'grpo' / 'straight'}"])
    grpo.main([*GRPO, f"--train.out_dir={out / 'grpo' / 'split'}", "--train.exit_interval=2"])
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))
