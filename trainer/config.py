"""Configuration: nested dataclasses with defaults in code, a YAML file, and `--a.b=value` overrides.

`parse_args(ConfigClass, argv)` returns the config and the resume target; `validate_startup` checks
everything that can be checked before a model is built. Every mistake raises `UserError` naming the key.
"""

import dataclasses
import difflib
import importlib.util
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trainer.errors import UserError

DTYPE_NAMES = ("fp32", "bf16", "fp16")
ATTENTION_NAMES = ("auto", "sdpa", "local", "transformer_engine")


@dataclass
class ModelConfig:
    path: str = field(default="tiny", metadata={"help": "HF checkpoint directory, or `tiny` (the embedded default, built offline on first use)"})
    dtype: str = field(default="fp32", metadata={"help": "parameter dtype: bf16 | fp16 | fp32 (use bf16 on GPUs)"})
    attention: str = field(default="auto", metadata={"help": "core attention: auto (Transformer Engine when installed, else sdpa) | sdpa | local | transformer_engine"})


@dataclass
class ParallelConfig:
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree (divides the attention and KV heads)"})
    pp: int = field(default=1, metadata={"help": "pipeline-parallel degree (divides the layers)"})
    vpp: int = field(default=1, metadata={"help": "virtual pipeline stages per PP rank (interleaved 1F1B when > 1)"})
    use_megatron_fsdp: bool = field(default=False, metadata={"help": "shard params, grads and optimizer state with Megatron-FSDP"})
    use_distributed_optimizer: bool = field(default=True, metadata={"help": "shard optimizer state across data-parallel ranks (ZeRO-1)"})


@dataclass
class OptimConfig:
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    min_lr: float = field(default=1e-4, metadata={"help": "learning rate at the end of the cosine decay"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps before the cosine decay"})
    weight_decay: float = field(default=0.01, metadata={"help": "decoupled weight decay (AdamW)"})
    clip_grad: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this value (0 disables)"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata={"help": "Adam betas [beta1, beta2]"})
    eps: float = field(default=1e-8, metadata={"help": "Adam epsilon"})
    use_precision_aware_optimizer: bool = field(default=False, metadata={"help": "keep optimizer state in the dtypes below (needs Transformer Engine)"})
    main_grads_dtype: str = field(default="fp32", metadata={"help": "precision-aware: main gradient dtype fp32 | bf16 | fp16"})
    exp_avg_dtype: str = field(default="fp32", metadata={"help": "precision-aware: Adam first-moment dtype fp32 | bf16 | fp16"})
    exp_avg_sq_dtype: str = field(default="fp32", metadata={"help": "precision-aware: Adam second-moment dtype fp32 | bf16 | fp16"})
    override_optimizer_config: dict = field(default_factory=dict, metadata={"help": "megatron-core OptimizerConfig fields set last (win over everything)"})


@dataclass
class DDPConfig:
    override_ddp_config: dict = field(default_factory=dict, metadata={"help": "megatron-core DistributedDataParallelConfig fields set last (always win)"})


@dataclass
class DataConfig:
    path: str = field(default="arithmetic", metadata={"help": "json/jsonl/parquet file or dir, a hub dataset name, or `arithmetic` (bundled)"})
    hub_config: str = field(default="", metadata={"help": "hub dataset configuration name (e.g. `main` for openai/gsm8k)"})
    eval_path: str = field(default="", metadata={"help": "held-out data (same forms as data.path); default: the test split of data.path"})
    prompt_field: str = field(default="question", metadata={"help": "row field holding the prompt"})
    response_field: str = field(default="answer", metadata={"help": "row field holding the response"})
    messages_field: str = field(default="", metadata={"help": "row field holding chat messages [{role, content}] (overrides prompt/response)"})
    max_seq_len: int = field(default=128, metadata={"help": "tokens per sample; longer samples are truncated from the right"})
    pack: bool = field(default=False, metadata={"help": "pack several samples per row (positions restart, no cross-sample attention)"})


@dataclass
class TrainConfig:
    steps: int = field(default=600, metadata={"help": "optimizer steps (also the learning-rate schedule's length)"})
    global_batch_size: int = field(default=32, metadata={"help": "samples per optimizer step, over all data-parallel ranks"})
    micro_batch_size: int = field(default=8, metadata={"help": "samples per forward/backward on one rank"})
    seed: int = field(default=1234, metadata={"help": "seed for weights init, data order and sampling"})
    out_dir: str = field(default="outputs/sft", metadata={"help": "directory for metrics.jsonl, hf/ and checkpoints"})
    exit_interval: int = field(default=0, metadata={"help": "save a checkpoint and exit 0 at this step (0: off)"})
    eval_interval: int = field(default=300, metadata={"help": "evaluate every N steps and at the end (0: only at the end)"})
    eval_samples: int = field(default=100, metadata={"help": "held-out samples per evaluation"})
    log_interval: int = field(default=20, metadata={"help": "console line every N steps (metrics.jsonl gets every step)"})


@dataclass
class CkptConfig:
    dir: str = field(default="", metadata={"help": "checkpoint directory (default: <train.out_dir>/checkpoints)"})
    save_interval: int = field(default=0, metadata={"help": "save every N steps (0: only at the end)"})
    keep_last: int = field(default=2, metadata={"help": "keep the newest N complete checkpoints"})


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)


# ---------------------------------------------------------------- keys, values, parsing


def flat_keys(config_class) -> dict[str, dataclasses.Field]:
    """Every dotted key of a config class, mapped to its dataclass field."""
    keys = {}
    for section in dataclasses.fields(config_class):
        for item in dataclasses.fields(section.type):
            keys[f"{section.name}.{item.name}"] = item
    return keys


def _coerce(key: str, value, annotation):
    """Check/convert one value to the field's type; raise UserError naming the key otherwise."""
    origin = typing.get_origin(annotation) or annotation
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}[origin]
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is float and isinstance(value, str):
        try:  # YAML 1.1 reads `1e-3` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if origin is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if (origin is int and isinstance(value, bool)) or not isinstance(value, origin):
        raise UserError(f"`{key}` must be {expected}, got {value!r}. Change `--{key}` (or `{key}` in the YAML file).")
    if origin is list:
        return [_coerce(key, item, typing.get_args(annotation)[0]) for item in value]
    return value


def _set(config, key: str, value, keys: dict) -> None:
    """Set one dotted key, rejecting unknown keys with the closest known ones."""
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=2, cutoff=0.8)
        hint = f" Did you mean {', '.join(f'`{k}`' for k in close)}?" if close else ""
        raise UserError(f"Unknown config key `{key}`.{hint} `--help` lists every key.")
    section, name = key.split(".")
    setattr(getattr(config, section), name, _coerce(key, value, keys[key].type))


def _flatten(mapping: dict, prefix: str = "") -> dict:
    """YAML nesting -> dotted keys (stopping at mapping-valued fields such as override_* dicts)."""
    flat = {}
    for name, value in mapping.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict) and dotted.count(".") == 0:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def help_text(config_class, program: str) -> str:
    """`--help`: every key with its default and meaning."""
    lines = [f"usage: torchrun --nproc-per-node N -m {program} [--config FILE.yaml] [--KEY=VALUE ...] "
             "[--resume-from-checkpoint latest|PATH]", "", "keys (default: meaning):"]
    for key, item in flat_keys(config_class).items():
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        lines.append(f"  --{key}={json.dumps(default)}\n      {item.metadata['help']}")
    return "\n".join(lines)


def parse_args(config_class, argv: list[str], program: str):
    """Parse `--config`, `--resume-from-checkpoint` and `--key=value` / `--key value`; returns (config, resume)."""
    keys = flat_keys(config_class)
    if "--help" in argv or "-h" in argv:
        print(help_text(config_class, program))
        sys.exit(0)
    pairs, resume, config_file = [], "", None
    position = 0
    while position < len(argv):
        argument = argv[position]
        if not argument.startswith("--"):
            raise UserError(f"Unexpected argument `{argument}`: settings are given as `--key=value`. `--help` lists every key.")
        name, has_value, value = argument[2:].partition("=")
        if not has_value:
            if position + 1 >= len(argv):
                raise UserError(f"`--{name}` needs a value (`--{name}=VALUE`).")
            position += 1
            value = argv[position]
        if name == "config":
            config_file = value
        elif name == "resume-from-checkpoint":
            resume = value
        else:
            pairs.append((name, yaml.safe_load(value) if value != "" else ""))
        position += 1
    config = config_class()
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise UserError(f"Config file `{config_file}` does not exist. Change `--config`.")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise UserError(f"Config file `{config_file}` must hold a mapping of sections (model:, train:, ...).")
        for key, value in _flatten(loaded).items():
            _set(config, key, value, keys)
    for key, value in pairs:
        _set(config, key, value, keys)
    return config, resume


def to_dict(config) -> dict:
    """The config as a plain nested dict (for logs and checkpoints)."""
    return dataclasses.asdict(config)


# ---------------------------------------------------------------- start-up validation


def _hf_config(path: str) -> dict:
    """config.json of an HF checkpoint directory, or a UserError naming `model.path`."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise UserError(f"`model.path={path}` is not a Hugging Face checkpoint directory (no config.json there). "
                        "Point `--model.path` at a directory saved with `save_pretrained`, or use `tiny`.")
    return json.loads(config_file.read_text())


def validate_startup(config, world_size: int) -> None:
    """Cross-field checks that need no model: dtypes, parallel layout vs world size and model shape, batch sizes."""
    if config.model.dtype not in DTYPE_NAMES:
        raise UserError(f"`model.dtype={config.model.dtype}` is not one of {', '.join(DTYPE_NAMES)}. Change `--model.dtype`.")
    if config.model.attention not in ATTENTION_NAMES:
        raise UserError(f"`model.attention={config.model.attention}` is not one of {', '.join(ATTENTION_NAMES)}. "
                        "Change `--model.attention`.")
    if config.model.attention == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        raise UserError("`model.attention=transformer_engine` needs Transformer Engine, which is not installed. "
                        "Use `--model.attention=auto` (SDPA without it), or install it (README, GPUs).")
    parallel = config.parallel
    for key in ("tp", "pp", "vpp"):
        if getattr(parallel, key) < 1:
            raise UserError(f"`parallel.{key}` must be at least 1, got {getattr(parallel, key)}.")
    if world_size % (parallel.tp * parallel.pp):
        raise UserError(f"`parallel.tp={parallel.tp}` x `parallel.pp={parallel.pp}` must divide the number of processes "
                        f"({world_size}). Change `--parallel.tp`/`--parallel.pp` or `--nproc-per-node`.")
    if parallel.vpp > 1 and parallel.pp == 1:
        raise UserError("`parallel.vpp` > 1 needs pipeline parallelism (`parallel.pp` > 1).")
    if parallel.use_megatron_fsdp and parallel.pp > 1:
        # Measured with megatron-fsdp 0.6.1: the model build fails in its device-mesh set-up (an einops error).
        raise UserError("`parallel.use_megatron_fsdp=true` does not work with pipeline parallelism in this stack "
                        f"(`parallel.pp={parallel.pp}`). Use `--parallel.use_megatron_fsdp=false` (DDP with the distributed "
                        "optimizer, which also shards optimizer state) or `--parallel.pp=1`.")
    if config.model.path != "tiny":
        hf = _hf_config(config.model.path)
        heads, kv_heads = hf.get("num_attention_heads", 1), hf.get("num_key_value_heads") or hf.get("num_attention_heads", 1)
        if heads % parallel.tp or kv_heads % parallel.tp:
            raise UserError(f"`parallel.tp={parallel.tp}` must divide the model's {heads} attention heads and {kv_heads} "
                            "key/value heads. Change `--parallel.tp`.")
        layers = hf.get("num_hidden_layers", 1)
        if layers % (parallel.pp * parallel.vpp):
            raise UserError(f"`parallel.pp={parallel.pp}` x `parallel.vpp={parallel.vpp}` must divide the model's {layers} layers.")
    train = config.train
    for key in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(train, key) < 1:
            raise UserError(f"`train.{key}` must be at least 1, got {getattr(train, key)}.")
    data_parallel = world_size // (parallel.tp * parallel.pp)
    if train.global_batch_size % (train.micro_batch_size * data_parallel):
        raise UserError(f"`train.global_batch_size={train.global_batch_size}` must be a multiple of `train.micro_batch_size="
                        f"{train.micro_batch_size}` x data-parallel size {data_parallel}.")


def run_cli(main) -> None:
    """Run `main(argv)`; a UserError becomes a one-paragraph message on rank 0 and exit status 2."""
    try:
        main(sys.argv[1:])
    except UserError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)



# ---------------------------------------------------------------- GRPO sections


@dataclass
class GRPOModelConfig(ModelConfig):
    path: str = field(default="outputs/sft/hf", metadata={"help": "HF checkpoint directory, or `tiny`; the default is the default SFT's output (that SFT runs first when it is missing)"})


@dataclass
class GRPOOptimConfig(OptimConfig):
    # Half the SFT's final learning rate, held: on the tiny model 5e-5 raises the reward as much as 1e-4 and
    # keeps the held-out accuracy, 1e-4 lowers it a little, 2e-4 or more lowers the reward (measured, see README).
    lr: float = field(default=5e-5, metadata={"help": "peak learning rate"})
    min_lr: float = field(default=5e-5, metadata={"help": "learning rate at the end of the cosine decay"})
    warmup_steps: int = field(default=5, metadata={"help": "linear warmup steps before the cosine decay"})


@dataclass
class GRPODataConfig:
    path: str = field(default="arithmetic", metadata={"help": "prompts: json/jsonl/parquet file or dir, a hub dataset name, or `arithmetic` (bundled)"})
    hub_config: str = field(default="", metadata={"help": "hub dataset configuration name (e.g. `main` for openai/gsm8k)"})
    eval_path: str = field(default="", metadata={"help": "held-out prompts (same forms as data.path); default: the test split of data.path"})
    prompt_field: str = field(default="question", metadata={"help": "row field holding the prompt"})
    response_field: str = field(default="answer", metadata={"help": "row field holding the reference answer the reward compares with"})
    messages_field: str = field(default="", metadata={"help": "row field holding chat messages (the last assistant turn is the reference)"})
    max_seq_len: int = field(default=128, metadata={"help": "prompt + completion tokens; prompts longer than this minus grpo.max_new_tokens are skipped and counted"})


@dataclass
class GRPOTrainConfig(TrainConfig):
    steps: int = field(default=40, metadata={"help": "GRPO steps (rollout + update; also the learning-rate schedule's length)"})
    # 64 prompts a step: the tiny model learns facts one prompt at a time, and smaller steps mostly add noise.
    global_batch_size: int = field(default=512, metadata={"help": "completions per step over all data-parallel ranks (prompts per step x grpo.n_samples)"})
    micro_batch_size: int = field(default=64, metadata={"help": "completions per forward/backward on one rank"})
    out_dir: str = field(default="outputs/grpo", metadata={"help": "directory for metrics.jsonl, hf/ and checkpoints"})
    eval_interval: int = field(default=0, metadata={"help": "greedy held-out accuracy every N steps and at the end (0: only at the end)"})
    eval_samples: int = field(default=1000, metadata={"help": "held-out prompts per evaluation"})
    log_interval: int = field(default=5, metadata={"help": "console line every N steps (metrics.jsonl gets every step)"})


@dataclass
class GRPOConfig:
    n_samples: int = field(default=8, metadata={"help": "completions sampled per prompt (one advantage group)"})
    reward: str = field(default="arithmetic", metadata={"help": "reward function: arithmetic | gsm8k | gsm8k_flexible, or your own as module:function"})
    format_bonus: float = field(default=0.0, metadata={"help": "added to the reward of a completion that ends with a `#### N` answer"})
    baseline: str = field(default="mean", metadata={"help": "advantage baseline within a group: mean | leave_one_out"})
    scale_rewards: bool = field(default=True, metadata={"help": "divide advantages by the group's reward std (false: Dr. GRPO)"})
    kl_coef: float = field(default=0.01, metadata={"help": "weight of the KL penalty to a frozen copy of the starting model (0: no reference model)"})
    kl_estimator: str = field(default="k3", metadata={"help": "per-token KL estimator: k1 | k3"})
    clip_low: float = field(default=0.2, metadata={"help": "PPO ratio clip below: 1 - clip_low"})
    clip_high: float = field(default=0.28, metadata={"help": "PPO ratio clip above: 1 + clip_high (DAPO's clip-higher when > clip_low)"})
    dual_clip: float = field(default=3.0, metadata={"help": "bound the loss of negative-advantage tokens at dual_clip x |A| (0: off, else > 1)"})
    loss_aggregation: str = field(default="token_mean", metadata={"help": "token_mean (over the global batch) | seq_mean_token_mean"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each step's rollouts"})
    mini_batches: int = field(default=1, metadata={"help": "optimizer updates per pass (the rollouts are split into this many)"})
    max_new_tokens: int = field(default=32, metadata={"help": "longest completion in tokens (generation stops earlier at EOS)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of rollouts (log-probs use the same)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass of rollouts (1: off)"})
    top_k: int = field(default=0, metadata={"help": "sample rollouts from the k most likely tokens (0: off)"})


@dataclass
class GRPOTrainerConfig:
    model: GRPOModelConfig = field(default_factory=GRPOModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: GRPOOptimConfig = field(default_factory=GRPOOptimConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    data: GRPODataConfig = field(default_factory=GRPODataConfig)
    train: GRPOTrainConfig = field(default_factory=GRPOTrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
