"""Run by tests/test_routing.py in the shared launch (shared_launch.py, 2 processes): routing replay on the embedded
Mixture-of-Experts model (`tiny-moe`, fp32), at TP=1 (each rank its own replica) and TP=2 with sequence parallelism
(each rank's router sees half of every sequence).

For each layout: generation with recorded routes (prompts of different lengths, padded, 2 samples each); then the
training-side forward over prompt + completion, right-padded as GRPO collates it:
- compared with the recorded routes (router choosing on its own): the share of (token, layer) decisions that differ,
  and the sampler's log-probs against this forward's;
- replaying other routes (a random top-k set per token): every router's routing map must be exactly those sets, and the
  router's own choice differs from most of them.
Rank 0 of each layout writes `<out>/tp<N>.json`. Then PP=2: each stage's recorded routes must be its own layers' slice
of PP=1's, over the same completions (`<out>/pp2-rank<R>.json`).
"""

import argparse
import json
from pathlib import Path

import torch

from config.sections import ParallelConfig
from data import batches
from model import generate, parallel, providers, wrapping
from model.routing import Routes
from model.tiny import ensure_tiny_checkpoint
from trainer.grpo_batches import input_aligned_routes, label_aligned
from trainer.grpo_update import token_logprobs

NEW_TOKENS = 12


def parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def check(chunks: list, vocab: int, tp: int) -> dict:
    model, routes = chunks[0], Routes(chunks)
    tokens = torch.randint(3, vocab, (3, 10), generator=torch.Generator().manual_seed(1))
    prompts = [tokens[0, :6].tolist(), tokens[1, :10].tolist(), tokens[2, :3].tolist()]
    completions = generate.generate(chunks, prompts, max_new_tokens=NEW_TOKENS, end_ids=(), vocab_size=vocab, samples=2,
                                    temperature=1.0, seed=5, routes=routes)
    rows = [prompts[index // 2] + completion for index, completion in enumerate(completions)]
    examples = [batches.Example(row, [0] * len(prompts[index // 2]) + [1] * (len(row) - len(prompts[index // 2])))
                for index, row in enumerate(rows)]
    seq_len = batches.padded_length(examples, 64, tp)
    batch = batches.collate(examples, seq_len, 0)
    taken, routed = input_aligned_routes(completions.routes, seq_len)
    sampler = label_aligned([[0.0] * len(prompts[index // 2]) + logprobs
                             for index, logprobs in enumerate(completions.logprobs)], seq_len)

    # The router's own choice in a training forward, compared with the rollout's.
    routes.load(taken, routed, replay=False)
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
        trained = token_logprobs(logits, batch["labels"], 1.0)
    own_differ, own_compared = routes.take_mismatch()
    gap = ((trained - sampler).abs() * batch["loss_mask"]).max().item()

    # Replaying routes the router would not choose: every router's map must be exactly them.
    replayed = torch.stack([torch.randperm(routes.routers[0].config.num_moe_experts,
                                           generator=torch.Generator().manual_seed(index))[: routes.topk]
                            for index in range(taken[..., 0, 0].numel() * routes.layers)])
    replayed = replayed.view(*taken.shape).to(taken.dtype)
    maps = []
    hooks = [router.register_forward_hook(lambda module, args, output: maps.append(output[1])) for router in routes.routers]
    routes.load(replayed, routed, replay=True)
    with torch.no_grad():
        model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
    for hook in hooks:
        hook.remove()
    forced_differ, forced_compared = routes.take_mismatch()
    routes.clear()
    # The targets each router was given, in its order ([seq, batch] flattened, this rank's slice of the sequence).
    expected = replayed.transpose(0, 1)
    valid = routed.transpose(0, 1)
    if tp > 1:
        width = seq_len // tp
        rank = torch.distributed.get_rank() % tp
        expected, valid = expected[rank * width : (rank + 1) * width], valid[rank * width : (rank + 1) * width]
    expected, valid = expected.reshape(-1, routes.layers, routes.topk), valid.reshape(-1)
    exact = all(bool((routing_map[valid].nonzero()[:, 1].view(-1, routes.topk)
                      == expected[valid, layer].long().sort(dim=1).values).all())
                for layer, routing_map in enumerate(maps))
    return {"own_differ": own_differ, "own_compared": own_compared, "forced_differ": forced_differ,
            "forced_compared": forced_compared, "replay_exact": exact, "maps": len(maps), "layers": routes.layers,
            "valid_tokens": int(routed.sum()), "rank_valid_tokens": int(valid.sum()), "logprob_gap_max": gap,
            "recorded_shapes_ok": all(tuple(route.shape) == (len(row), routes.layers, routes.topk)
                                      for route, row in zip(completions.routes, rows))}


def continued(chunks: list, vocab: int, tp: int) -> dict:
    """Multi-turn: ids appended after a turn's end id (as a tool's message is) are routed when fed, and a training
    forward over the whole trajectory routes them, and every other fed id, as the rollout did."""
    routes = Routes(chunks)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    end_ids = tuple(range(3, vocab, 3))  # a third of the vocabulary ends a turn
    given = {}

    def continue_rows(requests):
        appended = []
        for row, completion, left in requests:
            if row in given or left <= 4:
                appended.append(None)
                continue
            given[row] = len(completion)
            appended.append([11, 12, 13])
        return appended

    completions = generate.generate(chunks, prompts, max_new_tokens=NEW_TOKENS, end_ids=end_ids, vocab_size=vocab,
                                    samples=2, temperature=1.0, seed=3, continue_rows=continue_rows, routes=routes)
    rows = [prompts[index // 2] + completion for index, completion in enumerate(completions)]
    examples = [batches.Example(row, [1] * len(row)) for row in rows]
    seq_len = batches.padded_length(examples, 64, tp)
    batch = batches.collate(examples, seq_len, 0)
    taken, routed = input_aligned_routes(completions.routes, seq_len)
    routes.load(taken, routed, replay=False)
    with torch.no_grad():
        chunks[0](input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
    differ, compared = routes.take_mismatch()
    routes.clear()
    return {"continued_rows": len(given), "differ": differ, "compared": compared}


def run(args) -> None:
    path = ensure_tiny_checkpoint(name="tiny-moe")
    bridge = providers.auto_bridge(path)
    vocab = bridge.hf_pretrained.config.vocab_size
    for tp in (2, 1):
        parallel.init_distributed(ParallelConfig(tp=tp), seed=0)
        provider = providers.configure_provider(bridge, dtype="fp32", tp=tp, pp=1, vpp=None, seq_length=64,
                                            transformer_overrides={"sequence_parallel": tp > 1})
        chunks = wrapping.build_chunks(provider)
        result = check(chunks, vocab, tp)
        result["multi_turn"] = continued(chunks, vocab, tp)
        if torch.distributed.get_rank() == 0:
            Path(args.out, f"tp{tp}.json").write_text(json.dumps(result))
    whole = staged_generation(chunks, vocab)  # PP=1: every layer's routes
    parallel.init_distributed(ParallelConfig(pp=2), seed=0)
    provider = providers.configure_provider(bridge, dtype="fp32", tp=1, pp=2, vpp=None, seq_length=64)
    staged = staged_generation(wrapping.build_chunks(provider), vocab)
    stage = torch.distributed.get_rank()  # PP=2 on 2 processes: rank r is stage r
    layers = staged["routes"][0].size(1)
    Path(args.out, f"pp2-rank{stage}.json").write_text(json.dumps({
        "same_completions": staged["completions"] == whole["completions"], "layers": layers,
        "same_routes": all(torch.equal(mine, every[:, stage * layers : (stage + 1) * layers])
                           for mine, every in zip(staged["routes"], whole["routes"]))}))


def staged_generation(chunks: list, vocab: int) -> dict:
    """Sampled completions with recorded routes: at PP=2 each stage records its own layers'."""
    tokens = torch.randint(3, vocab, (3, 10), generator=torch.Generator().manual_seed(2))
    prompts = [tokens[0, :6].tolist(), tokens[1, :10].tolist(), tokens[2, :3].tolist()]
    completions = generate.generate(chunks, prompts, max_new_tokens=NEW_TOKENS, end_ids=(), vocab_size=vocab,
                                    samples=2, temperature=1.0, seed=5, routes=Routes(chunks))
    return {"completions": list(completions), "routes": completions.routes}
