"""The run's exports after its last step (`hf/`, with LoRA `hf_adapter/`): written whole, or one paragraph.

After the last step the run's exports (`config.outputs.EXPORTS`: `hf/`, with LoRA `hf_adapter/`) are written into
`.partial-NAME/` and renamed when complete, so a directory named `hf` is whole; a resumed run that finds every step
done but an export missing or unfinished (a `.partial-NAME/` left) builds the model and writes it.
"""

import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from ckpt.failures import barrier, bytes_in_words, underlying_error
from ckpt.layout import LATEST, REPLACED
from ckpt.publish import fsync_directory, fsync_tree, tree_bytes
from config import outputs
from config.errors import UserError
from config.process import is_global_rank_zero

log = logging.getLogger(__name__)


def write_exports(policy, out_dir: Path, model_path: Path, checkpoint_dir: Path) -> None:
    """Write the run's exports (`hf/`, with LoRA `hf_adapter/`) into `.partial-NAME/`, fsync them and rename them
    (replacing an earlier export of the same name), so a directory named `hf` is always complete. Collective.

    A failure (a full disk, a quota) ends the run with one paragraph (`_export_failed`) and leaves what a killed
    export leaves: `.partial-NAME/` and any earlier export as it was, so a rerun writes it (`missing_exports`)."""
    is_main = is_global_rank_zero()
    staged = {name: out_dir / f"{outputs.PARTIAL}{name}" for name in policy.exports()}
    try:
        _stage_exports(policy, staged, is_main)
    except Exception as error:  # rank 0's own (only it writes); a peer's, its next collective once rank 0 has left
        raise UserError(_export_failed(staged, underlying_error(error), model_path, checkpoint_dir)) from None
    if is_main:
        for name, path in staged.items():
            final, replaced = out_dir / name, out_dir / f"{REPLACED}{name}"
            if final.exists():  # the export of an earlier finish, replaced whole
                shutil.rmtree(replaced, ignore_errors=True)
                os.replace(final, replaced)
            os.replace(path, final)
            shutil.rmtree(replaced, ignore_errors=True)
        fsync_directory(out_dir)
        log.info("saved the model as a Hugging Face checkpoint in %s%s", out_dir / outputs.HF,
                 f", its LoRA adapter in PEFT format in {out_dir / outputs.HF_ADAPTER}" if len(staged) > 1 else "")
    barrier()


def _stage_exports(policy, staged: dict, is_main: bool) -> None:
    """Write the exports into their `.partial-NAME/` directories, durably (global rank 0 writes). Collective."""
    if is_main:
        for path in staged.values():
            shutil.rmtree(path, ignore_errors=True)  # left by an export that was killed or failed
            path.mkdir(parents=True)
    barrier()
    policy.export(staged, is_main)
    barrier()
    if is_main:
        for path in staged.values():
            fsync_tree(path)


def missing_exports(config) -> list[str]:
    """The exports a finished run has not written (completely) yet: absent, or an export of them began and did not
    finish (its `.partial-NAME/` is left; an `hf/` beside it is an earlier finish's)."""
    names = outputs.EXPORTS if config.peft.method == "lora" else (outputs.HF,)
    out_dir = Path(config.train.out_dir)
    return [name for name in names
            if not (out_dir / name).is_dir() or (out_dir / f"{outputs.PARTIAL}{name}").exists()]


def _export_failed(staged: dict, text: str, model_path: Path, checkpoint_dir: Path) -> str:
    """The paragraph a failed export ends the run with: where, why, what the export needs, and how to write it."""
    where = " and ".join(f"`{path}`" for path in staged.values())
    out_dir = next(iter(staged.values())).parent
    # The rerun deletes the partial export before writing a new one: its space counts as available.
    available = shutil.disk_usage(out_dir).free + sum(tree_bytes(path) for path in staged.values() if path.is_dir())
    needs = sum(path.stat().st_size for path in model_path.glob("*.safetensors"))
    pointer = checkpoint_dir / LATEST
    latest = f"`{pointer.read_text().strip()}`" if pointer.is_file() else "the last one"
    return (f"Writing the run's export into {where} failed on rank {dist.get_rank()}: {text}. `{out_dir}` has "
            f"{bytes_in_words(available)} available for it, and the export needs about {bytes_in_words(needs)} (the weights in "
            f"`{model_path}`). The run's checkpoint {latest}, which `latest` in `{checkpoint_dir}` names, is complete and "
            "intact: make room (or fix what the error names) and rerun with `--resume-from-checkpoint latest`, which "
            "writes the export without training again.")
