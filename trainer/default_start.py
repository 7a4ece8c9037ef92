"""GRPO's embedded default starts from the default SFT's output; when it is missing, that SFT runs first. The
same holds for every bundled start (`config.loops.BUNDLED_STARTS`: the tool task's SFT, `--config sft_tools`).

It runs in the same processes and the same process group (`model.parallel.init_distributed` keeps the group
and lays out the model-parallel groups anew), so there is no second rendezvous that could fail. Extra
arguments for that SFT come from `$TRAINER_DEFAULT_SFT_ARGS` (e.g. `--train.steps=100`). This module sits
above both loops, so that neither loop imports the other.
"""

import os
import shlex
from pathlib import Path

from ckpt.layout import checkpoint_dir
from config import cli, outputs
from config.errors import UserError
from config.loops import BUNDLED_STARTS, SFTConfig
from config.sections import PreferenceDataConfig
from data import conversations as conversation_data, preferences
from model import parallel
from trainer import sft
from trainer.metrics import log

ARGS_VARIABLE = "TRAINER_DEFAULT_SFT_ARGS"


def sft_arguments(start: str) -> list[str]:
    """The command line of the SFT that writes `start`: its recipe, then what `$TRAINER_DEFAULT_SFT_ARGS` holds."""
    recipe = BUNDLED_STARTS[start]
    return (["--config", recipe] if recipe else []) + shlex.split(os.environ.get(ARGS_VARIABLE, ""))


def validate(world_size: int, start: str, data=None, program: str = "GRPO"):
    """Every check of the default SFT that needs no model, before GRPO (or `trainer.rm`, `program`) or that SFT does
    any work; with `data` (the loop's own section), its local (or bundled arithmetic) data read once, so an empty or
    unreadable file, or a `data.*_field` naming no column, is said now, not after the default SFT's run. Returns that
    SFT's config."""
    if data is not None and (Path(data.path).expanduser().exists() or conversation_data.looks_local(data.path)
                             or data.path == "arithmetic"):
        rows = conversation_data.load_split(data, data.path, data.train_split)
        source = f"`{data.path}` ({data.train_split})"
        if isinstance(data, PreferenceDataConfig):  # trainer.rm's pairs
            preferences.check_columns(rows, data, data.path, data.train_split)
        else:
            conversation_data.check_columns(rows, prompt_field=data.prompt_field, response_field=data.response_field,
                                            messages_field=data.messages_field or None, source=source)
    try:
        config, _ = cli.parse_args(SFTConfig, sft_arguments(start), "trainer.sft")
        config.validate(world_size)
    except UserError as error:
        raise UserError(f"{program} starts from the default SFT's output `{start}`, which does not exist yet, and "
                        f"the default SFT cannot run as set up here ({world_size} processes, ${ARGS_VARIABLE}="
                        f"{os.environ.get(ARGS_VARIABLE, '')!r}): {error} Run `torchrun -m trainer.sft` with working "
                        "settings first, or set `--model.path`.") from None
    if Path(config.train.out_dir) / outputs.HF != Path(start):
        raise UserError(f"${ARGS_VARIABLE} moves the default SFT's output to `{config.train.out_dir}`, but {program}'s "
                        f"default start reads `{start}`. Leave `train.out_dir` out of ${ARGS_VARIABLE}, or set "
                        f"`--model.path` for {program}.")
    return config


def say_earlier_start(start: str, program: str = "GRPO") -> None:
    """A bundled start that exists is used as it is, whichever SFT wrote it: when its latest checkpoint's settings
    differ from those the default SFT runs with now (its recipe and `$TRAINER_DEFAULT_SFT_ARGS`: another seed or step
    count), the run said only `loading outputs/sft/hf`. Name the settings it was trained with instead (a warning when
    `$TRAINER_DEFAULT_SFT_ARGS` asks for others: they are not applied); nothing when no checkpoint of it is readable."""
    if start not in BUNDLED_STARTS or not (Path(start) / "config.json").is_file():
        return
    import torch

    from ckpt.layout import LATEST, STATE_FILE
    from ckpt.resume import changed_settings

    try:
        config, _ = cli.parse_args(SFTConfig, sft_arguments(start), "trainer.sft")
        folder = checkpoint_dir(config)
        saved = torch.load(folder / (folder / LATEST).read_text().strip() / STATE_FILE, weights_only=False)["config"]
        # Where it was written is no setting of the model (a copied or moved run reads the same).
        changed = {key: values for key, values in changed_settings(saved, cli.to_dict(config)).items()
                   if key not in ("train.out_dir", "ckpt.dir", "train.overwrite_output_dir")}
    except Exception:  # noqa: BLE001 - no readable record of the earlier SFT: nothing to compare
        return
    if not changed:
        return
    asked = os.environ.get(ARGS_VARIABLE, "")
    (log.warning if asked else log.info)(
        "%s starts from %s as an earlier SFT wrote it, with settings other than the default SFT's now (its recipe%s): "
        "%s. Delete %s (or run `torchrun -m trainer.sft` with the settings you want) to train the start again.",
        program, start, f" and ${ARGS_VARIABLE}={asked!r}" if asked else "",
        ", ".join(f"{key}={was!r} (now {now!r})" for key, (was, now) in changed.items()),
        Path(config.train.out_dir))


def check_outputs_apart(run, sft, program: str) -> None:
    """Refuse a run (GRPO's, `trainer.rm`'s) writing where the default SFT it starts from writes: that SFT runs first in
    the same processes, after the output checks, and the run then appended its metrics to the SFT's, pruned the SFT's
    checkpoints with its own and replaced the SFT's `hf/` (its own starting model) with its export."""
    export = Path(sft.train.out_dir) / outputs.HF
    for key, mine, theirs, harm in (
            ("train.out_dir", Path(run.train.out_dir), Path(sft.train.out_dir),
             f"add its metrics to the SFT's and replace the SFT's export `{export}`, {program}'s own start, with its own"),
            ("ckpt.dir", checkpoint_dir(run), checkpoint_dir(sft),
             "delete the SFT's checkpoints as its own oldest and point their `latest` at its own")):
        if mine.expanduser().resolve() == theirs.expanduser().resolve():
            raise UserError(f"`{key}={mine}` is where the default SFT that {program} starts from writes (that SFT runs "
                            f"first, into `{theirs}`): {program} would {harm}. Set `--{key}` to another directory.")


def train_default_sft(grpo_config, rejoin: bool = True, program: str = "GRPO") -> bool:
    """Run `trainer.sft` (checked by `validate` already), writing `model.path`; False when it stopped on a signal
    (saved, not finished: GRPO must not start).

    It resumes from its own latest checkpoint when it has one (a job requeued while it ran continues it) and
    starts fresh otherwise. GRPO has joined the process group already; afterwards the model-parallel groups and
    seeds are GRPO's again. With `rejoin=False` (asynchronous GRPO, whose two sides make their process groups after
    it) the SFT makes its own process group over every process and ends it.
    """
    start = grpo_config.model.path
    arguments = sft_arguments(start)
    recipe = BUNDLED_STARTS[start]
    log.info("%s does not exist yet: running the %s first (as `torchrun -m trainer.sft %s--resume-from-checkpoint latest` "
             "would)", start, f"SFT of `--config {recipe}`" if recipe else "default SFT", f"--config {recipe} " if recipe else "")
    sft.main([*arguments, "--resume-from-checkpoint", "latest"])
    if not (Path(start) / "config.json").is_file():
        log.info("the %s stopped before its last step; rerun %s to continue it", "SFT" if recipe else "default SFT",
                 program)
        return False
    if rejoin:
        parallel.init_distributed(grpo_config.parallel, grpo_config.train.seed)
    return True
