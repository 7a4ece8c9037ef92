"""`torchrun -m trainer.grpo` end to end on CPU: the default run raises the reward without losing held-out
accuracy, and bad inputs (unknown reward, over-long prompts, a raising reward) end clearly or are counted."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, torchrun

pytestmark = pytest.mark.distributed

# A shorter SFT than the embedded default's, to keep CI time down; GRPO then runs with its own defaults.
SFT_STEPS = 200


def metrics(out_dir) -> list[dict]:
    """Rows of metrics.jsonl."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """A policy to start GRPO from: the SFT entry point, as a user runs it, with fewer steps."""
    out_dir = tmp_path_factory.mktemp("sft")
    torchrun(["-m", "trainer.sft", f"--train.out_dir={out_dir}", f"--train.steps={SFT_STEPS}", "--train.eval_samples=0"],
             nproc=2, timeout=600)
    return out_dir / "hf"


def test_default_run_raises_reward_and_keeps_held_out_accuracy(sft_checkpoint, tmp_path):
    """The embedded default as a user starts it; only the starting checkpoint and the output directory moved."""
    torchrun(["-m", "trainer.grpo", f"--model.path={sft_checkpoint}", f"--train.out_dir={tmp_path}"], nproc=2, timeout=600)
    rows = metrics(tmp_path)
    steps = [row for row in rows if "reward_mean" in row]
    evaluations = [row for row in rows if "eval_accuracy" in row]
    rewards = [row["reward_mean"] for row in steps]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    before, after = evaluations[0]["eval_accuracy"], evaluations[-1]["eval_accuracy"]
    print(f"default GRPO: reward first 10 steps {first:.3f} -> last 10 {last:.3f}; held-out greedy accuracy "
          f"{before:.3f} -> {after:.3f}; rollout {steps[-1]['rollout_tokens_per_s']:.0f} tokens/s")
    contract = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "reward_mean", "accuracy", "kl",
                "entropy", "clip_frac", "response_len", "rollout_tokens_per_s", "reward_errors", "zero_advantage_groups"}
    assert contract <= set(steps[0])
    assert len(steps) == 40 and evaluations[0]["step"] == 0 and evaluations[-1]["step"] == 40
    assert last - first >= 0.15
    assert after >= before
    assert all(row["reward_errors"] == 0 for row in steps)
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


def run_single_process(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m trainer.grpo ARGS` (one process, as the contract allows), for start-up errors."""
    return subprocess.run([sys.executable, "-m", "trainer.grpo", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_unknown_reward_is_a_start_up_error(tmp_path):
    result = run_single_process(["--grpo.reward=gsm9k", f"--train.out_dir={tmp_path}"])
    assert result.returncode == 2
    assert "`grpo.reward=gsm9k` is not a known reward function; known ones are arithmetic, gsm8k, gsm8k_flexible" in result.stderr
    assert "Traceback" not in result.stderr


def test_prompts_longer_than_the_context_are_a_start_up_error(sft_checkpoint, tmp_path):
    # Every bundled prompt is 26-33 tokens; 40 - 32 new tokens leaves room for none.
    result = run_single_process([f"--model.path={sft_checkpoint}", "--data.max_seq_len=40", f"--train.out_dir={tmp_path}"])
    assert result.returncode == 2
    assert "leaves no room for `grpo.max_new_tokens=32` within `data.max_seq_len=40`" in result.stderr


def test_raising_reward_and_long_prompts_are_counted_not_fatal(sft_checkpoint, tmp_path, monkeypatch):
    """A user reward (`module:function`) that raises on some completions scores them 0; some prompts are skipped."""
    (tmp_path / "fragile_reward.py").write_text(
        "from data.rewards import arithmetic\n\n"
        "def fragile(completion, reference):\n"
        "    if len(completion) % 2:\n"
        "        raise ValueError('cannot handle odd lengths')\n"
        "    return arithmetic(completion, reference)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    # 62 - 32 new tokens = 30: the bundled prompts of 31-33 tokens (about a quarter) are skipped and counted.
    result = torchrun(["-m", "trainer.grpo", f"--model.path={sft_checkpoint}", f"--train.out_dir={tmp_path / 'run'}",
                       "--grpo.reward=fragile_reward:fragile", "--data.max_seq_len=62", "--train.steps=3",
                       "--train.global_batch_size=32", "--train.micro_batch_size=16", "--train.eval_samples=20"], nproc=2)
    skipped = [line for line in result.stdout.splitlines() if line.startswith("prompts arithmetic (train)")]
    assert skipped and " 0 skipped" not in skipped[0], result.stdout[-3000:]
    steps = [row for row in metrics(tmp_path / "run") if "reward_errors" in row]
    assert len(steps) == 3
    assert sum(row["reward_errors"] for row in steps) > 0
