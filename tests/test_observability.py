"""Watching a run: TensorBoard and W&B carry metrics.jsonl's scalars, metrics.png and scripts/plot_metrics.py draw them,
GRPO writes sampled completions, and the Slurm script trains, stops on SIGTERM and resumes when requeued.

One short SFT run (TensorBoard and offline W&B on) and one short GRPO run from its output are shared by the tests.
"""

import json
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from config.cli import parse_args
from config.errors import UserError
from config.loops import SFTConfig
from tests.conftest import EAGER, REPO, free_port, launch
from trainer import plots

pytestmark = pytest.mark.distributed

# Long enough for the Slurm test's SIGTERM to land mid-run; evaluation on 8 held-out prompts gives the held-out panels.
SFT = ["-m", "trainer.sft", "--train.steps=16", "--train.global_batch_size=8", "--train.micro_batch_size=4",
       "--train.eval_samples=8", "--optim.warmup_steps=2", "--train.log_interval=4"]
SFT_PANELS = ["training loss", "learning rate", "grad norm", "held-out loss", "held-out accuracy",
              "an SFT step's time by phase (s)", "time between steps (s)"]
GRPO_PANELS = ["training loss", "learning rate", "grad norm", "held-out accuracy", "reward", "rollout accuracy",
               "KL to the reference", "entropy", "response length (tokens)", "a GRPO step's time by phase (s)",
               "time between steps (s)", "rollout/training log-prob gap"]


def metrics(out_dir) -> list[dict]:
    """Rows of metrics.jsonl."""
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def jsonl_scalars(out_dir) -> dict[str, dict[int, float]]:
    """key -> {step: value} of every number in metrics.jsonl (what the loggers must carry)."""
    scalars = {}
    for row in metrics(out_dir):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars.setdefault(key, {})[row["step"]] = value
    return scalars


def tensorboard_events(out_dir):
    """TensorBoard's own reader over `<out_dir>/tb`, every event kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(out_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def wandb_records(out_dir) -> list:
    """The records of the offline W&B run under `<out_dir>/wandb` (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    (run_file,) = (out_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, block, position, pending, records = run_file.read_bytes(), 32768, 7, b"", []  # 7: the file header
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a record header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def launches(tmp_path_factory):
    """The short SFT run, with TensorBoard and W&B (offline) on; then a short GRPO run (one process) from its output,
    with TensorBoard on, and one on two processes with dynamic sampling (in conftest's `joint_launches`). Returns the
    three output directories."""
    sft_dir, grpo_dir = tmp_path_factory.mktemp("sft"), tmp_path_factory.mktemp("grpo")
    yield launch([{"module": "trainer.sft", "env": {"WANDB_MODE": "offline"},
                   "argv": [*SFT[2:], f"--train.out_dir={sft_dir}", "--log.tensorboard=true", "--log.wandb=true",
                            "--log.wandb_project=observability-test", "--log.wandb_name=short-sft"]}])
    # Two data-parallel ranks with dynamic sampling, from the SFT's output, rank 0's reward slower (the rank wait's test).
    waits_dir = tmp_path_factory.mktemp("grpo-rank-wait")
    yield launch([{"module": "trainer.grpo", "env": {"PYTHONPATH": str(REPO)}, "argv": [
        f"--model.path={sft_dir / 'hf'}", "--train.steps=2", "--train.global_batch_size=32", "--train.micro_batch_size=16",
        "--grpo.max_new_tokens=16", "--train.eval_samples=0", "--grpo.reward=tests.tool_fixtures:parity_slow_on_rank_zero",
        "--grpo.reward_timeout=0", "--grpo.dynamic_sampling=true", "--grpo.max_sampling_rounds=3",
        f"--train.out_dir={waits_dir}"]}])
    yield launch([{"module": "trainer.grpo", "argv": [
        f"--model.path={sft_dir / 'hf'}", "--train.steps=3", "--train.global_batch_size=16", "--train.micro_batch_size=8",
        "--grpo.max_new_tokens=16", "--train.eval_samples=4", "--train.log_interval=2", "--log.tensorboard=true",
        f"--train.out_dir={grpo_dir}"]}], nproc=1)
    return sft_dir, grpo_dir, waits_dir


@pytest.fixture(scope="module")
def sft_run(joint_launches):
    return joint_launches[__name__][0]


@pytest.fixture(scope="module")
def grpo_run(joint_launches):
    return joint_launches[__name__][1]


@pytest.fixture(scope="module")
def rank_wait_run(joint_launches):
    return joint_launches[__name__][2]


# ---------------------------------------------------------------- loggers


@pytest.mark.parametrize("run", ["sft_run", "grpo_run"])
def test_tensorboard_scalars_equal_metrics_jsonl(run, request):
    out_dir = request.getfixturevalue(run)
    expected = jsonl_scalars(out_dir)
    events = tensorboard_events(out_dir)
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, by_step in expected.items():
        logged = {event.step: event.value for event in events.Scalars(key)}
        # Event files store float32.
        assert logged == {step: float(np.float32(value)) for step, value in by_step.items()}, key
    assert len(expected["loss"]) == max(expected["loss"])  # every step


def test_wandb_offline_run_holds_the_final_scalars(sft_run):
    records = wandb_records(sft_run)
    run = next(record.run for record in records if record.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name) == ("observability-test", "short-sft")
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            history[record.history.step.num] = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                                for item in record.history.item}
    final_row = metrics(sft_run)[-1]
    final = history[final_row["step"]]
    for key, value in final_row.items():
        if key != "step" and value is not None:
            assert final[key] == value, key
    assert sorted(history) == [row["step"] for row in metrics(sft_run)]


def test_wandb_switched_on_but_missing_is_a_clean_error_before_any_work(tmp_path, monkeypatch):
    config, _ = parse_args(SFTConfig, ["--log.wandb=true"], "trainer.sft")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(UserError, match="`log.wandb=true` needs Weights & Biases, which is not installed"):
        config.validate(world_size=1)
    # The entry point as a user runs it: one paragraph, exit 2, nothing loaded or written.
    out_dir = tmp_path / "run"
    script = ("import runpy, sys; sys.modules['wandb'] = None; "
              f"sys.argv = ['trainer.sft', '--log.wandb=true', '--train.out_dir={out_dir}']; "
              "runpy.run_module('trainer.sft', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("error: `log.wandb=true` needs Weights & Biases") and result.stderr.count("\n") == 1
    assert "uv sync --extra wandb" in result.stderr
    assert "data arithmetic" not in result.stdout and not out_dir.exists()


def test_grpo_rank_wait_holds_the_wait_after_every_sampling_round(rank_wait_run):
    """Dynamic sampling's ranks agree after each round whether another is needed; a rank whose round ended first waits
    there for the others, and `rank_wait_time_s` says so. Rank 0's reward sleeps 30 ms a completion (16 a round), so
    rank 1 waits about 0.48 s a round: the mean over the two ranks about 0.24 s. Before, those waits were in no phase:
    rank_wait_time_s 0.0009-0.0010 s at 1 and 2 rounds (20 ms a completion), the phases 0.73-0.75 of the step; after,
    0.17 and 0.35 s, the phases 0.998-0.999 of it."""
    steps = [row for row in metrics(rank_wait_run) if "loss" in row]
    phases = ("rollout_time_s", "reward_time_s", "pi_old_time_s", "reference_time_s", "update_time_s", "rank_wait_time_s")
    print("rounds, rank wait, phases' share of the step:", [(row["sampling_rounds"], round(row["rank_wait_time_s"], 4),
          round(sum(row[key] for key in phases) / row["step_time_s"], 3)) for row in steps])
    assert len(steps) == 2
    # Half the expected wait: a loaded machine's scheduler can slow rank 1 too (its own rounds then take longer).
    assert all(row["rank_wait_time_s"] >= 0.12 * row["sampling_rounds"] for row in steps)


def test_grpo_writes_sampled_completions(grpo_run):
    rows = [json.loads(line) for line in (grpo_run / "samples.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [1, 2, 3]  # the first step, every log_interval, the last
    assert all({"step", "prompt", "completion", "reward", "advantage", "reference"} <= set(row) for row in rows)
    assert all(isinstance(row["advantage"], float) and "reward_model_score" not in row for row in rows)
    assert all(isinstance(row["reward"], float) and row["prompt"] and "####" in row["reference"] for row in rows)
    assert "samples/text_summary" in tensorboard_events(grpo_run).Tags()["tensors"]


# ---------------------------------------------------------------- pictures


def png_text(path) -> dict:
    """A PNG's text chunks, after checking that it is one."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()  # chunk checksums
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 800 and image.height > 400
        return dict(image.text)


def test_metrics_png_has_each_loops_panels(sft_run, grpo_run):
    for out_dir, panels in ((sft_run, SFT_PANELS), (grpo_run, GRPO_PANELS)):
        assert [axes.get_title() for axes in plots.figure([out_dir]).axes] == panels
        assert png_text(out_dir / "metrics.png")["Description"] == "panels: " + "; ".join(panels)


def test_a_panel_with_more_series_than_line_styles_draws_and_names_each(tmp_path, recwarn):
    """The tool-failure panel has eight keys and there are three line styles: every key is drawn, looks its own, and has
    its legend entry (matplotlib warns when a legend has fewer handles than labels)."""
    keys = dict(plots.PANELS)["tool failures per step"]
    rows = [{"step": step, "loss": 1.0, **{key: index + step for index, key in enumerate(keys)}} for step in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    axes = next(axes for axes in plots.figure([tmp_path]).axes if axes.get_title() == "tool failures per step")
    labels = [plots.KEY_LABELS[key] for key in keys]
    looks = {line.get_label(): (line.get_linestyle(), line.get_marker()) for line in axes.get_lines()}
    assert sorted(looks) == sorted(labels) and len(set(looks.values())) == len(keys)
    legend = axes.get_legend()
    assert [text.get_text() for text in legend.get_texts()] == labels
    assert len({(handle.get_linestyle(), handle.get_marker()) for handle in legend.legend_handles}) == len(keys)
    assert [str(warning.message) for warning in recwarn] == []


def test_plot_metrics_overlays_runs(sft_run, grpo_run, tmp_path):
    out = tmp_path / "overlay.png"
    result = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(sft_run), str(grpo_run), "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    both = [title for title, _ in plots.PANELS if title in SFT_PANELS + GRPO_PANELS]  # in the panels' own order
    assert png_text(out)["Description"] == "panels: " + "; ".join(both)
    figure = plots.figure([sft_run, grpo_run])
    assert [text.get_text() for text in figure.legends[0].get_texts()] == [sft_run.name, grpo_run.name]
    loss_axes = next(axes for axes in figure.axes if axes.get_title() == "training loss")
    assert {line.get_color() for line in loss_axes.get_lines() if len(line.get_xdata())} == {"C0", "C1"}


# ---------------------------------------------------------------- Slurm


FAKE_SRUN = """#!/bin/bash
# srun on one machine: logs its options, then runs the command once per simulated node, in parallel (with
# FAKE_NODE_DIRS set, each in its own working directory node0/, node1/, ...: what a node holds of its own). Like srun,
# which passes a SIGTERM on to the step's tasks and waits for them, it outlives the SIGTERM the test sends.
options=()
while [[ $# -gt 0 && $1 == -* ]]; do options+=("$1"); shift; done
echo "srun ${options[*]}" >> "$FAKE_SLURM_LOG"
trap '' TERM
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  (trap - TERM; [ -n "${FAKE_NODE_DIRS:-}" ] && cd "node$node"; SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 exec "$@") &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
  show) echo 127.0.0.1 ;;
  requeue) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
esac
"""
FAKE_SRUN_CALL = "srun --ntasks-per-node=1 --kill-on-bad-exit=1 --label --cpus-per-task=4\n"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"


def fake_slurm(tmp_path) -> dict:
    """The environment of a job under a simulated Slurm (job 4242, two 'nodes' of one process, c10d on 127.0.0.1):
    stand-ins for srun and scontrol first on PATH, both logging their calls to `tmp_path / "slurm.log"`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, **EAGER, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "4",
            "SLURM_SUBMIT_DIR": str(REPO), "NPROC_PER_NODE": "1", "RDZV_PORT": str(free_port()),
            "FAKE_SLURM_LOG": str(tmp_path / "slurm.log")}


def losses(out_dir) -> dict[int, float]:
    """step -> training loss."""
    return {row["step"]: row["loss"] for row in metrics(out_dir) if "loss" in row}


def test_slurm_script_trains_stops_on_sigterm_and_resumes_when_requeued(sft_run, tmp_path):
    """The sbatch script under a simulated Slurm: Slurm's time-limit SIGTERM to every process of the step, the stop
    file the trainer writes after saving, `scontrol requeue`, then the requeued job; its losses equal the straight
    run's (`sft_run`)."""
    out_dir, slurm_log, stop_file = tmp_path / "run", tmp_path / "slurm.log", tmp_path / "logs" / ".stopped-4242"
    env = {**fake_slurm(tmp_path), "OUT_DIR": str(out_dir)}
    command = ["bash", str(SBATCH), *SFT]

    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and job.poll() is None:
        rows = metrics(out_dir) if (out_dir / "metrics.jsonl").exists() else []
        if any(row["step"] >= 2 and "loss" in row for row in rows):
            # Slurm's --signal: every process of the job step (the torchrun agents and their workers).
            for process in psutil.Process(job.pid).children(recursive=True):
                if process.name() != "bash":
                    process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    output, _ = job.communicate(timeout=600)
    assert job.returncode == 0, output[-4000:]
    assert slurm_log.read_text() == FAKE_SRUN_CALL + "requeue 4242\n", output[-4000:]
    stopped_at = max(losses(out_dir))
    assert 2 <= stopped_at < 16 and "stopping at step" in output
    assert (out_dir / "checkpoints" / "latest").read_text() == f"step_{stopped_at:08d}"
    # The script read the stop file (printed in its requeue line) and removed it.
    (line,) = [line for line in output.splitlines() if "requeueing job 4242" in line]
    stop = json.loads(line[line.index("{") : line.rindex("}") + 1])
    assert stop["step"] == stopped_at and stop["reason"] == "signal" and os.path.exists(stop["checkpoint"])
    assert not stop_file.exists()

    requeued = subprocess.run(command, cwd=tmp_path, env={**env, "SLURM_RESTART_COUNT": "1", "RDZV_PORT": str(free_port())},
                              capture_output=True, text=True, timeout=600)
    assert requeued.returncode == 0, requeued.stdout[-4000:] + requeued.stderr[-4000:]
    assert "resumed from" in requeued.stdout and "the run finished, not requeueing" in requeued.stdout
    assert slurm_log.read_text() == FAKE_SRUN_CALL + "requeue 4242\n" + FAKE_SRUN_CALL
    assert losses(out_dir) == losses(sft_run)


def test_slurm_script_requeues_neither_a_crash_nor_past_max_requeues(tmp_path):
    """A run that fails after starting (a data file that one node lacks: the workers exit 2, the other node's as soon as
    the first has, with its paragraph, not after `parallel.timeout_minutes` in `init_process_group`) is not requeued,
    even with a stale stop file from an earlier start of the job, and the job ends non-zero. A signal stop (a stand-in torchrun
    that writes the stop file and exits 1, as the agent may after forwarding the signal) is requeued with exit 0,
    until the job has been requeued MAX_REQUEUES times: then it is not, and the job exits 1."""
    slurm_log, stop_file = tmp_path / "slurm.log", tmp_path / "logs" / ".stopped-4242"
    env = {**fake_slurm(tmp_path), "OUT_DIR": str(tmp_path / "run")}
    stop_file.parent.mkdir()
    stop_file.write_text('{"step": 1, "checkpoint": "stale", "reason": "signal"}\n')
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
    (tmp_path / "node0" / "train.jsonl").write_text("".join(json.dumps({"question": f"{n}+1?", "answer": f"#### {n + 1}"})
                                                            + "\n" for n in range(16)))
    crash = subprocess.run(["bash", str(SBATCH), *SFT, "--data.path=train.jsonl"], cwd=tmp_path,
                           env={**env, "FAKE_NODE_DIRS": "1"}, capture_output=True, text=True, timeout=600)
    assert crash.returncode != 0 and "no stop file: the run failed, not requeueing job 4242" in crash.stdout, crash.stdout
    assert "data.path points to 'train.jsonl', which does not exist" in crash.stderr, crash.stderr[-4000:]
    assert "stopped at start-up: " in crash.stderr, crash.stderr[-4000:]  # the node that had the file, told
    assert slurm_log.read_text() == FAKE_SRUN_CALL and not stop_file.exists()

    # Submitted from outside the repository (sbatch runs a copy of the script, so the repository is the submit
    # directory): one paragraph naming TRAINER_DIR, before srun starts anything (it failed on every node with
    # `execve(): .../.venv/bin/torchrun: No such file or directory`).
    elsewhere = subprocess.run(["bash", str(SBATCH), *SFT], cwd=tmp_path, env={**env, "SLURM_SUBMIT_DIR": str(tmp_path)},
                               capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == 2 and slurm_log.read_text() == FAKE_SRUN_CALL, elsewhere.stdout + elsewhere.stderr
    assert elsewhere.stderr.startswith(f"error: {tmp_path}/.venv/bin/torchrun does not exist") and "TRAINER_DIR=" in elsewhere.stderr
    assert elsewhere.stderr.count("\n") == 1

    fake_trainer = tmp_path / "fake-trainer"
    (fake_trainer / ".venv" / "bin").mkdir(parents=True)
    (fake_trainer / ".venv" / "bin" / "torchrun").write_text(
        '#!/bin/bash\n[ "$SLURM_PROCID" = 0 ] && echo \'{"step": 7, "checkpoint": "ckpt", "reason": "signal"}\' '
        '> "$TRAINER_STOP_FILE"\nexit 1\n')
    (fake_trainer / ".venv" / "bin" / "torchrun").chmod(0o755)
    env = {**env, "TRAINER_DIR": str(fake_trainer), "MAX_REQUEUES": "2"}
    for restarts, returncode, calls in (("1", 0, "requeue 4242\n"), ("2", 1, "")):
        slurm_log.unlink()
        stopped = subprocess.run(["bash", str(SBATCH), *SFT], cwd=tmp_path, env={**env, "SLURM_RESTART_COUNT": restarts},
                                 capture_output=True, text=True, timeout=60)
        assert stopped.returncode == returncode, stopped.stdout + stopped.stderr
        assert slurm_log.read_text() == FAKE_SRUN_CALL + calls and not stop_file.exists()
        assert '"step": 7' in stopped.stdout and ("MAX_REQUEUES=2" in stopped.stdout) == (returncode == 1)
