"""A run whose gradients turn NaN stops at that step on every rank, in one paragraph, with nothing of it saved.

In fp32 and bf16 megatron-core applies an update whatever its gradient norm. Before, an SFT run at `optim.lr=50` went
on for every step with loss and grad_norm nan, saved NaN checkpoints over the good ones (`ckpt.keep_last`) and
exported NaN weights, exit 0 (Megatron-FSDP's own `check_for_nan_in_grad`, on, let it through too); GRPO's next
rollout stopped with torch's "probability tensor contains either `inf`, `nan` or element < 0" traceback. One 2-process launch (conftest's `joint_launches`), every run saving each step.
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


def launches(tmp_path_factory):
    """The three diverging runs, each expected to stop with its paragraph."""
    root = tmp_path_factory.mktemp("divergence")
    results = yield launch([{"module": module, "argv": [*argv, f"--train.out_dir={root / name}"], "expect_error": True}
                            for name, (module, argv) in RUNS.items()])
    return {"root": root, **dict(zip(RUNS, results))}


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
