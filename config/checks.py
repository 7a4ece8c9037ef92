"""The configuration's cross-key rules that need no model (`config.loops.TrainerConfig.validate` runs them): the
optimizer, schedule, data keys, batch, LoRA and loggers (`TrainingChecks`; the model and its parallel layout are
`config.model_checks`'). Each raises a `UserError` naming the key to change."""

import dataclasses
import logging
import math
import os
from pathlib import Path

from config import sections
from config.errors import UserError
from config.sections import DTYPE_NAMES, LORA_SETTINGS, LORA_TARGET_MODULES, PEFT_METHODS, PreferenceDataConfig

log = logging.getLogger(__name__)


def require(holds: bool, message: str) -> None:
    """Raise `message` as a UserError unless `holds`."""
    if not holds:
        raise UserError(message)


# OptimizerConfig fields whose values torch's optimizers check only when they are built, after the model (a
# ValueError then); `lr` and `min_lr` default to None, so no kind is read from their default. field: (holds, rule).
OPTIMIZER_VALUES = {
    "lr": (lambda value: value >= 0, "a number, 0 or more"), "min_lr": (lambda value: value >= 0, "a number, 0 or more"),
    "weight_decay": (lambda value: value >= 0, "a number, 0 or more"),
    "adam_beta1": (lambda value: 0 <= value < 1, "a number in [0, 1)"),
    "adam_beta2": (lambda value: 0 <= value < 1, "a number in [0, 1)"),
    "adam_eps": (lambda value: value > 0, "a positive number"), "sgd_momentum": (lambda value: value >= 0, "a number, 0 or more"),
    "clip_grad": (lambda value: value >= 0, "a number, 0 (off) or more"),
}


def check_override_keys(overrides: dict, config_class, key: str) -> None:
    """Reject override keys the megatron-core class does not have, and values of another kind than its default's (a
    number for a number, true/false for a flag, text for text), naming our config key; an optimizer it cannot build."""
    fields = {item.name: item for item in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - set(fields))
    require(not unknown, f"`{key}` sets {', '.join(f'`{name}`' for name in unknown)}, which megatron-core's "
             f"{config_class.__name__} does not have. Remove or rename them in `{key}`.")
    kinds = ((bool, "true or false", (bool,)), ((int, float), "a number", (int, float)), (str, "text", (str,)))
    for name, value in overrides.items():
        default = fields[name].default
        for default_types, kind, accepted in kinds:
            if isinstance(default, default_types) and default is not None:
                require(isinstance(value, accepted) and (bool in accepted or not isinstance(value, bool)),
                        f"`{key}` sets `{name}` to {value!r}, and megatron-core's {config_class.__name__}.{name} takes "
                        f"{kind} (its default: {default!r}). Change it in `{key}`.")
                break
    for name, (holds, rule) in (OPTIMIZER_VALUES if config_class.__name__ == "OptimizerConfig" else {}).items():
        value = overrides.get(name)
        require(name not in overrides or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and holds(value)),
                f"`{key}` sets `{name}` to {value!r}, and megatron-core's OptimizerConfig.{name} must be {rule}. "
                f"Change it in `{key}`.")
    if config_class.__name__ == "OptimizerConfig" and overrides.get("optimizer", "adam") not in ("adam", "sgd"):
        from megatron.core import optimizer as megatron_optimizer

        # The others (lion, muon, ...) are built from the emerging_optimizers package, which megatron-core checks.
        require(getattr(megatron_optimizer, "HAVE_EMERGING_OPTIMIZERS", False),
                f"`{key}` sets `optimizer` to {overrides['optimizer']!r}; without the emerging_optimizers package "
                f"megatron-core builds adam and sgd only. Install it, or change `optimizer` in `{key}`.")


def value_of(config, dotted: str):
    """The value of a dotted key."""
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


class TrainingChecks:
    """The optimizer and precision, the schedule's counts, the batch sizes, LoRA and the loggers."""

    def _validate_optimizer(self) -> None:
        optim = self.optim
        require(isinstance(optim.betas, list) and len(optim.betas) == 2 and all(0 <= beta < 1 for beta in optim.betas),
                 f"`optim.betas` must be two numbers in [0, 1), [beta1, beta2], got {optim.betas}. Change `--optim.betas` "
                 "(e.g. `--optim.betas=[0.9,0.95]`).")
        for key, holds, rule in (("lr", optim.lr >= 0, "0 or more"), ("min_lr", optim.min_lr is None or optim.min_lr >= 0, "0 or more"),
                                 ("min_lr_ratio", 0 <= optim.min_lr_ratio <= 1, "between 0 and 1"),
                                 ("eps", optim.eps > 0, "positive"), ("weight_decay", optim.weight_decay >= 0, "0 or more"),
                                 ("clip_grad", optim.clip_grad >= 0, "0 (off) or more"),
                                 ("warmup_steps", optim.warmup_steps >= 0, "0 or more")):
            require(holds, f"`optim.{key}` must be {rule}, got {getattr(optim, key)}. Change `--optim.{key}`.")
        # AdamW's decoupled decay multiplies every weight by 1 - lr x weight_decay at each step: from 1 on, the weights
        # are zeroed or change sign every step.
        require(optim.lr * optim.weight_decay < 1,
                 f"`optim.weight_decay={optim.weight_decay}` x `optim.lr={optim.lr}` is {optim.lr * optim.weight_decay:g}: "
                 "the decoupled weight decay multiplies every weight by 1 - lr x weight_decay each step, which would "
                 "zero the weights or flip their sign. Lower `--optim.weight_decay` (0.01 and 0.1 are usual).")
        require(optim.final_lr <= optim.lr,
                 f"`optim.min_lr={optim.min_lr}` is above `optim.lr={optim.lr}`: the learning rate decays from optim.lr down "
                 "to optim.min_lr. Lower `--optim.min_lr`, or leave it unset (it then follows optim.lr: optim.lr x "
                 f"`optim.min_lr_ratio={optim.min_lr_ratio}`).")
        for key in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            require(getattr(optim, key) in DTYPE_NAMES,
                     f"`optim.{key}={getattr(optim, key)}` is not one of {', '.join(DTYPE_NAMES)}. Change `--optim.{key}`.")
        # megatron-core is imported only when there are override keys to check: importing it takes several seconds,
        # which would otherwise delay every later start-up error (in the data, say) by as much.
        if optim.override_optimizer_config:
            from megatron.core.optimizer import OptimizerConfig

            check_override_keys(optim.override_optimizer_config, OptimizerConfig, "optim.override_optimizer_config")
            self._check_precision_overrides()
            # Its lr and min_lr are the schedule's peak and floor (model.build.warmup_cosine_schedule).
            overrides = optim.override_optimizer_config
            lr, min_lr = overrides.get("lr", optim.lr), overrides.get("min_lr", optim.final_lr)
            require(min_lr <= lr,
                     f"`optim.override_optimizer_config` gives the schedule a floor, min_lr={min_lr:g}, above its "
                     f"peak, lr={lr:g} "
                     "(the schedule decays from lr down to min_lr, and megatron-core refuses a floor above the peak). "
                     "Set `min_lr` beside `lr` in `optim.override_optimizer_config`, or set `--optim.lr` and "
                     "`--optim.min_lr` instead.")
        if self.ddp.override_ddp_config:
            from megatron.core.distributed import DistributedDataParallelConfig

            check_override_keys(self.ddp.override_ddp_config, DistributedDataParallelConfig, "ddp.override_ddp_config")
        if optim.use_precision_aware_optimizer and self.model.dtype == "fp32":
            log.warning("`optim.use_precision_aware_optimizer=true` has no effect with `model.dtype=fp32`: fp32 training "
                        "keeps fp32 weights, gradients and Adam state already (set `--model.dtype=bf16` to use it).")
        self._validate_state_dtypes()
        if not self.precision_aware:
            return
        why = "`model.dtype=fp16`" if self.model.dtype == "fp16" else "`optim.use_precision_aware_optimizer=true`"
        require(not (self.model.dtype == "fp16" and self.parallel.use_megatron_fsdp),
                 "`model.dtype=fp16` with `parallel.use_megatron_fsdp=true` is not supported: megatron-core 0.19's "
                 "loss-scale check reads the gradient of every parameter, and Megatron-FSDP leaves a rank none for a "
                 "parameter that lies wholly in other ranks' shards (the first step fails); nor do Megatron-FSDP's "
                 "checkpoints hold the dynamic loss scale, so a resume would restart it. Use `--model.dtype=bf16` with "
                 "Megatron-FSDP, or keep fp16 with `--parallel.use_megatron_fsdp=false` (the distributed optimizer "
                 "shards the optimizer state).")
        optimizer = optim.override_optimizer_config.get("optimizer", "adam")
        require(optimizer == "adam", f"{why} needs the adam optimizer, but `optim.override_optimizer_config.optimizer={optimizer}`.")
        require(self.parallel.use_distributed_optimizer or self.parallel.use_megatron_fsdp,
                 f"{why} needs the distributed optimizer: set `--parallel.use_distributed_optimizer=true`.")
        require(sections.have_transformer_engine(),
                 f"{why} uses Transformer Engine's FusedAdam, and Transformer Engine is not installed. Install it "
                 "(`uv sync --extra te` on a CUDA machine, or use NVIDIA's NGC PyTorch container), or use "
                 "`--model.dtype=bf16 --optim.use_precision_aware_optimizer=false`.")

    def _check_precision_overrides(self) -> None:
        """OptimizerConfig's precision fields come from `model.dtype` and `optim.*` (`model.rules.optimizer_config`):
        through the override a dtype field can only arrive as text, which megatron-core asserts on after the model is
        built or keeps as a string, and a flag unlike the run's (`fp16: false` in an fp16 model: no loss scale) skips
        the start-up checks of the key that sets it."""
        derived = {"fp16": self.model.dtype == "fp16", "bf16": self.model.dtype == "bf16",
                   "use_precision_aware_optimizer": self.precision_aware}
        set_by = {"fp16": "model.dtype", "bf16": "model.dtype", "params_dtype": "model.dtype",
                  "use_precision_aware_optimizer": "optim.use_precision_aware_optimizer",
                  "main_grads_dtype": "optim.main_grads_dtype", "exp_avg_dtype": "optim.exp_avg_dtype",
                  "exp_avg_sq_dtype": "optim.exp_avg_sq_dtype", "main_params_dtype": None}
        for name, value in self.optim.override_optimizer_config.items():
            if name not in set_by or derived.get(name, not value) == value:
                continue
            key = set_by[name]
            raise UserError(
                f"`optim.override_optimizer_config` sets `{name}` to {value!r}, a precision setting of megatron-core's "
                "OptimizerConfig that the run derives from its own keys (the override would skip their checks, or pass "
                f"megatron-core text where it needs a torch dtype). Remove `{name}` from `optim.override_optimizer_config`"
                + (f" and set `--{key}` instead." if key else
                   ": the master weights stay fp32 (`model.dtype=bf16` or fp16 keeps them so)."))

    def _validate_state_dtypes(self) -> None:
        """`optim.main_grads_dtype`, `optim.exp_avg_dtype`, `optim.exp_avg_sq_dtype` below fp32 act only with bf16's
        precision-aware optimizer (megatron-core refuses them without it; the fp16 rule keeps them fp32): elsewhere they
        would be dropped without a word."""
        optim = self.optim
        lowered = [f"`optim.{key}={getattr(optim, key)}`" for key in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
                   if getattr(optim, key) != "fp32"]
        if not lowered:
            return
        if self.model.dtype == "bf16" and optim.use_precision_aware_optimizer:
            # megatron-core's DDP keeps main gradients in fp32 or, with grad_reduce_in_fp32 off, in the parameters' dtype.
            require(optim.main_grads_dtype != "fp16",
                    "`optim.main_grads_dtype=fp16` is not one megatron-core keeps: its gradient buffers hold fp32, or "
                    "the parameters' bf16 when not fp32, so the run would reduce and step on bf16 gradients without a "
                    "word (Megatron-LM's --main-grads-dtype offers fp32 and bf16). Use `--optim.main_grads_dtype=bf16` "
                    "or fp32.")
            return
        where = ("`model.dtype=fp16` keeps its main gradients and Adam moments in fp32 (fp16's rule: the gradients "
                 "are unscaled and checked for overflow there)" if self.model.dtype == "fp16" else
                 f"they set the precision-aware optimizer's state, which this run (`model.dtype={self.model.dtype}`, "
                 f"`optim.use_precision_aware_optimizer={str(optim.use_precision_aware_optimizer).lower()}`) does not use")
        raise UserError(f"{', '.join(lowered)} would do nothing: {where}, so the run would keep fp32 state without a word. "
                        "Set `--model.dtype=bf16 --optim.use_precision_aware_optimizer=true` to keep the state in lower "
                        "precision, or leave these keys at fp32.")

    def _validate_schedule(self) -> None:
        train, ckpt = self.train, self.ckpt
        checks = (("train.steps", train.steps >= 1, "at least 1"), ("train.micro_batch_size", train.micro_batch_size >= 1, "at least 1"),
                  ("train.global_batch_size", train.global_batch_size >= 1, "at least 1"),
                  ("train.exit_interval", train.exit_interval >= 0, "0 (off) or more"),
                  ("train.eval_interval", train.eval_interval >= 0, "0 (only at the end) or more"),
                  ("train.eval_samples", train.eval_samples >= 0, "0 (no evaluation) or more"),
                  ("train.log_interval", train.log_interval >= 1, "at least 1"),
                  ("ckpt.save_interval", ckpt.save_interval >= 0, "0 (only at the end) or more"),
                  ("ckpt.keep_last", ckpt.keep_last >= 1, "at least 1"),
                  ("data.max_seq_len", self.data.max_seq_len >= 2, "at least 2 (one input and one label token)"),
                  ("train.seed", 0 <= train.seed < 2**32, "from 0 to 2**32 - 1 (the random generators' range)"),
                  ("train.micro_batch_tokens", train.micro_batch_tokens == 0 or train.micro_batch_tokens >= self.data.max_seq_len,
                   f"0 (off) or at least `data.max_seq_len={self.data.max_seq_len}` (a micro-batch holds one row at least)"))
        for key, holds, rule in checks:
            require(holds, f"`{key}` must be {rule}, got {value_of(self, key)}. Change `--{key}`.")
        data = self.data
        require(data.messages_field or isinstance(data, PreferenceDataConfig) or data.prompt_field != data.response_field,
                 f"`data.prompt_field` and `data.response_field` are both `{data.prompt_field}`: every prompt would "
                 "hold its own answer. Set them to the prompt's and the response's columns (or `--data.messages_field` "
                 "for chat messages).")
        # An empty path is the current directory to the loaders: its JSON files (a tokenizer's, say) read as rows.
        require(self.data.path.strip(),
                f"`data.path` is empty{f' ({self.data.path!r})' if self.data.path else ''}: the data would be read "
                "from the current directory. Set `--data.path` to a json/jsonl/parquet file or a folder of them, a hub "
                "dataset name, or a bundled set (`arithmetic`).")
        for key in ("train_split", "eval_split"):
            split = getattr(self.data, key)
            require(split.strip(), f"`data.{key}` is empty{f' ({split!r})' if split else ''}: a folder's every file (its "
                    f"held-out ones too) would be read as it. Set `--data.{key}` to the split's name (`train`, `test`, a "
                    "hub set's split).")
        require(self.data.eval_path or self.data.train_split != self.data.eval_split,
                 f"`data.train_split` and `data.eval_split` are both `{self.data.eval_split}`: the held-out figures "
                 "would be measured on the training rows. Set `--data.eval_split` to another split, or point "
                 "`--data.eval_path` at held-out data.")
        eval_file = Path(self.data.eval_path).expanduser() if self.data.eval_path else None
        require(not (eval_file and eval_file.is_file() and eval_file.resolve() == Path(self.data.path).expanduser().resolve()),
                 f"`data.eval_path={self.data.eval_path}` is the file `data.path` trains on: the held-out figures would "
                 "be measured on the training rows. Point `--data.eval_path` at held-out rows, or leave it unset (a "
                 "folder's `data.eval_split` files, or a hub set's split).")

    def _validate_peft(self) -> None:
        peft, parallel = self.peft, self.parallel
        require(peft.method in PEFT_METHODS, f"`peft.method={peft.method}` is not one of {', '.join(PEFT_METHODS)}. "
                 "Change `--peft.method`.")
        if peft.method != "lora":
            defaults = type(self)().peft
            changed = [f"`peft.{key}`" for key in LORA_SETTINGS
                       if getattr(peft, key) != getattr(defaults, key)]
            require(not changed,
                     f"{', '.join(changed)} {'sets' if len(changed) == 1 else 'set'} LoRA's adapters, and "
                     f"`peft.method={peft.method}` trains every weight without adapters, so "
                     f"{'it' if len(changed) == 1 else 'they'} would do nothing. Set `--peft.method=lora`, or remove "
                     f"{'it' if len(changed) == 1 else 'them'}.")
            return
        unknown = [name for name in peft.target_modules if name not in LORA_TARGET_MODULES]
        require(peft.target_modules and not unknown,
                 f"`peft.target_modules={peft.target_modules}` must name one or more of {', '.join(LORA_TARGET_MODULES)} "
                 f"(megatron-core's names of the attention and MLP linear layers){f'; unknown: {unknown}' if unknown else ''}. "
                 "Change `--peft.target_modules` (e.g. `[linear_qkv,linear_proj]`).")
        for key, holds, rule in (("rank", peft.rank >= 1, "at least 1"), ("alpha", peft.alpha > 0, "positive"),
                                 ("dropout", 0 <= peft.dropout < 1, "in [0, 1)")):
            require(holds, f"`peft.{key}` must be {rule} with `peft.method=lora`, got {getattr(peft, key)}. "
                     f"Change `--peft.{key}`.")
        # Not verified with adapters in this stack: refused rather than run untested.
        require(not parallel.use_megatron_fsdp,
                 "`peft.method=lora` with `parallel.use_megatron_fsdp=true` is not supported: LoRA freezes the base "
                 "weights, and Megatron-FSDP's sharded checkpoints and parameter gathers have not been verified with "
                 "adapters here. Use `--parallel.use_megatron_fsdp=false` (the distributed optimizer shards the "
                 "adapters' optimizer state, and the frozen base needs none).")

    def _validate_log(self) -> None:
        require(not self.log.wandb or sections.have_wandb(),
                 "`log.wandb=true` needs Weights & Biases, which is not installed in this environment. Install the "
                 "project's `wandb` extra (`.venv/bin/uv sync --extra wandb`; `scripts/setup.sh` installs it with the "
                 "test dependencies), or use `--log.wandb=false` (`--log.tensorboard=true` needs nothing extra).")
        project = self.log.wandb_project or os.environ.get("WANDB_PROJECT", "")
        if self.log.wandb and project:
            import wandb

            # W&B checks the name only in `wandb.init`, which the loops call once the model is built.
            where = "`log.wandb_project`" if self.log.wandb_project else "$WANDB_PROJECT (`log.wandb_project` unset)"
            try:
                wandb.Settings(project=project)
            except (wandb.errors.UsageError, ValueError) as error:
                raise UserError(f"{where} is not a project name W&B takes: {error}. Change `--log.wandb_project` (it "
                                "wins over $WANDB_PROJECT).") from None

    def _validate_batch(self, world_size: int) -> None:
        train = self.train
        data_parallel = self.parallel.data_parallel_size(world_size)
        self._validate_token_budget()
        if train.micro_batch_tokens:
            require(train.global_batch_size % data_parallel == 0,
                     f"`train.global_batch_size={train.global_batch_size}` must be a multiple of the data-parallel size "
                     f"{data_parallel}.")
            return
        require(train.global_batch_size % (train.micro_batch_size * data_parallel) == 0,
                 f"`train.global_batch_size={train.global_batch_size}` must be a multiple of `train.micro_batch_size="
                 f"{train.micro_batch_size}` x data-parallel size {data_parallel}.")
        microbatches, pp = train.global_batch_size // (train.micro_batch_size * data_parallel), self.parallel.pp
        require(self.parallel.vpp == 1 or microbatches % pp == 0,
                 f"`parallel.vpp={self.parallel.vpp}` runs megatron-core's interleaved schedule, which takes a step's "
                 f"micro-batches in groups of `parallel.pp={pp}`: `train.global_batch_size={train.global_batch_size}` / "
                 f"(`train.micro_batch_size={train.micro_batch_size}` x data-parallel size {data_parallel}) = "
                 f"{microbatches} micro-batches a step, not a multiple of `parallel.pp={pp}`. Change "
                 "`--train.global_batch_size` or `--train.micro_batch_size`, or set `--parallel.vpp=1`.")

    def _validate_token_budget(self) -> None:
        if not self.train.micro_batch_tokens:
            return
        require(self.parallel.pp == 1,
                 f"`train.micro_batch_tokens={self.train.micro_batch_tokens}` groups rows by length into micro-batches "
                 f"of varying row counts, and pipeline stages (`parallel.pp={self.parallel.pp}`) exchange activations "
                 "of one shape. Use `--train.micro_batch_tokens=0` (micro-batches of `train.micro_batch_size` rows) "
                 "with `parallel.pp` > 1.")
        require(not self.data.pack,
                 "`train.micro_batch_tokens` and `data.pack=true` both decide how a step's samples share micro-batches: "
                 "packing fills rows of `data.max_seq_len`, the budget groups rows of similar length. Choose one: "
                 "`--train.micro_batch_tokens=0` or `--data.pack=false`.")
