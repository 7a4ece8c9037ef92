"""Mixture-of-Experts routers: freezing them, the padding they leave out, and what a training step's routing was (its
load-balancing and z losses, and how unevenly the experts were loaded).

megatron-core's routers (`TopKRouter`) record their auxiliary losses per layer in a process-wide tracker
(`moe_logging.get_moe_metrics_tracker()`), only in training forwards (`self.training and torch.is_grad_enabled()`).
`RoutingFigures` reads that tracker, and counts the tokens each expert receives with a forward hook under the same
condition, so generation, GRPO's log-prob forwards (eval mode, no grad) and a recomputation's first, gradient-free
pass never enter a step's figures. SFT's evaluation runs in eval mode, and `start_step` forgets anything recorded
before the step's own forwards besides.
"""

import torch

# megatron-core's tracker name of each load-balancing loss type's per-layer record (router.py), and of the z-loss's.
AUX_LOSS_RECORDS = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                    "global_aux_loss": "global_load_balancing_loss"}
Z_LOSS_RECORD = "z_loss"


def routers(chunks: list) -> list:
    """Every top-k router (one per MoE layer) in the model chunks."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [module for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]


def start_metrics_tracker() -> None:
    """A fresh process-wide tracker for a model being built: megatron-core sizes each record's per-layer entry by the
    first model that records it, so a later model with more layers in the same process (GRPO after its SFT, a test's
    shared launch) would index past it."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()


def freeze_routers(chunks: list) -> None:
    """Routers that never train (NeMo-RL's freeze_moe_router): their weights take no gradient, so neither DDP's buffers
    nor the optimizer hold them, and they stay bit for bit what was loaded. Call before the DDP wrap."""
    for router in routers(chunks):
        router.requires_grad_(False)


def weigh_router_losses(chunks: list, microbatches: list[dict], loss_count) -> None:
    """Before an optimizer step's forwards: give the routers the step's loss count per routed token, summed over the
    data-parallel ranks (`moe_router.MicroBatchWeightedRouter.loss_weight`), so a load-balancing or z-loss coefficient
    weighs as in pretraining whatever the loss counts (response tokens, completions). `loss_count(batch)`: a
    micro-batch's share of the loss's denominator. Collective over the data-parallel group where a router loss is on;
    nothing for a dense model or with both coefficients 0."""
    from megatron.core.utils import get_attr_wrapped_model

    from model import collectives

    config = get_attr_wrapped_model(chunks[0], "config") if chunks else None
    if not (config and config.num_moe_experts and (config.moe_aux_loss_coeff or config.moe_z_loss_coeff)):
        return
    # Summed where the batches are, then read in one host sync (not two per micro-batch).
    counts = torch.stack([torch.stack([torch.as_tensor(loss_count(batch), dtype=torch.float64,
                                                       device=batch["padding_mask"].device),
                                       (~batch["padding_mask"]).sum().to(torch.float64)])
                          for batch in microbatches]).sum(dim=0)  # [2]: counted, routed
    counted, routed = collectives.data_parallel_sum(counts.tolist())
    for router in routers(chunks):
        router.loss_weight = counted / routed if routed else 1.0


def routing_padding_mask(batch: dict, model):
    """A training forward's `padding_mask` ([batch, seq], True at padding), so megatron-core's routers leave padding out of
    their load-balancing and z losses and `RoutingFigures` out of its counts; None for a dense model (nothing reads it).

    megatron-core 0.19.2 splits the mask over the tensor-parallel ranks for sequence parallelism on the first pipeline
    stage only (`GPTModel._preprocess`); a later stage receives it as given, so it is given that stage's share here.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    config = get_attr_wrapped_model(model, "config")
    if not config.num_moe_experts:
        return None
    mask = batch["padding_mask"]  # [batch, seq]
    if get_attr_wrapped_model(model, "pre_process") or not config.sequence_parallel:
        return mask
    share = mask.chunk(parallel_state.get_tensor_model_parallel_world_size(), dim=1)
    return share[parallel_state.get_tensor_model_parallel_rank()]  # [batch, seq / tp]


class RoutingFigures:
    """A training step's routing, for its metrics row: `moe_load_imbalance` (the tokens routed to the busiest expert
    over the mean per expert, in the worst layer, counted over the step's training forwards on every rank, padding
    left out), and `moe_aux_loss` / `moe_z_loss` when their coefficients are set (megatron-core's figures: the losses
    without their coefficients, averaged over the micro-batches and MoE layers). A dense model has none of them.

    `start_step()` before a step's first training forward, `step_figures()` after its last (collective).
    """

    def __init__(self, chunks: list, transformer_config):
        self.experts = transformer_config.num_moe_experts or 0
        self.main_layers = transformer_config.num_layers
        layers = self.main_layers + (transformer_config.mtp_num_layers or 0)  # multi-token prediction's layers last
        self.losses = {}  # row key: the tracker's record
        loss_type = transformer_config.moe_router_load_balancing_type
        if self.experts and loss_type in AUX_LOSS_RECORDS and transformer_config.moe_aux_loss_coeff:
            self.losses["moe_aux_loss"] = AUX_LOSS_RECORDS[loss_type]
        if self.experts and transformer_config.moe_z_loss_coeff:
            self.losses["moe_z_loss"] = Z_LOSS_RECORD
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.tokens = torch.zeros(layers, max(self.experts, 1), dtype=torch.float64, device=device)  # [layer, expert]
        self.forwards = torch.zeros(layers, dtype=torch.float64, device=device)  # [layer]: training forwards this step
        for router in routers(chunks):
            router.register_forward_hook(self._count, with_kwargs=True)

    def _count(self, router, args, kwargs, output) -> None:
        """Add one training forward's tokens per expert (a forward hook on a router)."""
        if not (router.training and torch.is_grad_enabled()):
            return
        routing_map = output[1]  # [tokens, experts], True where a token is sent to an expert
        padding = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)  # [seq, batch], True at padding
        if padding is not None:  # masked, not indexed: boolean indexing reads its size from a GPU (a host sync a layer)
            routing_map = routing_map & ~padding.reshape(-1, 1)  # the router flattens [seq, batch] in the same order
        layer = router.layer_number - 1 + (self.main_layers if router.is_mtp_layer else 0)
        self.tokens[layer] += routing_map.sum(dim=0)
        self.forwards[layer] += 1

    def start_step(self) -> None:
        """Forget the tokens counted and the losses recorded before this step's training forwards."""
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        if self.experts:
            self.tokens.zero_()
            self.forwards.zero_()
            get_moe_metrics_tracker().clear()

    def step_figures(self) -> dict:
        """The step's figures over every rank (empty for a dense model). Collective for an MoE model: every rank calls it."""
        if not self.experts:
            return {}
        tokens = self.tokens.clone()
        # Summed over every rank: each holds its pipeline stage's layers; tensor-parallel peers without sequence
        # parallelism count the same tokens, which scales a layer's counts and leaves their max / mean unchanged.
        torch.distributed.all_reduce(tokens)
        routed = tokens.sum(dim=1) > 0  # [layer]: the MoE layers (dense layers route nothing)
        if not routed.any():  # no training forward this step
            return {}
        per_layer = tokens.max(dim=1).values / tokens.mean(dim=1)  # [layer]
        figures = {"moe_load_imbalance": float(per_layer[routed].max())}
        figures.update({key: self._loss(record, routed) for key, record in self.losses.items()})
        return figures

    def _loss(self, record: str, routed: torch.Tensor) -> float:
        """megatron-core's figure of a recorded loss (`MoEMetricsTracker.report`): per layer the mean over the step's
        micro-batches, summed over the pipeline stages and the record's `reduce_group`, averaged over its `avg_group` and
        the data-parallel ranks, then averaged over the MoE layers. Averages are sums divided by the group's size: gloo
        has no `ReduceOp.AVG`. Collective."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        tracker = get_moe_metrics_tracker()
        tracker.ensure_initialized(record, len(self.forwards), device=self.forwards.device)  # a stage may record none
        entry = tracker.metrics[record]
        values = entry.values.to(torch.float64) / self.forwards.clamp(min=1)  # [layer]
        data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
        for group, average in ((parallel_state.get_pipeline_model_parallel_group(), False), (entry.reduce_group, False),
                               (entry.avg_group, True), (data_parallel if entry.needs_dp_avg else None, True)):
            if group is not None:
                torch.distributed.all_reduce(values, group=group)
                values /= group.size() if average else 1
        return float(values[routed].mean())
