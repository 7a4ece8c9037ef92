"""A run whose gradients turn NaN stops at that step on every rank, in one paragraph, with nothing of it saved; a stop
every rank agrees on mid-run publishes the checkpoint save in flight first; a reward failing on held-out answers is
counted and said.

In fp32 and bf16 megatron-core applies an update whatever its gradient norm. Before, an SFT run at `optim.lr=50` went
on for every step with loss and grad_norm nan, saved NaN checkpoints over the good ones (`ckpt.keep_last`) and
exported NaN weights, exit 0 (Megatron-FSDP's own `check_for_nan_in_grad`, on, let it through too); GRPO's next
rollout stopped with torch's "probability tensor contains either `inf`, `nan` or element < 0" traceback. And a reward
that failed on every completion of step 3 stopped the run with its paragraph while step 2's save was written in the
background: left as `.partial-step_00000002`, no `latest`.
One 2-process launch (conftest's `joint_launches`).
"""

import json
import math

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.distributed

SFT = ["--train.steps=4", "--train.global_batch_size=16", "--train.micro_batch_size=8", "--train.eval_samples=0",
       "--optim.lr=50", "--optim.warmup_steps=0", "--ckpt.save_interval=1", "--train.log_interval=1"]
# A reward with signal on the untrained tiny model (even-length answers), so that the first update moves the policy.
GRPO = ["--model.path=tiny", "--grpo.reward=tests.tool_fixtures:parity", "--train.steps=4",
        "--train.global_batch_size=64", "--train.micro_batch_size=32", "--train.eval_samples=0", "--optim.lr=1e6",
        "--optim.weight_decay=0", "--optim.warmup_steps=0", "--ckpt.save_interval=1", "--train.log_interval=1"]
RUNS = {"sft": ("trainer.sft", SFT), "sft_fsdp": ("trainer.sft", [*SFT, "--parallel.use_megatron_fsdp=true"]),
        "grpo": ("trainer.grpo", GRPO)}
# A reward whose service goes away after step 2 (each rank scores 32 completions a step, in its own process).
FLAKY = """import itertools
_calls = itertools.count()
def reward(completion, reference):
    if next(_calls) >= 64:
        raise ConnectionError("the scoring service went away")
    return float(len(completion) % 2 == 0)
"""
# A reward that fails on the first 4 answers it scores on each rank: the step-0 baseline's held-out ones.
HELD_OUT_FAILS = FLAKY.replace("if next(_calls) >= 64:", "if next(_calls) < 4:").replace(
    "the scoring service went away", "not up yet")


def launches(tmp_path_factory):
    """The three diverging runs, each expected to stop with its paragraph."""
    root = tmp_path_factory.mktemp("divergence")
    (root / "flaky_scoring_service.py").write_text(FLAKY)
    (root / "late_scoring_service.py").write_text(HELD_OUT_FAILS)
    late = ["--model.path=tiny", "--grpo.reward=late_scoring_service:reward", "--grpo.reward_timeout=0",
            "--train.steps=1", "--train.global_batch_size=64", "--train.micro_batch_size=32", "--train.eval_samples=8",
            f"--train.out_dir={root / 'late'}"]
    flaky = ["--model.path=tiny", "--grpo.reward=flaky_scoring_service:reward", "--grpo.reward_timeout=0",
             "--train.steps=4", "--train.global_batch_size=64", "--train.micro_batch_size=32", "--train.eval_samples=0",
             "--ckpt.save_interval=2", f"--train.out_dir={root / 'flaky'}"]
    results = yield launch([{"module": module, "argv": [*argv, f"--train.out_dir={root / name}"], "expect_error": True}
                            for name, (module, argv) in RUNS.items()]
                           + [{"module": "trainer.grpo", "argv": flaky, "expect_error": True},
                              {"module": "trainer.grpo", "argv": late}],
                           env={"PYTHONPATH": str(root)})
    return {"root": root, **dict(zip([*RUNS, "flaky", "late"], results))}


@pytest.fixture(scope="module")
def runs(joint_launches) -> dict:
    return joint_launches[__name__]


@pytest.mark.parametrize("name", list(RUNS))
def test_a_diverging_run_stops_at_its_first_nan_step_and_keeps_the_checkpoint_before_it(runs, name):
    out_dir = runs["root"] / name
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "grad_norm" in row]
    diverged = steps[-1]["step"]
    # Every step before the last had a finite norm; the last one's is the paragraph's, and no step ran after it.
    assert all(math.isfinite(row["grad_norm"]) for row in steps[:-1]) and math.isnan(steps[-1]["grad_norm"])
    assert 2 <= diverged < 4
    assert runs[name]["error"].startswith(f"Training diverged at step {diverged}: the gradient norm is nan")
    assert "Lower `optim.lr`" in runs[name]["error"] and str(out_dir / "metrics.jsonl") in runs[name]["error"]
    # The step before it was saved every step (in the background for DDP), and that save was published, not lost.
    before = f"step_{diverged - 1:08d}"
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == before
    assert f"`{out_dir / 'checkpoints' / before}`, holds the weights before it" in runs[name]["error"]
    assert sorted(path.name for path in (out_dir / "checkpoints").glob("step_*"))[-1] == before
    assert not (out_dir / "hf").exists()


def test_a_reward_failing_everywhere_mid_run_publishes_the_save_in_flight_before_it_stops(runs):
    out_dir = runs["root"] / "flaky"
    assert runs["flaky"]["error"].startswith("The reward function `grpo.reward=flaky_scoring_service:reward` failed on "
                                             "every one of the 64 completions of step 3")
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert sorted(path.name for path in (out_dir / "checkpoints").iterdir()) == ["latest", "step_00000002"]


def test_a_reward_failing_on_held_out_answers_is_counted_and_said(runs):
    """Before, the baseline's `eval_accuracy` 0 was all a user saw of a reward failing on every held-out answer."""
    baseline = json.loads((runs["root"] / "late" / "metrics.jsonl").read_text().splitlines()[0])
    assert baseline["step"] == 0 and baseline["eval_accuracy"] == 0.0 and baseline["eval_reward_errors"] == 8
    assert ("held-out evaluation: the reward function failed on 8 of the 8 held-out completions, each scored 0 in "
            "eval_accuracy; the first ConnectionError failure: `late_scoring_service:reward` raised ConnectionError: "
            "not up yet") in runs["late"]["log"]
    assert runs["late"]["step1"]["reward_errors"] == 0
