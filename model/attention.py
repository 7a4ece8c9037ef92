"""Core attention through `torch.nn.functional.scaled_dot_product_attention`, for GPUs without Transformer Engine.

megatron-core's local `DotProductAttention` materialises the [batch, heads, query, key] score matrix
(twice: scores, then probabilities kept for backward). SDPA picks a fused kernel instead (FlashAttention
for plain causal attention, the memory-efficient kernel when a mask is given) and computes the same
softmax(Q K^T * scale + mask) V. `SDPACoreAttention` takes the local class's constructor arguments and
forward signature, so `sdpa_layer_spec` is megatron-core's local spec with only `core_attention` replaced.

Both specs without Transformer Engine (`sdpa` and `local`) also use `RotateOnceSelfAttention`, whose KV cache
holds keys after the rotary embedding, so generation rotates each key once (see its docstring).
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import get_sliding_window_causal_mask, is_layer_window_attention
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron-core's local `DotProductAttention` (same arguments), computed by SDPA.

    Masks follow megatron's convention: a boolean `attention_mask` broadcastable to [batch, 1, query, key]
    with True where attention is blocked (the SFT packing collator's block-diagonal mask is one). With no
    mask and a causal mask type, attention is causal (`is_causal`, so FlashAttention can run). Every query
    must see at least one key: a fully blocked row has no softmax (local attention gives it a uniform one).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: ProcessGroupCollection | None = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPA core attention does not support context parallelism; use Transformer Engine.")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPA core attention has no `{config.softmax_type}` softmax; use `model.attention=local`.")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp
        tp_size = self.tp_group.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # Local attention divides the scale by the layer number for apply_query_key_layer_scaling and its
        # softmax multiplies it back in fp32; the product is this scale, which SDPA applies in one go.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        use_window = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.window_size = config.window_size if use_window else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        """softmax(Q K^T * scale + mask) V: query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise ValueError("SDPA core attention takes packed sequences as a block-diagonal attention_mask, "
                             "not as PackedSeqParams (THD layout); the latter needs Transformer Engine.")
        if attention_bias is not None:
            raise ValueError("SDPA core attention does not take an attention bias.")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        query_len, batch, key_len = query.size(0), query.size(1), key.size(0)
        # [s, b, heads, hn] -> [b, heads, s, hn]: the layout SDPA reads.
        query, key, value = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        allowed, is_causal = None, False  # SDPA's boolean mask means the opposite of megatron's: True = may attend
        if self.window_size is not None:
            # Causal within the window, aligned bottom-right (a KV cache). A given mask (left pads while generating,
            # packed rows) still applies: megatron's local softmax drops it, which lets a windowed model attend to pads.
            blocked = get_sliding_window_causal_mask(query_len, key_len, self.window_size).to(query.device)
            allowed = ~(blocked if attention_mask is None else blocked | attention_mask)
        elif attention_mask is not None:
            allowed = _allowed(attention_mask)
        elif mask_type == AttnMaskType.causal and query_len == key_len:
            is_causal = True
        elif mask_type == AttnMaskType.causal and query_len > 1:
            # Queries are the last `query_len` positions of the keys (a KV cache): causal from the bottom right.
            allowed = torch.ones(query_len, key_len, dtype=torch.bool, device=query.device).tril(key_len - query_len)
        # One query against a KV cache sees every cached key: no mask.
        dropout_p = self.dropout_p if self.training else 0.0
        # Dropout in a tensor-parallel region draws from the model-parallel RNG stream, as local attention does.
        forks_rng = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forks_rng else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                query, key, value, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=self.heads_per_partition != self.query_groups_per_partition)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(query_len, batch, -1)


def _allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """SDPA's mask (True = may attend) for megatron's `attention_mask` (True = blocked), inverted once per mask: every
    layer of a forward is given the same mask tensor, so the first layer keeps the inverse on it for the others (one
    operator per forward rather than one per layer, each decode step)."""
    allowed = getattr(attention_mask, "sdpa_allowed", None)
    if allowed is None:
        allowed = attention_mask.sdpa_allowed = ~attention_mask
    return allowed


class RotateOnceSelfAttention(SelfAttention):
    """megatron-core's `SelfAttention` whose static KV cache holds keys after the rotary embedding.

    megatron-core caches keys before the rotation and rotates the whole cached prefix again, in every layer,
    at every decode step. Here each new key is rotated once, as it is written to the cache, and so is the query,
    as `transformers` does: with megatron-core's unfused rotation, both here from `RotaryTables` (the caller then
    rotates nothing, its embeddings come back as None); with its fused or interleaved ones, the key here with
    megatron-core's function and the query by the caller. The numbers are the same: a key's rotation depends only
    on its own position. The cache keeps megatron's
    shape ([max_seq, max_batch, groups, head dim] per layer in `key_value_memory_dict`), so `model.generate`
    can copy prompts' rows to several samples and drop finished rows. A forward without a cache (training, the
    log-prob forwards) rotates its query and key here too, from the tables its layers share, the same numbers and
    gradients bit for bit. With a dynamic context, flash decoding, no rotary embedding, or megatron-core's fused or
    interleaved rotation without a cache, megatron-core's own path runs unchanged.
    """

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, rotary_pos_cos=None,
                                        rotary_pos_sin=None, rotary_pos_cos_sin=None, sequence_len_offset=None, *,
                                        inference_params=None):
        context = inference_context if inference_context is not None else inference_params
        if context is None and rotary_pos_emb is not None and self._rotates_unfused():
            # A forward without a KV cache (training, log-probs): query and key rotated here too, from tables every layer
            # of the forward shares (megatron-core computes cos/sin in each layer, for the query and for the key).
            # Packed sequences (THD, rotated by their own offsets) never reach here: both core attentions these specs
            # use refuse `packed_seq_params`.
            query_embedding, key_embedding = rotary_pos_emb  # each [sequence, batch or 1, 1, rotary dim]
            if query_embedding is key_embedding:
                tables = RotaryTables.of_forward(key_embedding, self._yarn_concentration_factor, key.dtype)
                return tables.rotate(query), tables.rotate(key), value, None, self.attn_mask_type, None
        if (context is None or not context.is_static_batching() or rotary_pos_emb is None or self.config.flash_decode
                or context.batch_size_offset != 0):
            return super()._adjust_key_value_for_inference(
                context, query, key, value, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                sequence_len_offset)
        query_embedding, key_embedding = rotary_pos_emb  # each [max_seq, 1, 1, rotary dim]
        start, end, batch = context.sequence_len_offset, context.sequence_len_offset + key.size(0), key.size(1)
        # key/value: [new tokens, batch, groups, head dim]
        if self._rotates_unfused():
            # Query and key rotated here, from cos/sin tables the layers of a forward share (`RotaryTables`).
            tables = RotaryTables.of(context, key_embedding, start, end, self._yarn_concentration_factor, key.dtype)
            query, key, query_embedding = tables.rotate(query), tables.rotate(key), None
        else:
            key = apply_rotary_pos_emb(key, key_embedding[start:end], config=self.config,
                                       mscale=self._yarn_concentration_factor, cp_group=self.pg_collection.cp)
            query_embedding = query_embedding[start:end]
        if self.layer_number not in context.key_value_memory_dict:
            # megatron's [max_seq, max_batch, groups, head dim] shape over batch-major memory, so that each row's keys
            # are near each other for the attention kernel.
            context.key_value_memory_dict[self.layer_number] = tuple(
                tensor.new_empty(context.max_batch_size, context.max_sequence_length, *tensor.shape[2:]).transpose(0, 1)
                for tensor in (key, value))
        keys, values = context.key_value_memory_dict[self.layer_number]
        if batch != keys.size(1):  # the cache holds exactly the batch's rows (`model.generate` compacts it)
            keys, values = keys[:, :batch], values[:, :batch]
        keys[start:end] = key
        values[start:end] = value
        # Past the prefill a query attends to every cached key, as in megatron-core (a given mask still applies).
        mask_type = AttnMaskType.no_mask if start > 0 else self.attn_mask_type
        # No query embedding: the caller skips the rotation it would apply (the query is rotated already).
        embeddings = None if query_embedding is None else (query_embedding, None)
        return query, keys[:end], values[:end], embeddings, mask_type, None

    def _rotates_unfused(self) -> bool:
        """Whether megatron-core would rotate with its unfused half-split formula, which `RotaryTables` reproduces."""
        config = self.config
        return not (config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention)


class RotaryTables:
    """The cos and sin factors of one forward's positions, computed once for all of its layers (megatron-core computes
    them in every layer, twice: for the query and for the key).

    Each layer's rotation is then the unfused formula of megatron-core's `_apply_rotary_pos_emb_bshd`,
    `t * cos + rotate_half(t) * sin` with rotate_half(t) = [-t2, t1], reordered to [t2, t1] * [-sin1, sin2]: negating
    a factor instead of the other one changes no bit of a product, so the results are bit-identical, in three
    element-wise operators and a `roll` where megatron-core launches about fifteen (and their backward, bit-identical
    too, in a few where megatron-core's takes about ten). The tables are kept on the inference context (one
    generation) for the last span of positions, or, in a forward without a KV cache, on its rotary embedding tensor.
    """

    def __init__(self, freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
        # freqs: [new tokens, batch or 1, 1, rotary dim], the slice megatron-core rotates with
        self.rotary_dim, self.half = freqs.size(-1), freqs.size(-1) // 2
        self.cos = (torch.cos(freqs) * mscale).to(dtype)
        sin = (torch.sin(freqs) * mscale).to(dtype)
        self.sin = torch.cat((-sin[..., : self.half], sin[..., self.half :]), dim=-1)  # rotate_half's sign folded in

    @classmethod
    def of(cls, context, embedding: torch.Tensor, start: int, end: int, mscale: float, dtype) -> "RotaryTables":
        """The context's tables for these positions, built by the first layer that asks."""
        cached = getattr(context, "rotary_tables", None)  # (embedding, span, tables)
        if cached is None or cached[0] is not embedding or cached[1] != (start, end, mscale, dtype):
            cached = context.rotary_tables = (embedding, (start, end, mscale, dtype), cls(embedding[start:end], mscale, dtype))
        return cached[2]

    @classmethod
    def of_forward(cls, embedding: torch.Tensor, mscale: float, dtype) -> "RotaryTables":
        """The tables of a forward without a KV cache, kept on its rotary embedding (`embedding`, [sequence, batch or 1,
        1, rotary dim]: every layer of a forward is handed the same tensor, and megatron-core's rotary module returns
        the same one again for a sequence length it has seen). Nothing here refers back to the tensor."""
        cached = getattr(embedding, "rotary_tables", None)  # ((mscale, dtype), tables)
        if cached is None or cached[0] != (mscale, dtype):
            cached = embedding.rotary_tables = ((mscale, dtype), cls(embedding, mscale, dtype))
        return cached[1]

    def rotate(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` ([new tokens, batch, heads, head dim]) with its first `rotary dim` channels rotated."""
        if self.rotary_dim == tensor.size(-1):
            return tensor * self.cos + torch.roll(tensor, self.half, dims=-1) * self.sin
        rotated, passed = tensor[..., : self.rotary_dim], tensor[..., self.rotary_dim :]
        rotated = rotated * self.cos + torch.roll(rotated, self.half, dims=-1) * self.sin
        return torch.cat((rotated, passed), dim=-1)


def _rotate_once(spec):
    """The layer spec with `RotateOnceSelfAttention` in place of megatron-core's `SelfAttention`."""
    if spec.submodules.self_attention.module is SelfAttention:
        spec.submodules.self_attention.module = RotateOnceSelfAttention
    return spec


def sdpa_layer_spec(config):
    """megatron-core's local GPT layer spec (as Megatron-Bridge builds it) with SDPA as the core attention."""
    from megatron.bridge.models import gpt_provider

    spec = _rotate_once(gpt_provider.local_layer_spec(config))
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def local_layer_spec(config):
    """megatron-core's local GPT layer spec (its own core attention), with keys cached after the rotation."""
    from megatron.bridge.models import gpt_provider

    return _rotate_once(gpt_provider.local_layer_spec(config))
