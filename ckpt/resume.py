"""What a run resumes from: `--resume-from-checkpoint` resolved to one complete checkpoint saved for this model.

Runs before any model is built (`Checkpointer`), so a bad target costs nothing and overwrites nothing. A checkpoint
fits when its fingerprint (`model_fingerprint`: the model's shape, the TP/PP/VPP layout, DDP or Megatron-FSDP, the
distributed optimizer, the parameters' dtype, a Mixture-of-Experts model's EP/ETP and frozen router, LoRA's settings and base) matches this
run's; data parallelism may differ. A changed setting is refused by name, with both values.
"""

import hashlib
import json
import logging
from pathlib import Path

import torch

from ckpt.layout import LATEST, SHARDED_DIR, STATE_FILE
from config import outputs
from config.errors import UserError
from config.hf import hf_expert_count

log = logging.getLogger(__name__)


# Settings the optimizer's state is laid out by, each refused by name when a resume changes it: why, per key. (Older
# checkpoints, saved before these were recorded, are not checked for them.)
STATE_LAYOUT = {
    "parallel.use_distributed_optimizer": "the distributed optimizer keeps its state in shards of its gradient buckets, "
                                          "a plain one per parameter, and the two do not load into each other",
    "parallel.ep": "the experts' weights and optimizer state are saved laid out on the expert-parallel grid, which this "
                   "trainer does not reshard",
    "parallel.etp": "the experts' weights and optimizer state are saved split over the expert tensor-parallel ranks, "
                    "which this trainer does not reshard",
    "model.moe_freeze_router": "a frozen router has no optimizer state, so the optimizer holds other parameters",
    "model.dtype": "the optimizer's state is laid out by the parameters' dtype (bf16 and fp16 keep fp32 main copies in "
                   "gradient buffers of their own, fp32 none), and megatron-core does not convert one into another",
}


# Settings whose values the checkpoint's own state holds, so that a resumed run would keep the checkpoint's and drop a
# new one without a word: refused by name when they differ from the run that saved it.
CONTINUED = {
    "train.steps": "the learning-rate schedule's length is the checkpoint's",
    "train.global_batch_size": "the data position counts batches of the checkpoint's size",
    "train.seed": "the data order and every seed after it are the checkpoint's",
    "optim.lr": "the schedule's peak learning rate is the checkpoint's", "optim.min_lr": "the schedule's floor is the "
    "checkpoint's", "optim.min_lr_ratio": "the schedule's floor is the checkpoint's",
    "optim.warmup_steps": "the schedule's warmup is the checkpoint's",
    "optim.weight_decay": "the optimizer's parameter groups are restored with the checkpoint's",
    "optim.betas": "the optimizer's parameter groups are restored with the checkpoint's",
    "optim.eps": "the optimizer's parameter groups are restored with the checkpoint's",
    "optim.override_optimizer_config": "the optimizer's parameter groups are restored with the checkpoint's",
}


# Settings the data position is counted in, without the checkpoint holding them: another value on resume would skip
# or repeat data.
POSITIONAL = {
    "grpo.n_samples": "GRPO's data position is counted in prompts, train.global_batch_size / grpo.n_samples a step",
}


# The loop each config class runs: a checkpoint resumes only the loop that saved it.
LOOPS = {"SFTConfig": "trainer.sft", "GRPOConfig": "trainer.grpo", "RMConfig": "trainer.rm"}


def loop_of(saved_config: dict | None) -> str | None:
    """The loop a checkpoint's saved config (`config.cli.to_dict`) was written by, for checkpoints that predate its
    fingerprint's `loop`: GRPO's has a `grpo` section, `trainer.rm`'s preference fields."""
    if not saved_config:
        return None
    if "grpo" in saved_config:
        return LOOPS["GRPOConfig"]
    return LOOPS["RMConfig"] if "chosen_field" in saved_config.get("data", {}) else LOOPS["SFTConfig"]


def changed_settings(saved: dict, current: dict) -> dict[str, tuple]:
    """{dotted key: (saved value, this run's)} of the settings two nested configs (`config.cli.to_dict`) differ in
    (compared as JSON: a tuple and a list of the same values are the same setting)."""
    def same(a, b) -> bool:
        return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)

    return {f"{section}.{key}": (value, current[section][key])
            for section, values in saved.items() if isinstance(values, dict) and isinstance(current.get(section), dict)
            for key, value in values.items() if key in current[section] and not same(current[section][key], value)}


def check_continued_settings(path: Path, saved_config: dict | None, current: dict | None) -> None:
    """Refuse a resume that changes a setting the checkpoint's state holds (`CONTINUED`) or counts its data position in
    (`POSITIONAL`); say the others it changes
    (they take effect from the next step)."""
    if not saved_config or current is None:
        return
    changed = changed_settings(saved_config, current)
    for key, (was, now) in changed.items():
        if key in CONTINUED or key in POSITIONAL:
            why = (f"{CONTINUED[key]}: a resumed run would go on with `{was}` without a word" if key in CONTINUED else
                   f"{POSITIONAL[key]}: a resumed run would skip or repeat data without a word")
            raise UserError(f"Checkpoint `{path}` was saved with `{key}={was}` and this run has `{key}={now}`, but "
                            f"{why}. Resume with `--{key}={was}`; to train on with other settings, start a new run "
                            "from the model it exports (`--model.path <train.out_dir>/hf`) or from a copy of the "
                            "checkpoint's weights.")
    if changed:
        log.info("resuming with settings changed from the checkpoint's (in effect from the next step): %s",
                 ", ".join(f"{key} {was!r} -> {now!r}" for key, (was, now) in changed.items()))


def restore_metrics_row(path: Path, row: dict | None) -> None:
    """Append the checkpoint's own step's metrics row (`Checkpointer.maybe_save_or_export` saves it) to metrics.jsonl
    when that file lacks it: a run that died after the save and before writing the row (in the final export, or a save
    it waited for) lost it for good, since a resume starts after that step. Global rank 0, before the metrics writer
    keeps the rows up to the step and appends."""
    rows = outputs.read_rows(path) if row is not None else []
    if row is None or any(kept.get("step") == row.get("step") for kept in rows):
        return
    path.parent.mkdir(parents=True, exist_ok=True)  # a branch of another run's checkpoint into a new train.out_dir
    outputs.write_rows(path, [*rows, row])
    log.info("metrics.jsonl: the row of step %d, written into the checkpoint but not the file, restored", row["step"])


def model_fingerprint(hf_config: dict, parallel, peft=None, model_path: Path | None = None,
                      freeze_router: bool = False, dtype: str = "fp32") -> dict:
    """What must match for a checkpoint to load into this model (Megatron-FSDP and DDP write different formats, and
    the optimizer's state follows `STATE_LAYOUT`'s settings; a Mixture-of-Experts model's expert layout too).

    With LoRA a checkpoint holds the adapters only, so their settings and the base they were trained on (the
    checkpoint's weight files: names, sizes and `sampled_digest`) must match too."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "tie_word_embeddings")
    fingerprint = {"model": {key: hf_config.get(key) for key in keys}, "tp": parallel.tp, "pp": parallel.pp,
                   "vpp": parallel.vpp, "megatron_fsdp": parallel.use_megatron_fsdp,
                   "parallel.use_distributed_optimizer": parallel.use_distributed_optimizer, "model.dtype": dtype}
    if hf_expert_count(hf_config):
        fingerprint.update({"parallel.ep": parallel.ep, "parallel.etp": parallel.expert_tensor_parallel_size,
                            "model.moe_freeze_router": freeze_router})
    if peft is not None and peft.method == "lora":
        # Not `peft.dropout`: it holds no state, so a resume may change it (said with the other changed settings).
        files = sorted(Path(model_path).glob("*.safetensors"))
        fingerprint["lora"] = {"rank": peft.rank, "alpha": peft.alpha, "target_modules": sorted(peft.target_modules),
                               "base": [(path.name, path.stat().st_size) for path in files],
                               "base_digest": sampled_digest(files)}
    return fingerprint


def frozen_inputs(config, model_path: Path) -> dict:
    """{key: `sampled_digest` of its weight files} of the frozen models a GRPO run loads again at every start, which its
    checkpoint does not hold: the KL reference (`model.path`; with LoRA the adapters' fingerprint holds the base), the
    reward model and the teacher. Another training's export put where one of them was changes the run on resume."""
    grpo = getattr(config, "grpo", None)
    if grpo is None:
        return {}
    paths = {"model.path": model_path if grpo.kl_coef > 0 and config.peft.method != "lora" else None,
             "grpo.reward_model": grpo.reward_model and Path(grpo.reward_model).expanduser(),
             "grpo.teacher": grpo.teacher and Path(grpo.teacher).expanduser()}
    return {key: sampled_digest(sorted(Path(path).glob("*.safetensors"))) for key, path in paths.items() if path}


def say_changed_inputs(path: Path, saved: dict, current: dict) -> None:
    """Warn, by key, of each frozen model (`frozen_inputs`) whose weights differ from those the checkpoint was trained
    with, as a changed setting is said: the run goes on with the new ones."""
    roles = {"model.path": "the KL reference", "grpo.reward_model": "the reward model", "grpo.teacher": "the teacher"}
    for key in sorted(saved.keys() & current.keys()):
        if saved[key] != current[key]:
            log.warning("`%s`: its weights differ from those checkpoint `%s` was trained with (bytes sampled: %s, now "
                        "%s), as if another model were put there: the resumed run goes on with these as %s from its "
                        "next step. To continue as before, put back the model it was trained with.",
                        key, path, saved[key][:12], current[key][:12], roles[key])


# Where `sampled_digest` reads each weight file: this many places, this many bytes at each.
DIGEST_PLACES, DIGEST_BYTES = 16, 1 << 16


def sampled_digest(files: list[Path]) -> str:
    """A digest of the bytes at `DIGEST_PLACES` evenly spaced places of each file: two trainings of one architecture (an
    SFT run again into the same `hf/`) write files of equal names and sizes, never of equal bytes there, and reading 1
    MiB a file keeps start-up quick where hashing whole files would read the model at every start."""
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as stream:
            for place in range(DIGEST_PLACES):
                stream.seek(size * place // DIGEST_PLACES)
                digest.update(stream.read(DIGEST_BYTES))
    return digest.hexdigest()


def resolve_resume(resume: str, checkpoint_dir: Path, fingerprint: dict,
                   config: dict | None = None) -> tuple[Path | None, int]:
    """(checkpoint to resume from, its step), or (None, 0) to start fresh; raises UserError for anything unusable
    (with `config`, this run's nested config: also a setting the checkpoint's state holds changed).

    Runs before any model is built, so a bad `--resume-from-checkpoint` costs nothing and overwrites nothing.
    """
    if not resume:
        return None, 0
    if resume == LATEST:
        pointer = checkpoint_dir / LATEST
        if not pointer.is_file():
            log.info("--resume-from-checkpoint latest: no checkpoint in %s yet, starting fresh", checkpoint_dir)
            return None, 0
        path = checkpoint_dir / pointer.read_text().strip()
    else:
        path = Path(resume)
        if (path / LATEST).is_file():  # a checkpoint directory rather than one checkpoint
            path = path / (path / LATEST).read_text().strip()
    if not path.is_dir():
        raise UserError(f"Checkpoint `{path}` does not exist. Check `--resume-from-checkpoint` (a checkpoint "
                        "directory, its parent `ckpt.dir`, or `latest`).")
    # `.metadata` is the index torch.distributed.checkpoint writes under megatron-core's torch_dist format.
    required = (STATE_FILE, f"{SHARDED_DIR}/.metadata", "rng")
    if not any((path / name).exists() for name in (STATE_FILE, SHARDED_DIR, "rng")):
        raise UserError(f"`{path}` is not a checkpoint (it has none of {', '.join(required)}, and no `{LATEST}` "
                        "pointer). Check `--resume-from-checkpoint` (a checkpoint directory such as "
                        "`<train.out_dir>/checkpoints/step_00000100`, its parent `ckpt.dir`, or `latest`).")
    for name in required:
        if not (path / name).exists():
            raise UserError(f"Checkpoint `{path}` is incomplete or corrupted: `{path / name}` is missing. "
                            "Resume from an earlier checkpoint with `--resume-from-checkpoint PATH`.")
    try:
        state = torch.load(path / STATE_FILE, weights_only=False)
    except Exception as error:  # a truncated or foreign file
        raise UserError(f"Checkpoint file `{path / STATE_FILE}` cannot be read ({error}). It is corrupted; "
                        "resume from an earlier checkpoint with `--resume-from-checkpoint PATH`.") from None
    saved = dict(state.get("fingerprint") or {})
    saved_inputs, inputs = saved.pop("inputs", {}), fingerprint.get("inputs", {})  # said below, never refused
    saved_loop, loop = saved.pop("loop", None) or loop_of(state.get("config")), fingerprint.get("loop")
    fingerprint = {key: value for key, value in fingerprint.items() if key not in ("inputs", "loop")}
    if saved_loop and loop and saved_loop != loop:
        raise UserError(f"Checkpoint `{path}` was saved by `{saved_loop}` and this is `{loop}`: a checkpoint resumes "
                        f"only the loop that saved it (its schedule, data position and optimizer are that loop's). To "
                        f"start `{loop}` from that run's model, drop `--resume-from-checkpoint` and set `--model.path` "
                        "to its export (`<its train.out_dir>/hf`).")
    if saved.get("lora"):  # checkpoints saved before the adapters' dropout was left out of the fingerprint
        saved = {**saved, "lora": {key: value for key, value in saved["lora"].items() if key != "dropout"}}
        if "base_digest" not in saved["lora"] and fingerprint.get("lora"):  # saved before the base's bytes were read
            fingerprint = {**fingerprint, "lora": {key: value for key, value in fingerprint["lora"].items()
                                                   if key != "base_digest"}}
    saved_dtype = ((state.get("config") or {}).get("model") or {}).get("dtype")
    if "model.dtype" not in saved and saved_dtype:  # saved before the dtype was fingerprinted: its config has it
        saved = {**saved, "model.dtype": saved_dtype}
    if saved.get("megatron_fsdp", False) != fingerprint["megatron_fsdp"]:
        saved_by, this_run = ("Megatron-FSDP", "DDP") if saved.get("megatron_fsdp") else ("DDP", "Megatron-FSDP")
        raise UserError(f"Checkpoint `{path}` was saved by a {saved_by} run and this run uses {this_run}; the two keep "
                        "model and optimizer in different formats. Resume with the same `parallel.use_megatron_fsdp` "
                        f"(`--parallel.use_megatron_fsdp={str(not fingerprint['megatron_fsdp']).lower()}`).")
    if saved.get("lora") != fingerprint.get("lora"):
        raise UserError(f"Checkpoint `{path}` was saved with {_describe_lora(saved)} and this run uses "
                        f"{_describe_lora(fingerprint)}: LoRA adapters load only onto the base and settings they were "
                        "trained with. Use the checkpoint's `model.path` and `peft.*` settings, or start a new "
                        "`train.out_dir`.")
    for key, why in STATE_LAYOUT.items():
        if key in saved and key in fingerprint and saved[key] != fingerprint[key]:
            was, now = (str(value).lower() if isinstance(value, bool) else value for value in (saved[key], fingerprint[key]))
            raise UserError(f"Checkpoint `{path}` was saved with `{key}={was}` and this run has `{key}={now}`: {why}. "
                            f"Resume with `--{key}={was}`, or start a new `train.out_dir`.")
    saved = {**{key: fingerprint[key] for key in STATE_LAYOUT if key in fingerprint}, **saved}  # older checkpoints
    if saved != fingerprint:
        names = {"tp": "parallel.tp", "pp": "parallel.pp", "vpp": "parallel.vpp"}
        differs = [f"`{names.get(key, key)}={saved.get(key)}` (this run: {fingerprint.get(key)})"
                   for key in names if saved.get(key) != fingerprint.get(key)]
        differs += [f"the model's `{key}` {saved.get('model', {}).get(key)!r} (this run's: {value!r})"
                    for key, value in fingerprint["model"].items() if (saved.get("model") or {}).get(key) != value]
        raise UserError(f"Checkpoint `{path}` was saved for a different model or parallel layout: "
                        f"{'; '.join(differs) or f'it has {saved}, this run has {fingerprint}'}. Use the same "
                        "`model.path` and `parallel.tp`/`parallel.pp`/`parallel.vpp` (data parallelism may differ), or "
                        "start a new `train.out_dir`.")
    check_continued_settings(path, state.get("config"), config)
    say_changed_inputs(path, saved_inputs, inputs)
    return path, state["step"]


def _describe_lora(fingerprint: dict) -> str:
    """A fingerprint's LoRA settings in words."""
    settings = fingerprint.get("lora")
    if settings is None:
        return "full fine-tuning (no LoRA)"
    base = ", ".join(f"{name} {size} B" for name, size in settings["base"])
    content = f" (bytes sampled: {settings['base_digest'][:12]})" if settings.get("base_digest") else ""
    return (f"LoRA rank {settings['rank']}, alpha {settings['alpha']:g} on "
            f"{', '.join(settings['target_modules'])} over a base of {base}{content}")
