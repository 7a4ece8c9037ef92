"""How a run ends part-way: what each process prints, and what it leaves for a resume."""

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]

# A run in which one rank alone meets a user's error mid-run (an environment whose service went away on its node),
# while rank 0 waits for it in a collective.
ONE_RANK_STOPS = """
import torch, torch.distributed as dist
from config import cli
from config.errors import UserError

def main(argv):
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        raise UserError("`grpo.environment`: Flaky() or its reset(row) raised ConnectionError: the service went away. "
                        "Fix the environment, or change `--grpo.environment`.")
    dist.all_reduce(torch.zeros(1))

cli.run_cli(main)
"""


@pytest.mark.slow
def test_a_user_error_on_one_rank_mid_run_is_its_paragraph_on_rank_0_not_a_peers_traceback():
    """A UserError raised on rank 1 alone after the process group is up: rank 1 prints nothing (rank 0 prints), and
    rank 0 stopped in its next collective with gloo's `Connection closed by peer` traceback (45 lines), the paragraph
    only in torchrun's failure summary. Now rank 0 prints rank 1's paragraph, with no traceback, and both exit 2.
    The two ranks meet in a store served as torchrun's agent serves it."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    ranks = [subprocess.Popen([sys.executable, "-c", ONE_RANK_STOPS], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(2)]
    said = [rank.communicate(timeout=120) for rank in ranks]
    del agent_store
    assert [rank.returncode for rank in ranks] == [2, 2], said
    assert "Traceback" not in said[0][1], said[0][1]
    assert said[0][1].strip() == (f"error: rank 1 (on {socket.gethostname()}) stopped: `grpo.environment`: Flaky() or "
                                  "its reset(row) raised ConnectionError: the service went away. Fix the environment, "
                                  "or change `--grpo.environment`.")
    assert said[1][1] == ""


def test_a_full_disk_under_metrics_jsonl_is_one_paragraph_and_closing_raises_nothing_more(tmp_path):
    """Rank 0's metrics.jsonl on a disk that fills mid-run: the row's flush raised OSError (ENOSPC), closing the file
    on the way out raised it again, and the run ended in two chained tracebacks (and the peers' gloo tracebacks). Now
    the write is one paragraph naming the file, the error and how to continue, and leaving the writer adds nothing."""
    import pytest

    from config.cli import parse_args
    from config.errors import UserError
    from config.loops import SFTConfig
    from trainer.metrics import MetricsWriter

    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        config, _ = parse_args(SFTConfig, [f"--train.out_dir={disk / 'run'}", "--train.steps=1000"], "trainer.sft")
        row = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "padding": "x" * 400}
        with pytest.raises(UserError) as raised:
            with MetricsWriter(config, True, 0) as writer:
                (disk / "fill").write_bytes(b"\0" * 60_000)  # another writer fills the disk
                for step in range(1, 1000):
                    writer.write({"step": step, **row})
        message = str(raised.value)
        assert message.startswith(f"Writing `{disk / 'run' / 'metrics.jsonl'}` failed at step ")
        # A resume onto the full disk: the kept rows are rewritten first (an OSError traceback at start-up before).
        with pytest.raises(UserError, match=r"failed at step 3: \[Errno 28\] No space left on device"):
            MetricsWriter(config, True, 3)
        assert "[Errno 28] No space left on device" in message
        assert f"`latest` in `{disk / 'run' / 'checkpoints'}`" in message and "--resume-from-checkpoint latest" in message
        assert raised.value.__context__ is None or not isinstance(raised.value.__context__, UserError)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_finished_run_whose_last_row_was_not_written_gets_it_back_from_its_checkpoint(tmp_path):
    """The last step's row is written after the export: when that write fails (a full disk, the paragraph above says
    to continue with `--resume-from-checkpoint latest`), the resume found the run finished and did nothing, and
    metrics.jsonl lacked the last step for good, though its checkpoint holds the row. Now a finished run's resume
    restores it, as a resume that trains does."""
    import json

    import torch

    from ckpt import checkpoint
    from config.cli import parse_args
    from config.loops import SFTConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    out_dir = tmp_path / "run"
    config, _ = parse_args(SFTConfig, [f"--train.out_dir={out_dir}", "--train.steps=2"], "trainer.sft")
    fingerprint = checkpoint.Checkpointer(config, "", model).fingerprint
    saved = out_dir / "checkpoints" / checkpoint.checkpoint_name(2)
    (saved / checkpoint.SHARDED_DIR).mkdir(parents=True)
    (saved / checkpoint.SHARDED_DIR / ".metadata").write_text("{}")
    (saved / "rng").mkdir()
    torch.save({"step": 2, "fingerprint": fingerprint, "metrics_row": {"step": 2, "loss": 0.5}},
               saved / checkpoint.STATE_FILE)
    (out_dir / "checkpoints" / checkpoint.LATEST).write_text(saved.name)
    (out_dir / "hf").mkdir()
    (out_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')

    assert checkpoint.Checkpointer(config, "latest", model).finished()
    assert [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
