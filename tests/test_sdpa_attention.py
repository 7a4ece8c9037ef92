"""SDPA core attention: the module against hand-computed and reference numbers, then the SDPA layer spec against
megatron-core's local spec in the real model under torchrun (TP=2 and TP=1, forward and backward, packing)."""

import json
import types

import pytest
import torch

from tests.conftest import worker_output
TOLERANCE = 1e-5  # fp32


class _OneRankGroup:
    """Stands in for the tensor-parallel process group of a single process."""

    def size(self) -> int:
        return 1


def core_attention(heads: int = 4, groups: int = 2, head_dim: int = 8, mask_type: str = "causal", **config):
    """An SDPACoreAttention built from a real megatron-core TransformerConfig, outside any process group."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model.attention import SDPACoreAttention

    transformer_config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                                           num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0, **config)
    return SDPACoreAttention(transformer_config, layer_number=1, attn_mask_type=getattr(AttnMaskType, mask_type),
                             attention_type="self", pg_collection=types.SimpleNamespace(tp=_OneRankGroup()))


def reference(query, key, value, blocked: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(hn), blocked -> -inf) V written out; query head i reads key/value group i // (np / ng)."""
    # query [sq, b, np, hn], key/value [sk, b, ng, hn], blocked [b or 1, 1, sq, sk]
    repeats = query.size(2) // key.size(2)
    key, value = key.repeat_interleave(repeats, dim=2), value.repeat_interleave(repeats, dim=2)
    scores = torch.einsum("qbnh,kbnh->bnqk", query, key) / query.size(-1) ** 0.5  # [b, np, sq, sk]
    probabilities = scores.masked_fill(blocked, float("-inf")).softmax(dim=-1)
    return torch.einsum("bnqk,kbnh->qbnh", probabilities, value).flatten(2)  # [sq, b, np * hn]


def random_qkv(query_len: int, key_len: int, batch: int = 2, heads: int = 4, groups: int = 2, head_dim: int = 8):
    """Seeded query [sq, b, np, hn], key and value [sk, b, ng, hn]."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(query_len, batch, heads, head_dim, generator=generator),
            torch.randn(key_len, batch, groups, head_dim, generator=generator),
            torch.randn(key_len, batch, groups, head_dim, generator=generator))


def causal_blocked(query_len: int, key_len: int) -> torch.Tensor:
    """Megatron's convention (True = blocked) for queries that are the last `query_len` of `key_len` positions."""
    return ~torch.ones(query_len, key_len, dtype=torch.bool).tril(key_len - query_len)[None, None]


def test_uniform_attention_gives_hand_computed_means():
    """Zero queries attend uniformly, so each output is the mean of the values it may see."""
    attention = core_attention(heads=1, groups=1, head_dim=1)
    query = torch.zeros(4, 1, 1, 1)
    value = torch.tensor([1.0, 2.0, 4.0, 8.0]).view(4, 1, 1, 1)
    causal = attention(query, torch.zeros_like(value), value, None)
    assert causal.flatten().tolist() == pytest.approx([1.0, 1.5, 7 / 3, 15 / 4], abs=1e-6)
    # Two packed samples (positions 0-1 and 2-3) in megatron's mask convention: True = blocked.
    segment = torch.tensor([0, 0, 1, 1])
    blocked = ~((segment[:, None] == segment[None, :]) & torch.ones(4, 4, dtype=torch.bool).tril())[None, None]
    packed = attention(query, torch.zeros_like(value), value, blocked)
    assert packed.flatten().tolist() == pytest.approx([1.0, 1.5, 4.0, 6.0], abs=1e-6)


def test_grouped_query_causal_attention_matches_reference():
    query, key, value = random_qkv(12, 12)
    output = core_attention()(query, key, value, None)
    assert output.shape == (12, 2, 32)
    assert (output - reference(query, key, value, causal_blocked(12, 12))).abs().max().item() < 1e-6


def test_explicit_mask_matches_reference_and_is_not_ignored():
    query, key, value = random_qkv(10, 10)
    generator = torch.Generator().manual_seed(1)
    blocked = torch.rand(2, 1, 10, 10, generator=generator) < 0.5
    blocked[..., 0] = False  # every query sees at least one key
    attention = core_attention()
    output = attention(query, key, value, blocked)
    assert (output - reference(query, key, value, blocked)).abs().max().item() < 1e-6
    assert (output - attention(query, key, value, None)).abs().max().item() > 0.1


@pytest.mark.parametrize("query_len", [1, 3])
def test_queries_after_a_kv_cache_are_causal_from_the_bottom_right(query_len):
    """Decoding (one query) and chunked prefill (several) against 8 cached keys equal the last rows of full attention."""
    query, key, value = random_qkv(8, 8)
    full = reference(query, key, value, causal_blocked(8, 8))
    output = core_attention()(query[-query_len:], key, value, None)
    assert (output - full[-query_len:]).abs().max().item() < 1e-6


def test_no_mask_type_attends_everywhere():
    query, key, value = random_qkv(6, 6)
    output = core_attention(mask_type="no_mask")(query, key, value, None)
    assert (output - reference(query, key, value, torch.zeros(1, 1, 6, 6, dtype=torch.bool))).abs().max().item() < 1e-6


def test_refuses_what_it_cannot_compute():
    query, key, value = random_qkv(4, 4)
    with pytest.raises(ValueError, match="PackedSeqParams"):
        core_attention()(query, key, value, None, packed_seq_params=object())
    with pytest.raises(ValueError, match="model.attention=local"):
        core_attention(softmax_type="off-by-one")


def shared_worker(out) -> list[str]:
    """TP=2, then TP=1, in the 2-process shared launch (conftest's `shared_launch`)."""
    return ["tests/distributed/sdpa_worker.py", "--tp", "2,1", "--out", str(out)]


@pytest.mark.distributed
def test_sdpa_spec_equals_local_spec_at_tp2_and_tp1(shared_launch):
    """The 2-process shared launch measures TP=2, then TP=1 (data-parallel pair); every rank must agree with the local
    spec."""
    ranks = [json.loads(path.read_text()) for path in sorted(worker_output(shared_launch[__name__]).glob("tp*-rank*.json"))]
    assert sorted((rank["tp"]) for rank in ranks) == [1, 1, 2, 2]
    for rank in ranks:
        assert rank["core_attention"] == {"local": "DotProductAttention", "sdpa": "SDPACoreAttention"}
        # Forward: the same logits, plain causal batch and packed row (logits are of order 1).
        assert rank["logit_scale"] > 0.5
        assert rank["max_abs_logit_diff"] < TOLERANCE
        assert rank["max_abs_packed_logit_diff"] < TOLERANCE
        # Backward: every parameter's gradient (gradients of order 0.1-1).
        assert rank["grad_names_equal"] and rank["grads_compared"] == 30
        assert rank["grad_scale"] > 0.1
        assert rank["max_abs_grad_diff"] < TOLERANCE
        # Packing: each sample equals itself run alone; without the mask the second sample sees the first.
        assert max(rank["packed_vs_separate_max_abs_diff"]) < TOLERANCE
        assert rank["packed_without_mask_max_abs_diff"][0] < TOLERANCE  # the first sample has nothing before it
        assert rank["packed_without_mask_max_abs_diff"][1] > 0.1
        # KV-cache generation, dropout only in training, interchangeable checkpoints.
        assert rank["greedy_equal"] and rank["greedy_tokens"] == 24
        assert rank["masks_pads"] == {"sdpa": True, "local": True}
        assert rank["windowed_masks_pads"] == {"sdpa": True, "local": False}  # local drops the pad mask in a window
        assert rank["windowed_batched_equals_alone"] == {"sdpa": True, "local": True}
        assert rank["batched_equals_alone"] == {"sdpa": True, "local": True}
        assert rank["unpadded_equals_padded"] == {"sdpa": True, "local": True}
        assert rank["dropout_train_calls_differ"] > 0.1
        assert rank["dropout_eval_vs_no_dropout"] == 0.0
        assert rank["checkpoint_keys_equal"] and rank["checkpoint_keys"] > 0
    print("SDPA vs local (max abs diff, fp32): " + "; ".join(
        f"TP={rank['tp']} logits {rank['max_abs_logit_diff']:.2g} packed {rank['max_abs_packed_logit_diff']:.2g} "
        f"grads {rank['max_abs_grad_diff']:.2g} packed-vs-separate {max(rank['packed_vs_separate_max_abs_diff']):.2g}"
        for rank in ranks))
