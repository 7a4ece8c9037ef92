"""Recipes that do what their papers did, and the edge cases a user meets next: a prompt set smaller than a step's
prompts, a finished run whose export was lost, an output directory holding the run's inputs, tensor-parallel peers
with a reward that varies between calls, a reward function that fails, a node that cannot see rank 0's directory,
a stop signal during start-up.

The torchrun runs share one 2-process launch, from the session's default SFT (conftest.default_sft).
"""

import json
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from config.cli import parse_args
from config.errors import UserError
from config.loops import GRPOConfig, SFTConfig
from data import rewards
from data.arithmetic import generate_problems
from model.parallel import free_port
from tests.conftest import REPO, TORCHRUN, launch, torchrun_env
from trainer import grpo_sampling as grpo

# Reward functions of the runs below, imported by the trainer as `fidelity_rewards:NAME`.
REWARDS = (
    "import random, zlib\n"
    "def text(completion, reference):\n"
    "    return 'correct'  # a string, not a number: fails on every completion\n"
    "def third(completion, reference):\n"
    "    if zlib.crc32(completion.encode()) % 3 == 0:\n"
    "        raise ValueError('cannot parse this one')\n"
    "    return float('####' in completion)\n"
    "def noisy(completion, reference):\n"
    "    return random.random()  # another value at every call, as a model judge's may be\n"
    "def hang(completion, reference):\n"
    "    import time\n"
    "    time.sleep(3600)  # a reward stuck on some input: the run waited for it forever\n"
    "class Stuck:\n"
    "    def reset(self, row):\n"
    "        pass\n"
    "    def look(self, what: str) -> str:\n"
    "        \"\"\"Looks.\n\n        Args:\n            what: anything\n        \"\"\"\n"
    "        return what\n"
    "    def reward(self):\n"
    "        import time\n"
    "        time.sleep(3600)  # an environment's grader stuck on some episode: the run waited for it forever\n")


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- fast checks


def test_extra_rounds_wrap_a_small_set_and_prefer_prompts_the_step_has_not_used():
    # 10 prompts, 16 a round: round 0 wraps into the next epoch; an extra round takes every unused prompt first, then
    # wraps, so no rank's share is empty (the old draw returned 10 indices for 16 places).
    round0 = grpo.step_prompt_indices(10, 16, 1, seed=1234)
    extra = grpo.extra_prompt_indices(10, 16, 1234, 1, 1, round0)
    assert len(extra) == 16 and sorted(extra[:10]) == list(range(10)) and extra[10:] == extra[:6]
    # With room, the prompts round 0 used come last: a 100-prompt set gives 16 prompts not trained yet this step.
    round0 = grpo.step_prompt_indices(100, 16, 1, seed=1234)
    assert not set(grpo.extra_prompt_indices(100, 16, 1234, 1, 1, round0)) & set(round0)
    # Every rank gets its share in every round.
    config = SimpleNamespace(train=SimpleNamespace(global_batch_size=128, seed=1234), grpo=SimpleNamespace(n_samples=8))
    for dp_size in (1, 2):
        for rank in range(dp_size):
            runtime = SimpleNamespace(dp_size=dp_size, dp_rank=rank)
            for round_index in range(4):
                assert len(grpo.round_prompts(list(range(10)), config, 1, round_index, runtime)) == 16 // dp_size


def test_the_filter_counts_accuracy_not_the_shaped_reward():
    # Group 0: all wrong, differing only by the overlong penalty. Group 1: one right. Group 2: all right, alike.
    shaped = torch.tensor([0.0, -0.5, 0.0, -1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    correct = [False] * 4 + [True, False, False, False] + [True] * 4
    equal = torch.tensor([False, False, True])
    assert grpo.kept_groups(shaped, correct, equal, "accuracy").tolist() == [False, True, False]
    assert grpo.kept_groups(shaped, correct, equal, "reward").tolist() == [True, True, False]


def test_a_reward_failure_is_described_with_the_function_and_the_completion():
    def returns_text(completion, reference):
        return "correct"

    scores = rewards.score(returns_text, ["#### 8", "#### 9"], ["#### 8"] * 2)
    assert scores.errors == 2 and scores.rewards == [0.0, 0.0] and list(scores.failures) == ["TypeError"]
    assert "returns_text` raised TypeError: it returned str 'correct', not a number (on the completion '#### 8')" \
        in scores.failures["TypeError"]


def finished_run(out: Path, lora: bool = False) -> None:
    """What an earlier run leaves in `out`: metrics, a checkpoint, its export (and with LoRA its adapter)."""
    (out / "checkpoints" / "step_00000002").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_00000002")
    (out / "metrics.jsonl").write_text("{}\n")
    for name in ("hf", "hf_adapter") if lora else ("hf",):
        (out / name).mkdir()
        (out / name / "config.json").write_text("{}")


def test_overwrite_never_touches_the_inputs_and_deletes_every_output(tmp_path):
    from ckpt import checkpoint

    run = tmp_path / "run"
    finished_run(run, lora=True)
    # Training the run's own export into the same directory: refused, and nothing is deleted.
    config, _ = parse_args(SFTConfig, [f"--model.path={run / 'hf'}", f"--train.out_dir={run}",
                                       "--train.overwrite_output_dir=true"], "trainer.sft")
    for resume in ("", "latest"):  # resumed, nothing is deleted, but the export at the end would overwrite it
        with pytest.raises(UserError, match=r"`model.path=.*/run/hf` lies inside `.*/run/hf`, which this run writes "
                                            r"after its last step \(its Hugging Face export\)"):
            checkpoint.check_output_dir(config, resume, is_main=True)
    assert (run / "hf" / "config.json").is_file() and (run / "metrics.jsonl").is_file()
    # GRPO distilling from the run's own export into the same directory: the teacher is an input too.
    config, _ = parse_args(GRPOConfig, [f"--grpo.teacher={run / 'hf'}", f"--train.out_dir={run}",
                                        "--train.overwrite_output_dir=true"], "trainer.grpo")
    with pytest.raises(UserError, match=r"`grpo.teacher=.*/run/hf` lies inside `.*/run/hf`"):
        checkpoint.check_output_dir(config, "", is_main=True)
    assert (run / "hf" / "config.json").is_file()
    # Data inside the checkpoints the overwrite deletes: refused too.
    (run / "checkpoints" / "step_00000002" / "data.jsonl").write_text("{}\n")
    config, _ = parse_args(SFTConfig, [f"--data.path={run / 'checkpoints' / 'step_00000002' / 'data.jsonl'}",
                                       f"--train.out_dir={run}", "--train.overwrite_output_dir=true"], "trainer.sft")
    with pytest.raises(UserError, match=r"`data.path=.*` lies inside `.*step_00000002`, which this run deletes first"):
        checkpoint.check_output_dir(config, "", is_main=True)
    config, _ = parse_args(SFTConfig, [f"--data.eval_path={run / 'checkpoints' / 'step_00000002' / 'data.jsonl'}",
                                       f"--train.out_dir={run}", "--train.overwrite_output_dir=true"], "trainer.sft")
    with pytest.raises(UserError, match=r"`data.eval_path=.*` lies inside `.*step_00000002`, which this run deletes"):
        checkpoint.check_output_dir(config, "", is_main=True)  # the held-out rows were deleted with the checkpoints
    # Inputs elsewhere: every output of the earlier run goes, the LoRA adapter and a half-written export included.
    (run / "checkpoints" / "step_00000002" / "data.jsonl").unlink()
    (run / ".partial-hf").mkdir()
    config, _ = parse_args(SFTConfig, [f"--train.out_dir={run}", "--train.overwrite_output_dir=true"], "trainer.sft")
    checkpoint.check_output_dir(config, "", is_main=True)
    assert sorted(path.name for path in run.iterdir()) == ["checkpoints"] and not list((run / "checkpoints").iterdir())


def test_resuming_another_runs_checkpoint_into_a_run_is_refused_before_it_mixes_them(tmp_path):
    """`--resume-from-checkpoint B/checkpoints/step_2` with `train.out_dir=A`, where A holds a run: it exited 0 having
    cut A's metrics to B's rows and replaced A's `latest` and export. Refused (nothing touched); A's own checkpoint by
    path, `latest`, a moved run and branching B into an empty directory go on; with the overwrite, A is replaced."""
    from ckpt import checkpoint

    first, second = tmp_path / "a", tmp_path / "b"
    finished_run(first)
    finished_run(second)
    foreign = str(second / "checkpoints" / "step_00000002")

    def check(out_dir, resume: str, *extra: str) -> None:
        config, _ = parse_args(SFTConfig, [f"--train.out_dir={out_dir}", *extra], "trainer.sft")
        checkpoint.check_output_dir(config, resume, is_main=True)

    with pytest.raises(UserError, match=r"`train.out_dir=.*/a` holds an earlier run .* this run resumes from `.*/b/"
                                        r"checkpoints/step_00000002`, a checkpoint outside its own `ckpt.dir`"):
        check(first, foreign)
    assert (first / "metrics.jsonl").is_file() and (first / "checkpoints" / "latest").is_file()
    for resume in ("latest", str(first / "checkpoints" / "step_00000002"), str(first / "checkpoints")):
        check(first, resume)  # the run's own
    check(tmp_path / "branch", foreign)  # into an empty directory: a branch of B
    moved = tmp_path / "moved"
    first.rename(moved)
    check(moved, str(moved / "checkpoints" / "step_00000002"))
    check(moved, foreign, "--train.overwrite_output_dir=true")
    assert not (moved / "metrics.jsonl").exists() and (second / "metrics.jsonl").is_file()


def test_a_malformed_generation_config_is_named_before_any_build(tmp_path):
    from model.generate import end_token_ids
    from model.tiny import ensure_tiny_checkpoint

    model = tmp_path / "model"
    shutil.copytree(ensure_tiny_checkpoint(), model)
    (model / "generation_config.json").write_text('{"eos_token_id": [1, 2,')
    config, _ = parse_args(GRPOConfig, [f"--model.path={model}"], "trainer.grpo")
    with pytest.raises(UserError, match=r"`.*/model/generation_config.json` is not valid JSON .* point `--model.path`"):
        config.validate(world_size=1)
    with pytest.raises(UserError, match="generation_config.json` is not valid JSON"):
        end_token_ids(model, SimpleNamespace(eos_token_id=0))


def test_pi_old_is_computed_without_dropout():
    from model.build import eval_mode

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    inputs = torch.ones(4, 8)
    with eval_mode(model) as inside:
        assert not inside.training and torch.equal(inside(inputs), inside(inputs))
    assert model.training and not torch.equal(model(inputs), model(inputs))


def test_a_stop_signal_is_caught_from_the_moment_the_command_line_is_parsed():
    from ckpt import checkpoint

    previous = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        catcher = checkpoint.catch_stop_signals()
        assert checkpoint.catch_stop_signals() is catcher  # one per process: the default SFT's and GRPO's are the same
        os.kill(os.getpid(), signal.SIGTERM)  # before any Checkpointer exists
        assert catcher.requested
    finally:
        checkpoint.Preemption._installed = None
        for number, handler in previous.items():
            signal.signal(number, handler)


# ---------------------------------------------------------------- torchrun


def launches(default_sft, tmp_path_factory):
    """One 2-process launch (conftest's `joint_launches`): the export redo, DAPO at DP=2 and at DP=1 (TP=2) and GSPO on 10 prompts, the failing
    rewards, TP=2 with a noisy reward, a node-local output directory."""
    root = tmp_path_factory.mktemp("fidelity")
    (root / "fidelity_rewards.py").write_text(REWARDS)
    env = {"PYTHONPATH": f"{root}:{REPO}"}
    small = root / "ten.jsonl"
    small.write_text("".join(json.dumps(problem) + "\n" for problem in generate_problems(10, seed=11)))
    # The finished default SFT whose export was killed: no hf/, a half-written .partial-hf/.
    exported = root / "sft"
    shutil.copytree(default_sft, exported, ignore=shutil.ignore_patterns("hf"))
    (exported / ".partial-hf").mkdir()
    shutil.copy(default_sft / "hf" / "config.json", exported / ".partial-hf")
    # Killed before the last step's row was written too (it is written after the save and the export).
    rows = (exported / "metrics.jsonl").read_text().splitlines()
    (exported / "metrics.jsonl").write_text("".join(line + "\n" for line in rows[:-1]))
    model = f"--model.path={default_sft / 'hf'}"
    # 16 prompts a step from a set of 10; no warmup, so the first step's updates already move the policy.
    ten = [model, f"--data.path={small}", "--train.global_batch_size=128", "--train.micro_batch_size=16",
           "--train.steps=2", "--train.eval_samples=4", "--optim.warmup_steps=0"]
    brief = [model, "--train.global_batch_size=32", "--train.micro_batch_size=16", "--train.steps=2",
             "--train.eval_samples=4"]

    def grpo_command(name: str, *argv: str, **extra) -> dict:
        return {"module": "trainer.grpo", "argv": [*argv, f"--train.out_dir={root / name}"], **extra}

    nodes = [root / "node0", root / "node1"]
    for node in nodes:
        node.mkdir()
    results = yield launch([
        {"module": "trainer.sft", "argv": [f"--train.out_dir={exported}", "--resume-from-checkpoint", "latest"]},
        grpo_command("dapo2", "--config", "dapo", *ten),
        grpo_command("dapo1", "--config", "dapo", *ten, "--parallel.tp=2"),
        grpo_command("dapo2_budget_fsdp", "--config", "dapo", *ten, "--train.micro_batch_tokens=256",
                     "--parallel.use_megatron_fsdp=true"),
        grpo_command("dapo1_budget", "--config", "dapo", *ten, "--parallel.tp=2", "--train.micro_batch_tokens=256",
                     "--train.steps=1"),
        grpo_command("gspo2", "--config", "gspo", *ten, "--train.steps=1"),
        grpo_command("text", *brief, "--grpo.reward=fidelity_rewards:text", expect_error=True),
        grpo_command("hang", *brief, "--grpo.reward=fidelity_rewards:hang", "--grpo.reward_timeout=1", expect_error=True),
        grpo_command("stuck", *brief, "--grpo.environment=fidelity_rewards:Stuck", "--grpo.reward=none",
                     "--grpo.reward_timeout=1", expect_error=True),
        grpo_command("third", *brief, "--grpo.reward=fidelity_rewards:third"),
        grpo_command("tp2", *brief, "--grpo.reward=fidelity_rewards:noisy", "--parallel.tp=2",
                     "--parallel.sequence_parallel=false", checksums=True),
        {"module": "trainer.grpo", "argv": [*brief, "--train.out_dir=node-local"], "cwd_per_rank": [str(node) for node in nodes],
         "expect_error": True},
    ], env=env)
    return {"root": root, "default_sft": default_sft, "results": results}


@pytest.fixture(scope="module")
def runs(joint_launches) -> dict:
    return joint_launches[__name__]


def result(runs, name: str) -> dict:
    """The result of the command that wrote `train.out_dir=<root>/name` (or ran `name`)."""
    key = name if name.startswith("trainer.") else f"--train.out_dir={runs['root'] / name}"
    return next(result for result in runs["results"] if key in result["line"])


@pytest.mark.distributed
def test_dapo_and_gspo_clip_with_several_updates_a_step_on_a_set_smaller_than_a_step(runs):
    """10 prompts for 16 places a step, at DP=2 and at DP=1 (TP=2 on the 2 processes): extra rounds wrap like round 0,
    every rank samples its share, and the several updates a step (DAPO 4, GSPO 4) make pi_old lag, so the clip acts."""
    root = runs["root"]
    for name, steps in (("dapo2", [1, 2]), ("dapo1", [1, 2]), ("gspo2", [1])):
        rows = [row for row in metrics(root / name) if "loss" in row]
        print(name, [(row["step"], row.get("sampling_rounds"), row["clip_frac"], row["grad_norm"], row["grad_norm_max"])
                     for row in rows])
        assert [row["step"] for row in rows] == steps
        # The clip acts in the run (DP=2's first step clipped nothing on an AMD EPYC, 2026-12-07: 0.0, then 0.0058).
        assert any(row["clip_frac"] > 0 for row in rows)
        assert all(row["grad_norm_max"] >= row["grad_norm"] > 0 for row in rows)  # the mean over the step's updates
        # pi_old is recomputed, a forward over the batch of its own, timed as such (DAPO and GSPO: no KL reference). Four
        # updates' forwards and backwards are about 12 such forwards (0.1-0.2 of the update on a quiet machine; 0.1 was
        # missed once while other jobs loaded the two cores): a bound that only a missing forward fails.
        assert all(row["pi_old_time_s"] > 0.02 * row["update_time_s"] for row in rows)
    assert all(row["sampling_rounds"] >= 1 for row in metrics(root / "dapo2") if "loss" in row)


@pytest.mark.distributed
def test_a_token_budget_regroups_the_micro_batches_and_leaves_the_loss_as_it_was(runs):
    """DAPO (4 updates a step, each the token mean over its mini-batch) with `train.micro_batch_tokens=256` under
    Megatron-FSDP at DP=2, and at TP=2 with sequence parallelism (padding to its multiple), against 16 rows a
    micro-batch at the same layouts: the same rollouts, the loss and figures of step 1 within summation order
    (measured: 1e-7 relative), and the micro-batch counts agreed over the ranks (no hang)."""
    root = runs["root"]
    for budget_run, control, steps in (("dapo2_budget_fsdp", "dapo2", [1, 2]), ("dapo1_budget", "dapo1", [1])):
        budget, rows = ([row for row in metrics(root / name) if "loss" in row] for name in (budget_run, control))
        assert [row["step"] for row in budget] == steps
        first, reference = budget[0], rows[0]
        assert (first["reward_mean"], first["response_len"]) == (reference["reward_mean"], reference["response_len"])
        for key in ("loss", "grad_norm", "entropy"):
            print(budget_run, key, first[key], reference[key])
            assert math.isclose(first[key], reference[key], rel_tol=1e-5, abs_tol=1e-9), key
        assert abs(first["clip_frac"] - reference["clip_frac"]) < 2e-3  # a token at the clip's edge may round across it
        assert first["padding_share"] < reference["padding_share"]


@pytest.mark.distributed
def test_a_finished_run_whose_export_was_killed_writes_it_on_the_rerun(runs):
    import transformers

    exported, original = runs["root"] / "sft" / "hf", runs["default_sft"] / "hf"
    assert not (runs["root"] / "sft" / ".partial-hf").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    reference = transformers.AutoModelForCausalLM.from_pretrained(original)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(model.state_dict().values(),
                                                                 reference.state_dict().values(), strict=True))
    assert (exported / "tokenizer.json").is_file()
    log = result(runs, "trainer.sft")["log"]
    assert "finished all" in log and "was not written (completely)" in log
    # The last step's row, which the killed run never wrote, comes back from its checkpoint: all of it but the time
    # its save took (measured after the row went into the checkpoint).
    last, kept = metrics(runs["root"] / "sft")[-1], metrics(original.parent)[-1]
    assert last == {key: value for key, value in kept.items() if key != "checkpoint_time_s"} and last["step"] == 600
    assert "the row of step 600, written into the checkpoint but not the file, restored" in log


@pytest.mark.distributed
def test_a_reward_that_fails_everywhere_stops_at_step_1_and_one_failing_sometimes_is_said_once(runs):
    text = result(runs, "text")
    assert text["error"].startswith("The reward function `grpo.reward=fidelity_rewards:text` failed on every one of "
                                    "the 32 completions of step 1")
    assert "raised TypeError: it returned str 'correct', not a number" in text["error"]
    assert "--grpo.tolerate_reward_errors=true" in text["error"]
    assert not (runs["root"] / "text" / "checkpoints" / "latest").exists()  # no step trained
    assert [row["step"] for row in metrics(runs["root"] / "text")] == [0]  # the baseline evaluation only
    # A reward that never answers: each call stopped at `grpo.reward_timeout`, and after a round of them timed out
    # the batch's other calls are not made, so the run ends with the same paragraph within seconds.
    hang = result(runs, "hang")
    assert hang["error"].startswith("The reward function `grpo.reward=fidelity_rewards:hang` failed on every one of "
                                    "the 32 completions of step 1")
    assert "raised TimeoutError: the reward function did not answer within 1 s (grpo.reward_timeout)" in hang["error"]
    # An environment's reward() that never returns: the same, within its `grpo.reward_timeout` (it held the run).
    stuck = result(runs, "stuck")
    assert stuck["error"].startswith("The reward (`grpo.reward=none` plus the environment's `reward()`) failed on every "
                                     "one of the 32 completions of step 1")
    # Where in the user's file: the line the stopped call was on.
    assert "`Stuck.reward()` raised TimeoutError: it did not return within 1 s (grpo.reward_timeout) (raised at " in \
           stuck["error"]
    assert "fidelity_rewards.py, line 25). An environment's `reward()` returns a number or `(reward, correct)` within " \
           "`grpo.reward_timeout` (1 s" in stuck["error"]
    third = result(runs, "third")
    rows = [row for row in metrics(runs["root"] / "third") if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2] and all(row["reward_errors"] > 0 for row in rows)
    assert third["log"].count("the first ValueError failure: `fidelity_rewards:third` raised ValueError: cannot parse "
                              "this one (raised at ") == 1
    assert "fidelity_rewards.py, line 6) (on the completion" in third["log"]


@pytest.mark.distributed
def test_tensor_parallel_peers_share_one_score_of_a_reward_that_varies_between_calls(runs):
    """Without sequence parallelism the norms' gradients are not reduced over TP: were each peer to score the rollouts
    itself, their advantages and then their copies of the norms would differ after a step."""
    tp2 = result(runs, "tp2")
    assert [row["step"] for row in metrics(runs["root"] / "tp2") if "loss" in row] == [1, 2]
    assert len(tp2["checksums"]) == 2 and tp2["checksums"][0] == tp2["checksums"][1]


@pytest.mark.distributed
def test_a_node_that_cannot_see_rank_0s_output_directory_is_named_at_start_up(runs):
    error = next(result for result in runs["results"] if "out_dir=node-local" in result["line"])["error"]
    assert error.startswith("Every process must see the run's directories as global rank 0 does")
    assert "rank 1 on" in error and "cannot see `node-local`" in error and "docs/nodes.md" in error


@pytest.mark.distributed
def test_a_stop_signal_during_the_model_build_saves_after_the_first_step(tmp_path):
    """SIGTERM as soon as the process group is up (the model not built yet, no Checkpointer tracking): the run goes on to
    the end of its first step, saves it and exits 0, as the scheduler's requeue expects."""
    command = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "trainer.sft",
               f"--train.out_dir={tmp_path}", "--train.steps=20", "--train.eval_samples=0"]
    stop_file = tmp_path / "stopped.json"
    process = subprocess.Popen(command, cwd=REPO, env=torchrun_env(env={"TRAINER_STOP_FILE": str(stop_file)}),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not any("distributed:" in line for line in lines) and time.time() < deadline and process.poll() is None:
        time.sleep(0.02)
    workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    for worker in workers:
        os.kill(int(worker), signal.SIGTERM)
    process.wait(timeout=300)
    reader.join(timeout=10)
    output = "".join(lines)
    assert process.returncode == 0, output[-4000:]
    assert "stopping at step 1 (signal)" in output
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000001"
    assert json.loads(stop_file.read_text())["step"] == 1
    assert not (tmp_path / "hf").exists()
