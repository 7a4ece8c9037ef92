"""Asynchronous GRPO's fast checks: the schedule of which policy samples which step, the layouts refused before
anything is built, and the rollout corrections' rejection masks by hand (the runs: tests/test_grpo_e2e.py)."""

import pytest
import torch

from config.cli import parse_args
from config.errors import UserError
from config.loops import GRPOConfig
from trainer import grpo_math
from trainer.grpo_async import sampled_by


def test_which_policy_samples_each_step_is_a_function_of_the_step():
    """max_staleness k: step s is sampled by the policy after step s-1-k, never before the run's start; 0 is the
    synchronous loop (the policy after the previous step). A resume after step 4 keeps the straight run's schedule for
    every step it samples (its first k batches come from the checkpoint)."""
    assert [sampled_by(step, 0, 0) for step in range(1, 7)] == [0, 1, 2, 3, 4, 5]
    assert [sampled_by(step, 0, 1) for step in range(1, 7)] == [0, 0, 1, 2, 3, 4]
    assert [sampled_by(step, 0, 2) for step in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    assert [sampled_by(step, 4, 1) for step in range(6, 9)] == [sampled_by(step, 0, 1) for step in range(6, 9)]
    # Resumed from a checkpoint without the batches sampled ahead: the checkpoint's policy samples them.
    assert [sampled_by(step, 4, 2) for step in range(5, 9)] == [4, 4, 4, 5]


@pytest.mark.parametrize("argv, world_size, expected", [
    (["--grpo.rollout_processes=2"], 2, "leaves 0 of the 2 processes to train"),
    (["--grpo.rollout_processes=2"], 3, "must divide the trainers' data-parallel size: the 1 trainers"),
    (["--grpo.rollout_processes=1", "--parallel.tp=2"], 4, "make no whole data-parallel ranks"),
    (["--grpo.rollout_processes=1", "--config", "dapo"], 3, "does not run with `grpo.dynamic_sampling`"),
    (["--grpo.rollout_processes=1", "--peft.method=lora"], 2, "does not run with `peft.method=lora`"),
    (["--grpo.rollout_processes=-1"], 2, "must be 0 or more, got -1 and 1"),
    (["--grpo.rollout_processes=1", "--grpo.max_staleness=-1"], 2, "must be 0 or more, got 1 and -1"),
    (["--grpo.rollout_correction=reject"], 2, "`grpo.rollout_correction=reject` is not one of auto, none, tis, token_reject, "
                                              "sequence_reject"),
])
def test_layouts_asynchronous_grpo_cannot_run_are_refused_at_start_up(argv, world_size, expected):
    config, _ = parse_args(GRPOConfig, ["--model.path=tiny", *argv], "trainer.grpo")
    with pytest.raises(UserError) as error:
        config.validate(world_size=world_size)
    assert expected in str(error.value)


def test_the_trainers_are_validated_at_their_own_world_size():
    """3 processes, 1 sampling: 2 trainers at TP=2 (one data-parallel rank) pass; at 4 processes, 3 trainers do not."""
    config, _ = parse_args(GRPOConfig, ["--model.path=tiny", "--grpo.rollout_processes=1", "--parallel.tp=2"],
                           "trainer.grpo")
    config.validate(world_size=3)
    with pytest.raises(UserError, match="the 3 trainers at TP=2 x PP=1 make no whole data-parallel ranks"):
        config.validate(world_size=4)


def test_stale_rollouts_get_the_decoupled_objective_by_default():
    """`grpo.rollout_correction=auto` (the default): tis where rollouts are stale, none where they are not (colocated, or
    synchronous rollout processes); a named choice is kept."""
    from trainer.grpo_update import LossSettings

    def correction(*argv: str) -> tuple:
        config, _ = parse_args(GRPOConfig, ["--model.path=tiny", *argv], "trainer.grpo")
        settings = LossSettings.from_config(config.grpo)
        return settings.correction, settings.correction_cap

    assert correction() == ("none", None)
    assert correction("--grpo.rollout_processes=1") == ("tis", 2.0)
    assert correction("--grpo.rollout_processes=1", "--grpo.max_staleness=0") == ("none", None)
    assert correction("--grpo.rollout_processes=1", "--grpo.rollout_correction=none") == ("none", None)
    assert correction("--grpo.rollout_correction=token_reject") == ("token_reject", 2.0)


def test_rejection_masks_by_hand():
    """token_reject keeps tokens whose pi_old / pi_sampler lies in [1/cap, cap]; sequence_reject keeps whole completions
    by the geometric mean over their trained tokens."""
    log2 = torch.log(torch.tensor(2.0)).item()
    log_ratio = torch.tensor([[0.1, -0.9, 0.0, 0.0], [0.5, 0.6, 0.7, 0.0], [log2 + 1e-3, -log2 + 1e-3, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    token = grpo_math.rejection_keep(log_ratio, mask, 2.0, "token_reject")
    assert token.tolist() == [[1, 0, 1, 1], [1, 1, 0, 1], [0, 1, 1, 1]]  # ln 2 = 0.693
    sequence = grpo_math.rejection_keep(log_ratio, mask, 2.0, "sequence_reject")
    # means over the trained tokens: -0.4, 0.6, 0.001
    assert sequence.tolist() == [[1] * 4, [1] * 4, [1] * 4]
    assert grpo_math.rejection_keep(log_ratio, mask, 1.5, "sequence_reject")[:, 0].tolist() == [1, 0, 1]  # ln 1.5 = 0.405


def test_the_link_waits_through_the_other_sides_unbounded_work_and_names_a_stuck_peer():
    """A rollout process blocks in its send while the trainers evaluate, save or export: the link's wait is its own
    (a day), not `parallel.timeout_minutes` (a 77 s evaluation at timeout_minutes=1 ended the run, each side blaming
    the other); a peer that does not answer within it is named as stuck, not as lost. Two ranks of one link in threads."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from model import link

    def exchange(timeout, delay: float) -> dict:
        store, results = dist.HashStore(), {}

        def side(rank: int) -> None:
            try:
                joined = link.Link(store, rank, 2, 1, **({"timeout": timeout} if timeout else {}))
                results["timeout"] = joined.timeout
                if rank == 1:
                    joined.send({"step": 3}, 0)
                else:
                    time.sleep(delay)  # the trainer busy before it takes the batch
                    results[rank] = joined.receive(1)
            except UserError as error:
                results[rank] = str(error)

        threads = [threading.Thread(target=side, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return results

    taken = exchange(None, 1.5)
    assert taken[0] == {"step": 3} and taken["timeout"] == link.WAIT == datetime.timedelta(hours=24)
    stuck = exchange(datetime.timedelta(seconds=0.5), 2.0)
    assert stuck[1].startswith("Asynchronous GRPO's trainer (global rank 0) did not answer within 0.5 s (")
    assert "it is alive but stuck" in stuck[1]


def test_batches_sampled_ahead_are_dropped_on_a_resume_that_changes_how_they_are_sampled(caplog):
    """A checkpoint's batches received ahead were sampled and scored under its settings: a resume at another
    `grpo.max_staleness` (or temperature, reward, ...) drops them, and the checkpoint's policy samples those steps again
    (a batch one step stale trained at max_staleness 0 with no correction); the same settings keep them, as do
    settings outside `grpo` and `data`."""
    import logging
    from types import SimpleNamespace

    from trainer.grpo_async import RemoteRollouts, sampling_settings

    def rollouts(*argv):
        config, _ = parse_args(GRPOConfig, ["--grpo.rollout_processes=1", *argv], "trainer.grpo")
        runtime = SimpleNamespace(link=SimpleNamespace(trainers=1, rollouts=1), dp_rank=0, dp_size=1, is_main=True)
        return RemoteRollouts(config, runtime, policy=None)

    saved = {"batches": [{5: "step 5's batch"}], "sampled_with": sampling_settings(rollouts().config)}
    for argv, kept in ((["--optim.lr=1e-5"], True), ([], True), (["--grpo.max_staleness=0"], False),
                       (["--grpo.temperature=0.7"], False)):
        resumed = rollouts(*argv)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            resumed.load_state_dict(saved)
        assert resumed.pending == ({5: "step 5's batch"} if kept else {})
        assert ("they are dropped, and the checkpoint's policy samples those steps again" in caplog.text) == (not kept)
        assert ("grpo.max_staleness 1 -> 0" in caplog.text) == (argv == ["--grpo.max_staleness=0"])
    old = rollouts("--grpo.temperature=0.7")
    old.load_state_dict({"batches": [{5: "step 5's batch"}]})  # a checkpoint from before the settings were saved
    assert old.pending == {5: "step 5's batch"}
