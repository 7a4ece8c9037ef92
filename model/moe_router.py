"""The Mixture-of-Experts router our layer specs build: megatron-core's `TopKRouter` with its load-balancing loss
weighted by the micro-batch's tokens once, not once per tensor-parallel rank.

Under `calculate_per_token_loss` (model/build.py) every gradient is divided by the global batch's loss tokens in
`finalize_model_grads`, so megatron-core 0.19.2 attaches each router's load-balancing loss (`aux_loss`, `seq_aux_loss`,
`global_aux_loss`) multiplied by `valid_token_count x tp_cp size` (`TopKRouter.attach_and_log_load_balancing_loss`).
With sequence parallelism each tensor-parallel rank holds a slice of the micro-batch and computes its share of the loss, and
the router weight's gradient is summed over the ranks; `valid_token_count` is meant to be the slice's tokens. When the
router is given a padding mask (our training forwards always give one, `moe.routing_padding_mask`), the count comes from
`get_tokens_per_expert_and_token_count`, which all-reduces `local_tokens_per_expert` over the loss's group in place
(`reduce_from_tensor_model_parallel_region` returns the contiguous tensor it reduced) and then reads it as this rank's
count: every slice is weighted by the whole group's tokens x tp_cp size, and at TP=2 every router weight's gradient
from the loss came out exactly twice the TP=1 one.

The group's count, not the slice's times the group size, is also the weight the loss's definition asks for: one
micro-batch's loss over all of its valid tokens, weighted by their number however its sequence is sliced (the slices'
counts times tp_cp size would weight a slice with little padding above one with much). So the count megatron-core passes
is divided by tp_cp size here, which gives every tensor-parallel size the TP=1 gradient; `global_aux_loss`'s count also
spans the data-parallel ranks, and keeps them, as at TP=1. The z-loss counts its tokens from the mask itself and is
right as it is. tests/test_moe_settings.py checks each loss's gradient by hand and at TP=2 against TP=1, and the runs.

Against what the losses weigh: megatron-core's weighting (a micro-batch's router losses times its routed tokens, the
whole divided by the loss's count) is pretraining's only where every routed token is a loss token. Our losses count
fewer: SFT's the response tokens, GRPO's `seq_mean_token_mean` its completions, so the coefficients acted about
routed / counted times stronger than set (2x where half a row is prompt; a completion's length, tens to hundreds of
times, under the sequence mean). Each step's forwards therefore carry `loss_weight`, the step's loss count per routed
token over every data-parallel rank (`moe.weigh_router_losses`), by which the router losses are scaled: a coefficient
then weighs the losses per routed token against the loss's mean, as in pretraining, whatever the loss counts. One
weight for the step (not one per micro-batch) also holds under recomputation, whose forwards run out of order.
"""

import dataclasses
import functools

from megatron.core.transformer.moe.router import TopKRouter


class MicroBatchWeightedRouter(TopKRouter):
    """megatron-core's `TopKRouter` whose load-balancing loss, given a padding mask, is weighted by the tokens of the
    whole micro-batch once (see the module's docstring)."""

    count_is_group_total = False  # set by each `routing` call, read by the load-balancing losses it attaches
    loss_weight = 1.0  # the step's loss count per routed token (`moe.weigh_router_losses`), scaling both router losses

    def routing(self, logits, padding_mask=None):
        """megatron-core's routing; notes whether its token counts come from the in-place all-reduce (with a mask)."""
        self.count_is_group_total = padding_mask is not None
        return super().routing(logits, padding_mask=padding_mask)

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                                           needs_dp_avg=True, valid_token_count=None):
        """megatron-core's, with the group's token count divided by the tp_cp size it is multiplied by, and scaled by
        `loss_weight` (the logged figure is the loss's own)."""
        if valid_token_count is None:
            valid_token_count = activation.shape[0]
        elif self.count_is_group_total:
            valid_token_count = valid_token_count / self.tp_cp_group.size()
        return super().attach_and_log_load_balancing_loss(activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                                          reduce_group, needs_dp_avg,
                                                          valid_token_count * self.loss_weight)

    def apply_z_loss(self, logits, padding_mask=None):
        """megatron-core's z-loss with its coefficient scaled by `loss_weight` for this call; the logged figure divides
        the coefficient back out, so it is the loss's own. (The coefficient lives on the config every layer shares:
        it is set back before the call returns.)"""
        coefficient = self.config.moe_z_loss_coeff
        if not coefficient or self.loss_weight == 1.0:
            return super().apply_z_loss(logits, padding_mask)
        self.config.moe_z_loss_coeff = coefficient * self.loss_weight
        try:
            return super().apply_z_loss(logits, padding_mask)
        finally:
            self.config.moe_z_loss_coeff = coefficient


def with_micro_batch_weighted_router(layer_spec_fn):
    """`layer_spec_fn` (a provider's config -> one layer's spec) with `MicroBatchWeightedRouter` as the router of a
    Mixture-of-Experts layer; a dense layer's spec comes back as built."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    # Megatron-Bridge lays out a module's weights on load and export by its class's name: whole on every rank, as
    # TopKRouter's (its registry is a set, so registering again changes nothing).
    AutoMapping.register_module_type(MicroBatchWeightedRouter.__name__, "replicated")

    @functools.wraps(layer_spec_fn)
    def layer_spec(config):
        spec = layer_spec_fn(config)
        if not config.num_moe_experts:
            return spec
        # megatron-core's MoE spec (gpt/moe_module_specs.py): functools.partial(MoELayer, submodules=MoESubmodules(...))
        moe_layer = spec.submodules.mlp
        submodules = getattr(moe_layer, "keywords", {}).get("submodules")
        if getattr(submodules, "router", None) is not TopKRouter:
            raise RuntimeError(f"the Mixture-of-Experts layer spec has no TopKRouter to replace: {moe_layer!r}")
        spec.submodules.mlp = functools.partial(moe_layer.func, *moe_layer.args, **{
            **moe_layer.keywords, "submodules": dataclasses.replace(submodules, router=MicroBatchWeightedRouter)})
        return spec

    return layer_spec
