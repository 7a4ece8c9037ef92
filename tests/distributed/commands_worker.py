"""Runs several `trainer.sft|grpo ARGS` commands one after another in one process group, as `torchrun -m trainer.X
ARGS` would each, so a test pays torchrun's start-up once: SFT commands first (GRPO's may read their output).

Each command (a JSON object: `module`, `argv`, and optionally `cwd` or `cwd_per_rank`, `env`, `world_size`, `smoke`,
`expect_error`, `checksums`, `megatron_fsdp_last`) is first validated as written (at `world_size`, default this launch's), then run with its `smoke`
arguments appended (the README test's two-step settings), in its own directory and environment. Rank 0 writes, per
command and in the order listed (after each command, so a failure keeps what ran before it), the first metrics row of step 1
it logged, what the command logged (the lines a `torchrun -m trainer.X` launch of it alone would print), with
`expect_error` the one-paragraph error it stopped with (as `run_cli` prints it), and with `checksums` every rank's
checksum of the parameters tensor parallelism replicates (norms, biases: each TP rank holds them whole). After each
command what it built is freed with its process groups (shared_launch.release_models), as its own process's exit would,
until a command has used Megatron-FSDP: a later run in the process reaches its groups again.
"""

import argparse
import contextlib
import io
import itertools
import json
import logging
import os
import shlex
import time
import traceback
from pathlib import Path

import hashlib

import torch.distributed as dist

from ckpt.signals import catch_stop_signals
from config import cli
from config.errors import UserError
from config.loops import GRPOConfig, RMConfig, SFTConfig
from shared_launch import import_bridge, release_models  # beside this file (the script's directory is on sys.path)
from trainer import grpo, rm, sft

REGROUPS = itertools.count()  # the launch's group made again after an asynchronous GRPO run, each time under new keys
LOOPS = {"trainer.sft": (SFTConfig, sft.main), "trainer.grpo": (GRPOConfig, grpo.main), "trainer.rm": (RMConfig, rm.main)}


def replicated_checksum(policy) -> str:
    """SHA-256 of this rank's parameters that tensor parallelism does not split (each TP peer holds them whole); expert
    weights are left out (with expert parallelism the TP peers may hold different experts)."""
    digest = hashlib.sha256()
    for name, param in policy.chunks[0].named_parameters():
        if not getattr(param, "tensor_model_parallel", False) and getattr(param, "allreduce", True):
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


@contextlib.contextmanager
def working_directory(command: dict):
    """In the command's directory (`cwd`, or per rank `cwd_per_rank`: a relative path then names another directory on
    each rank, as a node-local directory does on each node), with its `env`; both restored afterwards, so no command
    sees another's."""
    start, environment = os.getcwd(), dict(os.environ)
    os.chdir(command["cwd_per_rank"][dist.get_rank()] if "cwd_per_rank" in command else command.get("cwd", start))
    os.environ.update(command.get("env", {}))
    try:
        yield
    finally:
        os.chdir(start)
        os.environ.clear()
        os.environ.update(environment)


def forget_stop_signals() -> None:
    """A stop signal ends the command it came in, as it would that command's own process: the next starts unsignalled."""
    preemption = catch_stop_signals()
    preemption.requested = preemption.requested_anywhere = False
    preemption.first_signal_at = None


def run_command(command: dict) -> tuple[dict, bool]:
    """Validate the command as written, run it with its smoke arguments; its result (see the module's docstring), and
    whether it trained under Megatron-FSDP."""
    smoke = command.get("smoke", [])
    config_class, loop = LOOPS[command["module"]]
    with working_directory(command):
        config, _ = cli.parse_args(config_class, command["argv"], command["module"])
        config.validate(command.get("world_size", dist.get_world_size()))  # as written: e.g. the README's own process count
        captured = logging.StreamHandler(io.StringIO())  # beside the console's: the loops' loggers propagate to the root
        logging.getLogger().addHandler(captured)
        error, policy = None, None
        # Asynchronous GRPO makes each side's default group itself, as its own launch would: the launch's is set aside.
        own_world = getattr(getattr(config, "grpo", None), "rollout_processes", 0) > 0
        if own_world:
            dist.destroy_process_group()
        try:
            policy = loop(command["argv"] + smoke)
        except UserError as raised:
            if not command.get("expect_error"):
                raise
            error = " ".join(str(raised).split())
        finally:
            logging.getLogger().removeHandler(captured)
            if own_world:  # the launch's group again, under keys of its own (the first one's are stale in the store)
                store, rank, world_size = next(dist.rendezvous("env://"))
                dist.init_process_group("gloo", store=dist.PrefixStore(f"launch-group-{next(REGROUPS)}/", store),
                                        rank=rank, world_size=world_size)
        config, _ = cli.parse_args(config_class, command["argv"] + smoke, command["module"])
        metrics = Path(config.train.out_dir) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    checksums = None
    if command.get("checksums"):
        checksums = [None] * dist.get_world_size()
        dist.all_gather_object(checksums, replicated_checksum(policy))
    return ({"line": command.get("line", shlex.join([command["module"], *command["argv"]])),
             "step1": next((row for row in rows if row["step"] == 1), None), "log": captured.stream.getvalue(),
             "error": error, "checksums": checksums}, config.parallel.use_megatron_fsdp)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commands", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    commands = json.loads(Path(args.commands).read_text())
    import_bridge()
    # The process group outlives every command (each loop keeps a group it did not create, as GRPO's default start does).
    dist.init_process_group("gloo")
    # SFT before GRPO (GRPO's may read an SFT's output), otherwise as listed; the Megatron-FSDP runs conftest marks
    # `megatron_fsdp_last` after every other (their groups cannot be freed), SFT first among them too. Results are
    # written as listed, after each command (a failure keeps those before).
    order = sorted(range(len(commands)), key=lambda index: (commands[index].get("megatron_fsdp_last", False),
                                                            commands[index]["module"] != "trainer.sft"))
    results, fsdp_used = [None] * len(commands), False
    for index in order:
        started = time.perf_counter()
        try:
            results[index], fsdp = run_command(commands[index])
        except BaseException:  # each rank's own traceback, for the test's failure message (torchrun's output keeps one)
            Path(f"{args.out}.error.rank{dist.get_rank()}.txt").write_text(
                f"{shlex.join([commands[index]['module'], *commands[index]['argv']])}\n{traceback.format_exc()}")
            raise
        fsdp_used = fsdp_used or fsdp
        forget_stop_signals()
        dist.barrier()
        ran = time.perf_counter()
        if not fsdp_used:  # a Megatron-FSDP run's groups cannot be freed for a later run (conftest puts FSDP runs last)
            release_models()
        seconds = results[index]["seconds"] = {"run": round(ran - started, 2), "release": round(time.perf_counter() - ran, 2)}
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(results))
            print(f"command took {seconds['run']} s ({seconds['release']} s to free it): {results[index]['line'][:300]}",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
