"""Where this process sits among torchrun's, read from the environment torchrun sets (valid before and after the
process group starts; a process started without torchrun is rank 0)."""

import os


def is_global_rank_zero() -> bool:
    """Whether this is global rank 0, the one process that writes shared files and prints."""
    return int(os.environ.get("RANK", "0")) == 0
