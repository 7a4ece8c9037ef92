"""Run by tests/test_tools_e2e.py in the shared launch (shared_launch.py, 2 processes): multi-turn generation through
`continue_rows` equals a fresh prefill of each whole trajectory, at TP=2 and at TP=1, with SDPA and megatron's local
attention, padded (masked) and unpadded (given tokens fed one per step, Transformer Engine's path).

A random-weight tiny model samples greedily; half of the vocabulary ends a turn, so turns are short; each row is
given 2-5 tokens after each of its first three turns. For every row that was continued, greedy generation from the
prompt plus the completion up to its last given token must produce exactly the rest of the completion. Rank 0 of each
layout writes `<out>/tp<N>.json`.
"""

import argparse
import json
from pathlib import Path

import torch

from config.sections import ParallelConfig
from model import generate, parallel, providers, wrapping
from model.tiny import ensure_tiny_checkpoint

NEW_TOKENS = 40


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def check(model, vocab: int, padded: bool) -> dict:
    """Continued generation against fresh prefills, and the forwards it took."""
    tokens = torch.randint(3, vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    prompts = [tokens[0, :9].tolist(), tokens[1, :5].tolist(), tokens[2, :12].tolist()]
    end_ids = tuple(range(3, vocab, 2))
    given = {}  # row -> (start, length) of its given runs

    def continue_rows(requests):
        appended = []
        for row, completion, left in requests:
            runs = given.setdefault(row, [])
            count = 2 + (row + len(runs)) % 4
            if len(runs) == 3 or count >= left:
                appended.append(None)
                continue
            runs.append((len(completion), count))
            appended.append([3 + (row * 7 + len(runs) * 3 + index) % (vocab - 3) for index in range(count)])
        return appended

    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(kwargs["input_ids"].size(1)),
                                           with_kwargs=True)
    saved = generate.masks_pads
    if not padded:
        generate.masks_pads = lambda model: False
    try:
        completions = generate.generate([model], prompts, max_new_tokens=NEW_TOKENS, end_ids=end_ids, vocab_size=vocab,
                                        samples=2, continue_rows=continue_rows)
        hook.remove()
        exact, continued = True, 0
        for row, completion in enumerate(completions):
            if not given.get(row):
                continue
            continued += 1
            start, count = given[row][-1]
            cut = start + count
            rest = generate.generate([model], [prompts[row // 2] + completion[:cut]], max_new_tokens=len(completion) - cut,
                                     end_ids=end_ids, vocab_size=vocab)[0]
            exact = exact and rest == completion[cut:]
    finally:
        generate.masks_pads = saved
        hook.remove()
    return {"exact": exact, "continued_rows": continued, "given_runs": sum(len(runs) for runs in given.values()),
            "forwards": len(forwards), "columns": sum(forwards)}


def run(args) -> None:
    path = ensure_tiny_checkpoint()
    bridge = providers.auto_bridge(path)
    vocab = bridge.hf_pretrained.config.vocab_size
    for tp in (2, 1):
        runtime = parallel.init_distributed(ParallelConfig(tp=tp), seed=5)
        result = {}
        for spec in ("sdpa", "local"):
            provider = providers.configure_provider(bridge, dtype="fp32", tp=tp, pp=1, vpp=None, seq_length=128, attention=spec)
            model = wrapping.build_chunks(provider)[0]
            for padded in (True, False):
                result[f"{spec}-{'padded' if padded else 'unpadded'}"] = check(model, vocab, padded)
        print(f"[continuation] TP={tp} rank {runtime.rank}: {json.dumps(result)}", flush=True)
        if runtime.rank == 0:
            Path(args.out, f"tp{tp}.json").write_text(json.dumps(result))
    parallel.shutdown(runtime)
