"""Routing replay for a Mixture-of-Experts policy, through megatron-core's own `RouterReplay`.

GRPO samples its rollouts with the model it trains, so the routes a rollout took need no inference engine to report
them: `Routes` records each token's top-k experts per MoE layer in every forward of a generation (the prompts'
prefill, every decode step, the ids appended after a tool call) and, in the training-side forwards that score those
tokens, either replays them (`grpo.routing_replay=true`) or lets the router choose again. Either way it counts the
(token, layer) decisions whose top-k set the training forward's router picks differently from the rollout's, from the
router's own scores even when the replay overrides them: `moe_route_mismatch`.

How it uses megatron-core 0.19.2 (`megatron/core/transformer/moe/router_replay.py`): with `moe_enable_routing_replay`
every `TopKRouter` owns a `RouterReplay`, whose `get_replay_topk` every top-k choice goes through. Recording is its
`RECORD` action (the indices of the last forward, read after each). Replaying sets each layer's target and the
`REPLAY_FORWARD` action; the target stays until the next microbatch is loaded, so a recomputed forward in backward
(`model.recompute`) replays the same routes (no `REPLAY_BACKWARD` queue is needed with one model chunk: megatron's
schedule runs a microbatch's backward before the next one's forward). This module keeps its own list of a model's
routers, in layer order, instead of `RouterReplay`'s process-wide list, which also holds the KL reference copy's
and any earlier model's routers.

Layout: a forward's router sees its input as [sequence, batch] flattened sequence-major (token s * batch + b), and
under sequence parallelism only this tensor-parallel rank's slice of the sequence; expert parallelism dispatches
tokens after routing, so it changes nothing here.
"""

import contextlib

import torch

from model import moe, parallel


class Routes:
    """The MoE routers of one model (chunks), in layer order: record their routes, load routes to replay or compare."""

    def __init__(self, chunks: list):
        self.routers = [router for router in moe.routers(chunks) if router.router_replay is not None]
        # Whether the model has experts at all: a pipeline stage of only dense layers holds no router, but every rank
        # of a Mixture-of-Experts model takes part in the collectives that sum the routing figures.
        self.model_has_experts = any(parallel.unwrap(chunk).config.num_moe_experts for chunk in chunks)
        self.topk = self.routers[0].topk if self.routers else 0
        self.differ = self.compared = 0  # mismatch counts since the last `take_mismatch`
        for router in self.routers:
            self._measure(router.router_replay)

    def __bool__(self) -> bool:
        return bool(self.routers)

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def layer_numbers(self) -> list[int]:
        """The model's layer number (from 1, over every pipeline stage; a multi-token-prediction layer's after the main
        layers, as megatron-core numbers it) of each router, in order: what the layer axis of its routes stands for."""
        return [router.layer_number + (router.config.num_layers if router.is_mtp_layer else 0) for router in self.routers]

    def narrowed(self, routes: list[torch.Tensor], layer_numbers: list[int]) -> list[torch.Tensor]:
        """Routes recorded by another model ([ids, layers, top-k] each, its layer axis standing for `layer_numbers`: a
        rollout process's replica, which holds every layer) with this model's layers only, in its order (a pipeline
        stage holds some of them)."""
        index = [layer_numbers.index(number) for number in self.layer_numbers]
        return routes if index == list(range(len(layer_numbers))) else [route[:, index] for route in routes]

    # ---- recording (generation)

    @contextlib.contextmanager
    def recording(self):
        """Inside the block every router records the top-k indices of each forward (`recorded()` reads them)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._set_action(RouterReplayAction.RECORD)
        try:
            yield
        finally:
            self._set_action(None)
            for router in self.routers:
                router.router_replay.clear_indices()

    def recorded(self, rows: int, columns: int) -> torch.Tensor:
        """The last forward's routes as [rows, columns, layers, topk] (its input was [rows, columns] ids)."""
        per_layer = [router.router_replay.get_recorded_indices() for router in self.routers]  # each [columns * rows, k]
        stacked = torch.stack(per_layer, dim=1)  # [columns * rows, layers, k], sequence-major
        return stacked.view(columns, rows, self.layers, self.topk).transpose(0, 1)

    # ---- loading (training-side forwards)

    def load(self, routes: torch.Tensor, valid: torch.Tensor, replay: bool, compare: bool = True) -> None:
        """Routes for the next forwards over a [batch, seq] input: `routes` [batch, seq, layers, topk] (any value where
        `valid` [batch, seq] is False), replayed when `replay`; with `compare`, the first forward's own choice is
        compared with them (`take_mismatch`)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        config = self.routers[0].config
        routes = torch.where(valid[:, :, None, None], routes.long(),
                             torch.arange(self.topk, device=routes.device).expand_as(routes))
        routes, valid = routes.transpose(0, 1), valid.transpose(0, 1)  # [seq, batch, ...]: the router's order
        if config.sequence_parallel:  # this rank's slice of the sequence
            tp, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                        parallel_state.get_tensor_model_parallel_rank())
            width = routes.size(0) // tp
            routes, valid = routes[rank * width : (rank + 1) * width], valid[rank * width : (rank + 1) * width]
        routes, valid = routes.reshape(-1, self.layers, self.topk), valid.reshape(-1)
        for layer, router in enumerate(self.routers):
            replayer = router.router_replay
            replayer.target_topk_idx = routes[:, layer].contiguous()  # not `set_target_indices`: no backward queue
            replayer.valid_tokens, replayer.compared = valid, not compare
        self._set_action(RouterReplayAction.REPLAY_FORWARD if replay else None)

    def clear(self) -> None:
        """No routes loaded: every router chooses its own experts again (generation, evaluation)."""
        self._set_action(None)
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.valid_tokens = None

    def take_mismatch(self) -> tuple[int, int]:
        """(differing, compared) (token, layer) decisions since the last call, on this rank."""
        counts = (int(self.differ), int(self.compared))
        self.differ = self.compared = 0
        return counts

    # ---- internals

    def _set_action(self, action) -> None:
        for router in self.routers:
            router.router_replay.router_replay_action = action

    def _measure(self, replayer) -> None:
        """Wrap one router's top-k so the first forward after `load` compares the router's own choice with the loaded
        routes (a recomputed forward in backward is not counted again)."""
        choose = replayer.get_replay_topk
        replayer.valid_tokens, replayer.compared = None, True

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            target = replayer.target_topk_idx
            if target is not None and replayer.valid_tokens is not None and not replayer.compared:
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                differs = (own.sort(dim=1).values != target.to(own.device).sort(dim=1).values).any(dim=1)
                valid = replayer.valid_tokens.to(own.device)
                # Summed where they are, read once a step (`take_mismatch`): not two host syncs a layer and micro-batch.
                self.differ = self.differ + (differs & valid).sum()
                self.compared = self.compared + valid.sum()
                replayer.compared = True
            return choose(scores, topk, num_groups, group_topk, default_compute_topk)

        replayer.get_replay_topk = get_replay_topk
