"""The names of what a checkpoint directory holds, and where that directory is.

Layout under `ckpt.dir`:
    step_00000040/            one complete checkpoint
        model_and_optimizer/  every model chunk and the optimizer, sharded, reshardable over data parallelism:
                              DDP: megatron-core `dist_checkpointing` (torch_dist format);
                              Megatron-FSDP: its own DTensors through torch.distributed.checkpoint (fsdp_dtensor)
        rng/rank_00000.pt     every rank's RNG states (Python, NumPy, torch CPU and CUDA, megatron's tracker)
        trainer_state.pt      step, LR schedule, data position, resolved config, model fingerprint
    latest                    name of the newest complete checkpoint, replaced atomically last
"""

from pathlib import Path

LATEST = "latest"
PREFIX = "step_"
PARTIAL = ".partial-"
REPLACED = ".replaced-"
STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "model_and_optimizer"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after `step` optimizer steps."""
    return f"{PREFIX}{step:08d}"


def checkpoint_dir(config) -> Path:
    """`ckpt.dir`, defaulting to `<train.out_dir>/checkpoints`."""
    return Path(config.ckpt.dir or Path(config.train.out_dir) / "checkpoints")


def resume_arguments(config) -> str:
    """The arguments that continue this run from its latest checkpoint: with a `ckpt.dir` of its own, that too (the run
    directory does not name it)."""
    return "--resume-from-checkpoint latest" + (f" --ckpt.dir {config.ckpt.dir}" if config.ckpt.dir else "")
