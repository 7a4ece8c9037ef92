"""GRPO's embedded default starts from the default SFT's output; when it is missing, that SFT runs first.

It runs in the same processes and the same process group (`model.parallel.init_distributed` keeps the group
and lays out the model-parallel groups anew), so there is no second rendezvous that could fail. This module
sits above both loops, so that neither loop imports the other.
"""

from config.sections import DEFAULT_GRPO_START
from model import parallel
from trainer import sft
from trainer.metrics import log


def train_default_sft(grpo_config) -> None:
    """Run `trainer.sft` with its defaults (validated by `GRPOConfig.validate` already), writing `outputs/sft/hf`.

    GRPO has joined the process group already; afterwards the model-parallel groups and seeds are GRPO's again.
    """
    log.info("%s does not exist yet: running the default SFT first (as `torchrun -m trainer.sft` would)", DEFAULT_GRPO_START)
    sft.main([])
    parallel.init_distributed(grpo_config.parallel, grpo_config.train.seed)
