"""Runs test workers one after another in one torchrun launch and one process group, so torchrun's start-up and the
imports (10-15 s a launch on 2 cores) are paid once: `torchrun ... tests/distributed/shared_launch.py LISTING.json`,
where the listing (written by tests/conftest.py's `worker_listing`) holds, per worker, its `script` (a file beside
this one), `argv` and `out` directory.

A worker module has `parse(argv)` and `run(args)`, or `run(args, prepared)` with `prepared = prepare(args)`. Every
`prepare` runs first, before the process group and megatron's parallel state exist: transformers 5.12 leaves Qwen2's
rotary `inv_freq` buffer uninitialised in a model loaded after megatron's set-up, so the workers compute
transformers' references there.
A worker that raises leaves its traceback in `<out>/error.rank<R>.txt` and the next worker runs.

A process never frees a model it wrapped in megatron's DDP: the optimizer's parameter views reach, through autograd's
C++ nodes, the gradient hooks that hold the wrapper, a cycle Python's garbage collector cannot see. The model's gloo
groups stay alive with it, each with three threads that wake while idle: after the levers and model-family workers'
two dozen trained models, each process spent 17% of a core idle and the LoRA worker's runs took 3x as long. So the
workers that train many models (levers, families) keep launches of their own, and in conftest's `shared_launch` the
LoRA worker, the one that trains, runs first (its module is collected first).
"""

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAILED = object()


def attempt(worker: dict, step):
    """`step()`, or FAILED with the traceback written to the worker's `out`."""
    try:
        return step()
    except Exception:
        out = Path(worker["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"error.rank{os.environ.get('RANK', '0')}.txt").write_text(traceback.format_exc())
        print(f"[shared launch] {worker['script']} failed:\n{traceback.format_exc()}", flush=True)
        return FAILED


def main() -> None:
    workers = json.loads(Path(sys.argv[1]).read_text())
    modules = [importlib.import_module(Path(worker["script"]).stem) for worker in workers]  # this directory is on sys.path
    parsed = [module.parse(worker["argv"]) for module, worker in zip(modules, workers)]
    prepared = [attempt(worker, lambda: module.prepare(args)) if hasattr(module, "prepare") else None
                for worker, module, args in zip(workers, modules, parsed)]
    # One group for every worker (a second gloo group in one launch fails to connect); the loops and
    # `parallel.shutdown` leave up a group they did not create.
    dist.init_process_group("gloo")
    for worker, module, args, ready in zip(workers, modules, parsed, prepared):
        if ready is not FAILED:
            attempt(worker, lambda: module.run(args, ready) if hasattr(module, "prepare") else module.run(args))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
