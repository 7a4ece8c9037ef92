"""A GRPO group's prompt computed once (`grpo.share_prompts`): where it applies, and rotary positions per token.

The `grpo.n_samples` completions of one prompt start with the same tokens. Laid out as one row (the prompt once, then
each completion, `data.batches.collate_shared`), with each completion attending to the prompt and to itself and each
token at the position it has in its own row, every token has the same context and position as alone, so the same hidden
state, log-prob and gradient (up to the order of float sums); the prompt's forward and backward run once per group
instead of `n_samples` times, in the update and in pi_old's and the reference's forwards.

megatron-core's `GPTModel` rotates by a token's index in its row (it hands `position_ids` to learned position
embeddings only): `rotary_positions` makes its rotary embedding give each token the rotation of its position id.
"""

import contextlib

from model.providers import layer_spec_name


def reason_not_shared(config, provider) -> str | None:
    """Why this run's GRPO groups cannot be laid out with their prompt once (None: they can); `provider` is the built
    policy's megatron-core TransformerConfig."""
    if not config.grpo.share_prompts:
        return "grpo.share_prompts=false"
    if config.parallel.pp > 1:
        return "pipeline stages exchange micro-batches of one shape (parallel.pp > 1)"
    if provider.context_parallel_size > 1:
        return "context parallelism splits the sequence"
    spec = layer_spec_name(config.model.attention)
    if spec not in ("sdpa", "local") or provider.masked_softmax_fusion:
        return (f"the `{spec}` attention is given a causal mask, not one per group; use --model.attention=sdpa to share "
                "prompts")
    if provider.position_embedding_type not in ("rope", "learned_absolute", "none") or provider.multi_latent_attention:
        return f"{provider.position_embedding_type} position embeddings are not rotated per token here"
    if provider.apply_rope_fusion:
        return "the fused rotary kernel rotates by a token's index in its row"
    if provider.window_size is not None:
        return "sliding-window attention counts its window by a token's index in its row"
    if getattr(provider, "num_moe_experts", None) and any(
            _nonzero(getattr(provider, key, 0)) for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff")):
        return ("a Mixture-of-Experts router's load-balancing or z-loss (model.moe_aux_loss_coeff, "
                "model.moe_z_loss_coeff) would count each group's prompt tokens once, not once per completion")
    return None


def _nonzero(coefficient) -> bool:
    """Whether a megatron-core loss coefficient (a number, or one per loss type) weighs anything."""
    return any(value for value in (coefficient if isinstance(coefficient, (list, tuple)) else [coefficient or 0]))


@contextlib.contextmanager
def rotary_positions(model, position_ids):
    """Within the block, `model`'s rotary embeddings rotate each token by its `position_ids` entry ([batch, seq]; None:
    by its index in the row, as always)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if position_ids is None:
        yield
        return

    def per_token(module, args, output):
        # output: [seq, 1, 1, dim], the rotation of indices 0..seq-1; under sequence parallelism the whole sequence.
        table = module.get_emb(int(position_ids.max()) + 1)  # [positions, 1, 1, dim]
        return table[position_ids.t(), 0]  # [seq, batch, 1, dim]

    handles = [module.register_forward_hook(per_token) for module in model.modules() if type(module) is RotaryEmbedding]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
