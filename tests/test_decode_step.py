"""What a decode step of our generation launches, and that its shortcuts compute exactly what the plain code did.

A small model's decode step on a GPU is bound by the host launching operators (docs/gpus.md), so `model.generate`,
`model.attention` and `sample_next` take shortcuts: rotary cos/sin computed once per forward (`RotaryTables`), the
attention mask inverted once per forward, a decode step's mask sliced from one built per batch, the per-row
bookkeeping skipped while no row is given a token or has ended, no division by a temperature of 1, top-p's softmax
computed once. Each must change no bit: here against megatron-core's own rotation, against the sampler as it was
written before, and end to end (in a fresh process, as a group of one) against megatron-core's rotation path.
"""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def reference_sample_next(logits, temperature, top_p, top_k, generator, logprobs=True):
    """`sample_next` as it was written before the decode step was trimmed (each operator spelled out)."""
    if temperature <= 0:
        ids = logits.argmax(dim=-1)
        if not logprobs:
            return ids, torch.zeros(ids.shape, dtype=torch.float32)
        return ids, logits.float().log_softmax(dim=-1).gather(1, ids[:, None]).squeeze(1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probabilities = logits.softmax(dim=-1)
    ids = torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)
    if not logprobs:
        return ids, torch.zeros(ids.shape, dtype=torch.float32)
    return ids, logits.log_softmax(dim=-1).gather(1, ids[:, None]).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_draws_and_scores_bit_for_bit_as_the_plain_one(dtype):
    from model.sampling import sample_next

    logits = (torch.randn(16, 300, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    for temperature, top_p, top_k in [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.9, 0), (1.0, 1.0, 20),
                                      (0.8, 0.7, 50)]:
        for logprobs in (True, False):
            ours = sample_next(logits, temperature, top_p, top_k, torch.Generator().manual_seed(3), logprobs)
            plain = reference_sample_next(logits, temperature, top_p, top_k, torch.Generator().manual_seed(3), logprobs)
            assert torch.equal(ours[0], plain[0]) and torch.equal(ours[1], plain[1]), (temperature, top_p, top_k)
            assert ours[1].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("mscale", [1.0, 0.8])
def test_rotary_tables_rotate_bit_for_bit_as_megatron_core(dtype, rotary_dim, mscale):
    """Against megatron-core's unfused `apply_rotary_pos_emb` (what the attention applied before), for a prefill's
    span and a decode step's, with partial rotation (rotary dim below the head dim) too."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from model.attention import RotaryTables

    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    generator = torch.Generator().manual_seed(1)
    inverse = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.outer(torch.arange(64).float(), inverse)
    embedding = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # [max_seq, 1, 1, rotary dim], as megatron's
    for start, end in [(0, 11), (11, 12), (40, 41)]:
        tensor = torch.randn(end - start, 5, 3, 32, generator=generator).to(dtype)  # [new tokens, batch, heads, 32]
        context = types.SimpleNamespace()
        tables = RotaryTables.of(context, embedding, start, end, mscale, dtype)
        assert RotaryTables.of(context, embedding, start, end, mscale, dtype) is tables  # one per forward
        expected = apply_rotary_pos_emb(tensor, embedding[start:end], config=config, mscale=mscale, cp_group=object())
        assert torch.equal(tables.rotate(tensor), expected), (start, end)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("per_token", [False, True])
def test_a_training_forward_rotates_and_backpropagates_bit_for_bit_as_megatron_core(dtype, rotary_dim, per_token):
    """A forward without a KV cache (training, log-probs) rotates from one set of tables per forward
    (`RotaryTables.of_forward`): the rotated query and key and the gradient reaching the QKV projection's output are
    megatron-core's unfused `apply_rotary_pos_emb`'s bit for bit, for a query reshaped out of the fused QKV tensor and a
    key that is a strided view of it, with the rotation per sequence index ([sequence, 1, 1, dim]) or per token
    ([sequence, batch, 1, dim], GRPO's shared prompts)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from model.attention import RotaryTables

    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    generator = torch.Generator().manual_seed(2)
    sequence, batch, mscale = 13, 3, 0.9
    inverse = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    positions = (torch.randint(0, 40, (sequence, batch), generator=generator) if per_token
                 else torch.arange(sequence)[:, None])  # [sequence, batch or 1]
    angles = positions[..., None].float() * inverse
    embedding = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [sequence, batch or 1, 1, rotary dim]
    mixed = torch.randn(sequence, batch, 2, 4 * 32, generator=generator).to(dtype)  # 2 groups of 2 query heads, k, v
    upstream = torch.randn(sequence, batch, 6, 32, generator=generator).to(dtype)

    def rotated_and_gradient(rotate):
        qkv = mixed.clone().requires_grad_()
        query, key, _ = torch.split(qkv, [64, 32, 32], dim=3)
        query = query.reshape(sequence, batch, 4, 32)
        out = torch.cat((rotate(query), rotate(key)), dim=2)  # [sequence, batch, 6, 32]
        (out.float() * upstream.float()).sum().backward()
        return out.detach(), qkv.grad

    tables = RotaryTables.of_forward(embedding, mscale, dtype)
    assert RotaryTables.of_forward(embedding, mscale, dtype) is tables  # one per forward, for all of its layers
    ours = rotated_and_gradient(tables.rotate)
    theirs = rotated_and_gradient(lambda tensor: apply_rotary_pos_emb(tensor, embedding, config=config, mscale=mscale,
                                                                      cp_group=object()))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_the_inverted_attention_mask_is_computed_once_per_mask():
    from model.attention import _allowed

    mask = torch.rand(4, 1, 1, 9, generator=torch.Generator().manual_seed(0)) > 0.5
    allowed = _allowed(mask)
    assert torch.equal(allowed, ~mask) and _allowed(mask) is allowed
    assert _allowed(mask[..., :5]) is not allowed  # a new mask (the next step's slice) is inverted anew


# Measured 2026-12-06 (this file's worker: 2 prompts of 3 and 6 ids x 8 samples, the tiny model's 4 layers): 236 outermost
# aten calls a decode step at temperature 1 with log-probs (356 before the trim: megatron-core's rotation computed
# cos/sin for the query and the key of every layer); the bound leaves room for a library update's small changes.
OPERATORS_PER_DECODE_STEP = 260

WORKER = """
import json, statistics, sys
sys.path.insert(0, {repo!r})
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from config.loops import SFTConfig
from config.sections import DataConfig, ModelConfig
from model import attention, build, generate, parallel

config = SFTConfig(model=ModelConfig(path="tiny", dtype="fp32"), data=DataConfig(max_seq_len=64))
runtime = parallel.init_distributed(config.parallel, seed=0)
path = build.resolve_model_path(config)
policy = build.build_policy(config, path, build.load_tokenizer(path), trainable=False)
model = policy.chunks[0]
prompts = [[5, 9, 14], [7, 3, 22, 40, 41, 8]]

def run(**kwargs):
    out = generate.generate(policy.chunks, prompts, max_new_tokens=10, end_ids=(), vocab_size=policy.vocab_size,
                            samples=8, **kwargs)
    return [list(row) for row in out], out.logprobs

# Operators per decode step: a forward pre-hook opens a profiler range per step (forward, sampling, bookkeeping).
ranges = []
def mark(*_):
    if ranges:
        ranges[-1].__exit__(None, None, None)
    ranges.append(record_function("step"))
    ranges[-1].__enter__()
handle = model.register_forward_pre_hook(mark)
with profile(activities=[ProfilerActivity.CPU]) as profiler:
    run(temperature=1.0, seed=0)
    ranges[-1].__exit__(None, None, None)
handle.remove()
events = profiler.events()
steps = sorted((e for e in events if e.name == "step"), key=lambda e: e.time_range.start)[1:-1]
def outermost(event):
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith("aten::"):
        parent = parent.cpu_parent
    return parent is None
counts = {{}}
for index, step in enumerate(steps):
    for event in events:
        if (event.name.startswith("aten::") and step.time_range.start <= event.time_range.start <= step.time_range.end
                and outermost(event)):
            key = (index, event.name)
            counts[key] = counts.get(key, 0) + 1
per_step = [sum(count for (index, _), count in counts.items() if index == step) for step in range(len(steps))]
per_name = lambda name: max(counts.get((step, name), 0) for step in range(len(steps)))

# End to end against megatron-core's own rotation (the attention's path before RotaryTables), greedy and sampled.
results = {{}}
for label, kwargs in [("greedy", {{}}), ("sampled", dict(temperature=1.0, top_p=0.9, top_k=20, seed=3))]:
    fast = run(**kwargs)
    unfused = attention.RotateOnceSelfAttention._rotates_unfused
    attention.RotateOnceSelfAttention._rotates_unfused = lambda self: False
    plain = run(**kwargs)
    attention.RotateOnceSelfAttention._rotates_unfused = unfused
    results[label] = fast == plain

# A training forward and backward (no KV cache) rotates from shared tables too: the same loss and gradients, bit for bit.
def trained():
    model.eval()  # no dropout draw: both passes compute the same function
    model.zero_grad()
    tokens = torch.tensor([prompts[1] * 3, prompts[0] * 6])  # [2, 18]
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    causal = torch.ones(18, 18, dtype=torch.bool).triu(1)[None, None]  # megatron's convention: True = blocked
    loss = model(input_ids=tokens, position_ids=positions, attention_mask=causal, labels=tokens).sum()
    loss.backward()
    return [loss.detach()] + [param.grad.clone() for param in model.parameters()]
for param in model.parameters():
    param.requires_grad_(True)
fast = trained()
unfused = attention.RotateOnceSelfAttention._rotates_unfused
attention.RotateOnceSelfAttention._rotates_unfused = lambda self: False
plain = trained()
attention.RotateOnceSelfAttention._rotates_unfused = unfused
results["training"] = all(torch.equal(a, b) for a, b in zip(fast, plain)) and len(fast) > 10
print(json.dumps({{"per_step": per_step, "cos": per_name("aten::cos"), "bitwise_not": per_name("aten::bitwise_not"),
                  "equal": results}}))
parallel.shutdown(runtime)
"""


@pytest.mark.slow
def test_a_decode_step_launches_few_operators_and_the_shortcuts_change_no_bit():
    """One process as a group of one (no torchrun): the outermost aten operators of each decode step stay under the
    measured bound, cos/sin are computed once a step (not per layer), the mask inverted once; and generation equals,
    bit for bit, the same generation through megatron-core's rotation, as a training forward's loss and gradients do."""
    done = subprocess.run([sys.executable, "-c", WORKER.format(repo=str(REPO))], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TORCH_COMPILE_DISABLE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(result["per_step"]) <= OPERATORS_PER_DECODE_STEP, result["per_step"]
    assert result["cos"] == 1 and result["bitwise_not"] == 1, result
    assert result["equal"] == {"greedy": True, "sampled": True, "training": True}, result


FSDP_WORKER = """
import contextlib, json, sys
sys.path.insert(0, {repo!r})
from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import AllGatherPipeline, BucketStatus
from config.loops import SFTConfig
from config.sections import DataConfig, ModelConfig, ParallelConfig
from model import build, generate, parallel
from model.sampling import Sampling

config = SFTConfig(model=ModelConfig(path="tiny", dtype="fp32"), data=DataConfig(max_seq_len=64),
                   parallel=ParallelConfig(use_megatron_fsdp=True))
runtime = parallel.init_distributed(config.parallel, seed=0)
path = build.resolve_model_path(config)
policy = build.build_policy(config, path, build.load_tokenizer(path))
pipeline = policy.chunks[0].module.all_gather_pipeline
gathers = []
gather = AllGatherPipeline.async_bucket_gather
def counted(self, bucket_id, bwd):
    if self.bucket_status[self.get_bucket_key(bucket_id, bwd)] in (BucketStatus.EMPTY, BucketStatus.PRESERVED):
        gathers.append(bucket_id)
    return gather(self, bucket_id, bwd)
AllGatherPipeline.async_bucket_gather = counted

def run():
    gathers.clear()
    out = policy.engine.generate([[5, 9, 14], [7, 3, 22, 40, 41, 8]], max_new_tokens=12, samples=2,
                                 sampling=Sampling(temperature=1.0, seed=0))
    ready = sum(status == BucketStatus.READY_TO_USE for status in pipeline.bucket_status.values())
    return {{"ids": [list(row) for row in out], "logprobs": out.logprobs, "gathers": len(gathers), "ready_after": ready,
             "tokens": max(len(row) for row in out)}}

once = run()
generate.parameters_gathered_once = lambda *args: contextlib.nullcontext()  # what every forward did before
per_token = run()
from model import wrapping
print(json.dumps({{"once": once, "per_token": per_token, "buckets": pipeline.num_buckets,
                  "unsharded_bytes": wrapping.unsharded_bytes(pipeline),
                  "parameter_bytes": sum(param.numel() * param.element_size() for param in policy.chunks[0].parameters())}}))
parallel.shutdown(runtime)
"""


@pytest.mark.slow
def test_generation_under_megatron_fsdp_gathers_the_parameters_once_a_call():
    """Megatron-FSDP (one process as a group of one): a generation call gathers each parameter bucket once, not once
    a token as each forward's own gather-and-free did, samples exactly what that did, and releases what it gathered."""
    done = subprocess.run([sys.executable, "-c", FSDP_WORKER.format(repo=str(REPO))], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TORCH_COMPILE_DISABLE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    once, per_token = result["once"], result["per_token"]
    print({key: (once[key], per_token[key]) for key in ("gathers", "ready_after", "tokens")}, "buckets", result["buckets"])
    assert once["ids"] == per_token["ids"] and once["logprobs"] == per_token["logprobs"]
    assert once["tokens"] == 12  # the untrained model ends no row early: 12 forwards
    assert 0 < once["gathers"] <= result["buckets"]
    # Once a token: every forward gathered each layer's bucket again (measured 49 gathers against 5: 12 forwards x 4
    # layers' buckets, and the embedding's, which Megatron-FSDP keeps as no layer's unit).
    assert per_token["gathers"] >= 8 * once["gathers"]
    # After the call no more buckets stay gathered than the per-token way leaves (measured 1 against 2: the embedding's,
    # and there also the first layer's, prefetched by the last forward for a next one).
    assert once["ready_after"] <= per_token["ready_after"]
    # What a GPU must hold free, twice over, for the parameters to stay gathered: the model's parameters, bucketed.
    assert result["parameter_bytes"] <= result["unsharded_bytes"] <= 1.1 * result["parameter_bytes"], result


class _FakeFSDPPipeline:
    """What `parameters_gathered_once` reads of a Megatron-FSDP chunk's gather pipeline: one bucket of 1 MB."""

    def __init__(self):
        buffer = types.SimpleNamespace(bucket_index=types.SimpleNamespace(size=2**18), dtype=torch.float32)
        self.buffer = types.SimpleNamespace(parameter_groups=[types.SimpleNamespace(model_weight_buffer=buffer)])

    def release_bucket(self, bucket_id, bwd, lazy=False):
        pass


def _hold_on_a_gpu_rank(rank: int, port: int, results) -> None:
    """One of two ranks of a Megatron-FSDP model at DP=1 (tp=2, etp=1: each rank its own data-parallel group, the two
    its experts' data-parallel group), on a simulated GPU with room to hold the parameters on rank 0 only."""
    import datetime

    from model import wrapping

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=20))
    torch.cuda.is_available = lambda: True
    torch.cuda.mem_get_info = lambda: ((2**30 if rank == 0 else 2**20), 2**31)  # free, total
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the agreement's tensor stays where gloo takes it
    pipeline = _FakeFSDPPipeline()
    chunk = types.SimpleNamespace(ddp_config=types.SimpleNamespace(use_megatron_fsdp=True),
                                  module=types.SimpleNamespace(all_gather_pipeline=pipeline))
    try:
        with wrapping.parameters_gathered_once([chunk]):
            results[rank] = "release_bucket" in vars(pipeline)  # whether this rank holds what its forwards gather
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_every_rank_sharing_a_gather_chooses_alike_to_hold_the_gathered_parameters():
    """Where one rank would hold the gathered parameters and another not (free GPU memory differs), the choice is agreed
    over every rank: agreed over the data-parallel group only, ranks of different data-parallel groups that gather
    experts together (tp=2, etp=1) chose apart, and one skipped the expert gathers the other ran (a hang on GPUs)."""
    import torch.multiprocessing as multiprocessing

    from model.parallel import free_port

    with multiprocessing.Manager() as manager:
        results = manager.dict()
        multiprocessing.start_processes(_hold_on_a_gpu_rank, args=(free_port(), results), nprocs=2,
                                        start_method="spawn", join=True)
        assert dict(results) == {0: False, 1: False}
