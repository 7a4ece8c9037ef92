"""Runs test workers one after another in one torchrun launch and one process group, so torchrun's start-up and the
imports (10-15 s a launch on 2 cores) are paid once: `torchrun ... tests/distributed/shared_launch.py LISTING.json`,
where the listing (written by tests/conftest.py's `worker_listing`) holds, per worker, its `script` (a file beside
this one), `argv` and `out` directory.

A worker module has `parse(argv)` and `run(args)`, or `run(args, prepared)` with `prepared = prepare(args)`. Every
`prepare` runs first, before the process group and megatron's parallel state exist: transformers 5.12 leaves Qwen2's
rotary `inv_freq` buffer uninitialised in a model loaded after megatron's set-up, so the workers compute
transformers' references there.
A worker that raises leaves its traceback in `<out>/error.rank<R>.txt` and the next worker runs.

After each worker, `release_models` frees what it built. Left alone, a process keeps every model it wrapped in
megatron's DDP: the optimizer's parameter views reach, through autograd's C++ nodes, the gradient hooks that hold the
wrapper, and the model's config holds the optimizer's loss scaling, a cycle Python's garbage collector cannot see.
With each model its gloo groups stay alive (megatron's `destroy_model_parallel` only forgets them), three threads each
that wake while idle, so every later worker ran slower the more models the earlier ones had trained (without this,
the six workers' launch took longer than their six launches apart).
"""

import gc
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d

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


def release_models() -> None:
    """Free every model the finished work trained, and every process group but the default one (see above). Run
    `import_bridge` first. Not after a Megatron-FSDP run: a later one in the same process reaches the old
    groups again through the device meshes it finds ("Could not resolve the process group")."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer import TransformerConfig

    from model.wrapping import TRAINING_HOOKS

    for thing in gc.get_objects():
        try:
            is_ddp, is_config = isinstance(thing, DistributedDataParallel), isinstance(thing, TransformerConfig)
        except ReferenceError:  # a weak proxy whose object is gone (the interleaved pipeline schedule leaves some)
            continue
        if is_ddp:
            thing.grad_accs.clear()
        elif is_config:
            for hook in TRAINING_HOOKS:
                setattr(thing, hook, None)
    # megatron-core caches rotary embeddings' forward per module (`functools.lru_cache` on the method, 32 calls): the
    # cache held each run's rotary module and, through its `cp_group`, one gloo group with its three threads, so a
    # launch of 89 runs held 650 threads, tens of them runnable at once (sys time 20-40 %).
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    rotary_pos_embedding.RotaryEmbedding.forward.cache_clear()
    yarn_rotary_pos_embedding.YarnRotaryEmbedding.forward.cache_clear()
    # Mixture-of-Experts: megatron-core keeps every router's replay object in a class-level list (which reached the
    # routers through our routing records: a whole model and 18 gloo groups, 54 threads, a run) and the last routers'
    # groups in its metrics tracker.
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    moe_logging.set_moe_metrics_tracker(None)
    gc.collect()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # ... and destroy_model_parallel leaves two of its globals set (the intra-partial data-parallel groups with CP).
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    for group in list(distributed_c10d._world.pg_map):
        if group is not distributed_c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)
    gc.collect()
    # What is left lives as long as the process (modules a run imported, tokenizers, data caches): out of the
    # collector's sight, as model.providers.freeze_imported_objects does with the imports, each later collection scans only
    # what the next run makes (each release took 1.3-2.6 s of collections after 54 runs in one launch).
    gc.freeze()


def import_bridge() -> None:
    """Import Megatron-Bridge before any work: something it imports keeps an exception raised on the way, and with it
    every frame above the import, so a loop's model in those frames would stay in memory."""
    from model import lora

    lora.allow_import_without_te()
    import megatron.bridge  # noqa: F401

    from model.providers import freeze_imported_objects

    # As a loop does after the same import: `release_models`' object scan and collections then skip the imports' objects.
    freeze_imported_objects()


def main() -> None:
    import_bridge()
    workers = json.loads(Path(sys.argv[1]).read_text())
    modules = [importlib.import_module(Path(worker["script"]).stem) for worker in workers]  # this directory is on sys.path
    parsed = [module.parse(worker["argv"]) for module, worker in zip(modules, workers)]
    started = time.perf_counter()
    prepared = [attempt(worker, lambda: module.prepare(args)) if hasattr(module, "prepare") else None
                for worker, module, args in zip(workers, modules, parsed)]
    # One group for every worker (a second gloo group in one launch fails to connect); the loops and
    # `parallel.shutdown` leave up a group they did not create.
    dist.init_process_group("gloo")
    # Where the launch's time goes, beside the listing (rank 0): seconds per worker, after each.
    seconds = {"prepare": round(time.perf_counter() - started, 1)}
    timings = Path(sys.argv[1]).with_name("seconds.json")
    for worker, module, args, ready in zip(workers, modules, parsed, prepared):
        started = time.perf_counter()
        if ready is not FAILED:
            attempt(worker, lambda: module.run(args, ready) if hasattr(module, "prepare") else module.run(args))
        dist.barrier()
        release_models()
        seconds[Path(worker["out"]).name] = round(time.perf_counter() - started, 1)
        if dist.get_rank() == 0:
            timings.write_text(json.dumps(seconds))
            print(f"[shared launch] {worker['script']} took {seconds[Path(worker['out']).name]} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
