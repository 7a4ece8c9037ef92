"""Routing replay and the rollout/training gap on the embedded Mixture-of-Experts model (`tiny-moe`): routes recorded in
generation, compared and replayed in training forwards (tests/distributed/routing_worker.py, in the shared launch),
and GRPO's per-step figures with replay on and off, in bf16 where the rounding of the two sides differs."""

import json

import pytest
import torch

from model.parallel import free_port
from tests.conftest import launch, worker_output
from trainer.grpo_batches import input_aligned_routes, label_aligned


def test_routes_and_sampler_logprobs_are_laid_out_as_the_collated_batch():
    """Per-input-id values become the labels' layout (shifted by one); routes the inputs' (every id but the last,
    which generation never fed), marked recorded there and nowhere else."""
    assert label_aligned([[0.0, 0.0, -1.0, -2.0], [0.0, -3.0]], 5).tolist() == [[0.0, -1.0, -2.0, 0.0, 0.0],
                                                                                 [-3.0, 0.0, 0.0, 0.0, 0.0]]
    first = torch.arange(4 * 2 * 2, dtype=torch.int16).view(4, 2, 2)
    second = torch.arange(2 * 2 * 2, dtype=torch.int16).view(2, 2, 2) + 100
    routes, routed = input_aligned_routes([first, second], 5)
    assert routes.shape == (2, 5, 2, 2)
    assert torch.equal(routes[0, :3], first[:3]) and torch.equal(routes[1, :1], second[:1])
    assert routed.tolist() == [[True, True, True, False, False], [True, False, False, False, False]]


def shared_worker(out) -> list[str]:
    """Recorded routes compared and replayed, TP=2 with sequence parallelism then TP=1, in the 2-process shared launch."""
    return ["tests/distributed/routing_worker.py", "--out", str(out)]


@pytest.mark.distributed
def test_recorded_routes_match_a_training_forward_and_replay_forces_them(shared_launch):
    """fp32: a training forward's routers choose what the rollout recorded for every fed token and layer (ties aside),
    and its log-probs of the sampled tokens equal the sampler's; replaying other routes makes every router use exactly
    them (its own choice differing from most), with each rank's slice of the sequence under sequence parallelism; with
    ids appended after a turn's end (tool messages), those too."""
    for tp in (2, 1):
        result = json.loads((worker_output(shared_launch[__name__]) / f"tp{tp}.json").read_text())
        print(f"routing TP={tp}:", result)
        assert result["recorded_shapes_ok"] and result["layers"] == 4 and result["maps"] == 4
        # Every recorded token of this rank's share, once per layer (under sequence parallelism: the first half of
        # each sequence on rank 0, where the right-padded rows hold more of their tokens).
        assert result["own_compared"] == result["rank_valid_tokens"] * result["layers"] == result["forced_compared"]
        assert (result["rank_valid_tokens"] < result["valid_tokens"]) == (tp > 1)
        # Measured 0 of 416 decisions (TP=1; 0 of 288 on rank 0 at TP=2): fp32 rounding almost never flips a top-2 choice.
        assert result["own_differ"] <= 0.01 * result["own_compared"]
        assert result["logprob_gap_max"] < 1e-4
        assert result["replay_exact"] and result["forced_differ"] >= 0.5 * result["forced_compared"]
        # Multi-turn: the ids appended after a turn's end (a tool message) were recorded when fed, like every other id.
        turns = result["multi_turn"]
        assert turns["continued_rows"] >= 2 and turns["compared"] > 0 and turns["differ"] <= 0.01 * turns["compared"]


def launches(tmp_path_factory):
    """GRPO on tiny-moe in bf16 with routing replay on and off (the latter with TIS), one step each, one launch (in
    conftest's `joint_launches`)."""
    root = tmp_path_factory.mktemp("replay-runs")
    common = ["--model.path=tiny-moe", "--model.dtype=bf16", "--train.steps=1", "--train.global_batch_size=32",
              "--train.micro_batch_size=16", "--train.eval_samples=0", "--ckpt.save_interval=0"]
    runs = {"replay": ["--grpo.routing_replay=true"],
            "own": ["--grpo.routing_replay=false", "--grpo.rollout_correction=tis"]}
    yield launch([{"module": "trainer.grpo", "argv": [*common, *extra, f"--train.out_dir={root / name}"]}
                  for name, extra in runs.items()])
    return {name: [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
            for name in runs}


@pytest.fixture(scope="module")
def replay_runs(joint_launches) -> dict:
    return joint_launches[__name__]


@pytest.mark.distributed
def test_each_pipeline_stage_records_its_own_layers_routes(shared_launch):
    """At PP=2 the rollout's forwards pass stage to stage; each stage's routers record their layers' routes, which
    are exactly PP=1's for those layers, over the same sampled completions."""
    out = worker_output(shared_launch[__name__])
    stages = [json.loads((out / f"pp2-rank{rank}.json").read_text()) for rank in range(2)]
    assert all(stage["same_completions"] and stage["same_routes"] and stage["layers"] >= 1 for stage in stages)


@pytest.mark.distributed
def test_grpo_logs_the_gap_and_replay_closes_it_in_bf16(replay_runs):
    """bf16 rounds the sampler's (cached, one token at a time) and the training forward's (whole sequence) sums
    differently: some routes flip and log-probs differ. Replaying the rollout's routes keeps the experts, so the
    largest gap shrinks, and the KL reference (which replays too) equals the policy at the first step."""
    for name, rows in replay_runs.items():
        print(name, [{key: row[key] for key in row if key.startswith(("rollout_", "moe_", "kl"))} for row in rows])
    replay, own = replay_runs["replay"], replay_runs["own"]
    # Measured (1 process, 16 completions): mismatch 0.35% / 0.69% of decisions either way; max gap 0.005 with replay
    # against 0.018 without; mean gap about 1e-3 both.
    for rows in (replay, own):
        assert all(0 < row["moe_route_mismatch"] < 0.05 for row in rows)
        assert all(0 < row["rollout_logprob_diff_mean"] < 0.01 and row["rollout_kl"] > 0 for row in rows)
    assert replay[0]["kl"] == 0.0
    assert max(row["rollout_logprob_diff_max"] for row in replay) < max(row["rollout_logprob_diff_max"] for row in own)


def _mismatch_on_a_stage(rank: int, port: int, results) -> None:
    """One of two pipeline stages of a Mixture-of-Experts model: stage 0 holds a router, stage 1 only dense layers."""
    import datetime
    from types import SimpleNamespace

    from megatron.core.transformer.moe.router_replay import RouterReplay

    from model.routing import Routes
    from trainer.grpo_update import route_mismatch

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=datetime.timedelta(seconds=20))
    routes = Routes([])
    routes.model_has_experts = True  # what the stage's model chunk says: the model has experts, on some stage
    if rank == 0:
        routes.routers = [SimpleNamespace(router_replay=RouterReplay())]  # this stage's router, its counts below
        routes.differ, routes.compared = 1, 4
    try:
        results[rank] = route_mismatch(routes)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_a_pipeline_stage_without_routers_joins_the_mismatch_collective():
    """Before, a rank without routers returned before the all-reduce its peers waited in: a hang at PP=2 for a model
    whose first layers are dense."""
    import torch.multiprocessing as multiprocessing

    with multiprocessing.Manager() as manager:
        results = manager.dict()
        multiprocessing.start_processes(_mismatch_on_a_stage, args=(free_port(), results), nprocs=2,
                                        start_method="spawn", join=True)
        assert dict(results) == {0: {"moe_route_mismatch": 0.25}, 1: {"moe_route_mismatch": 0.25}}
