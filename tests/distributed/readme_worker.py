"""Runs the README's torchrun commands (paths already substituted by tests/test_readme_commands.py) one after another
in one process group, as `torchrun -m trainer.sft|grpo ARGS` would: SFT commands first (GRPO's read their output).

Each command is first validated as written (its own process count), then run for two steps with the smoke settings
the test appends. Rank 0 writes, per command, the first metrics row of step 1 it logged.
"""

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

from config import cli
from config.sections import GRPOConfig, SFTConfig
from trainer import grpo, sft

LOOPS = {"trainer.sft": (SFTConfig, sft.main), "trainer.grpo": (GRPOConfig, grpo.main)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commands", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    commands = json.loads(Path(args.commands).read_text())
    # The process group outlives every command (each loop keeps a group it did not create, as GRPO's default start does).
    dist.init_process_group("gloo")
    results = []
    for command in sorted(commands, key=lambda command: command["module"] != "trainer.sft"):
        os.chdir(command["cwd"])
        os.environ.update(command["env"])
        config_class, loop = LOOPS[command["module"]]
        config, _ = cli.parse_args(config_class, command["argv"], command["module"])
        config.validate(command["world_size"])  # as written: the README's own process count and settings
        loop(command["argv"] + command["smoke"])
        config, _ = cli.parse_args(config_class, command["argv"] + command["smoke"], command["module"])
        metrics = Path(config.train.out_dir) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        results.append({"line": command["line"], "step1": next((row for row in rows if row["step"] == 1), None)})
        dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
