"""The configuration of both loops: nested dataclasses with defaults in code, and every check that needs no model.

`SFTConfig` and `GRPOConfig` share their sections; GRPO's defaults are overrides of the same sections.
`config.validate(world_size)` runs every check that needs neither a model nor data, and raises a
`UserError` naming the key to change. Derived values (the data-parallel size, whether Transformer Engine
is installed, whether the precision-aware optimizer is in use) are defined here, once.
"""

import dataclasses
import functools
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from config.errors import UserError

log = logging.getLogger(__name__)

DTYPE_NAMES = ("fp32", "bf16", "fp16")
# GRPO's named choices; trainer/grpo_math.py maps each name to its function.
BASELINES = ("mean", "leave_one_out")
KL_ESTIMATORS = ("k1", "k3")
IMPORTANCE_RATIOS = ("token", "sequence")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
FILTER_METRICS = ("accuracy", "reward")  # what dynamic sampling's groups must vary in (trainer/grpo.py)
ROLLOUT_CORRECTIONS = ("none", "tis")  # grpo.rollout_correction (trainer/grpo_update.py)
TOOL_ISOLATIONS = ("process", "thread")  # where a plain-function tool call runs (data/tool_runner.py)
ATTENTION_NAMES = ("auto", "sdpa", "local", "transformer_engine")
# megatron-core's MoE token dispatchers that run without extra kernels (`flex` needs DeepEP or HybridEP).
MOE_DISPATCHERS = ("alltoall", "allgather")
# The MoE router's settings (`model.moe_*`): megatron-core's load-balancing losses (its moe_router_load_balancing_type
# names), the router's compute dtypes, and `default` for the checkpoint's own (Megatron-Bridge's provider) value.
MOE_AUX_LOSS_TYPES = ("default", "aux_loss", "seq_aux_loss", "global_aux_loss", "none")
MOE_ROUTER_DTYPES = ("default", "fp32", "fp64")
MOE_ROUTER_KEYS = ("moe_aux_loss_coeff", "moe_aux_loss_type", "moe_z_loss_coeff", "moe_router_dtype", "moe_freeze_router")
# Where an HF config.json holds the routed experts per MoE layer: Qwen2/3-MoE; Mixtral and gpt-oss; DeepSeek and Kimi.
HF_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
RECOMPUTE_NAMES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# megatron-core 0.19.2's recompute_modules that the model families this trainer builds have. Left out: `moe_act`
# (needs grouped-GEMM experts), `mla_up_proj` (multi-latent attention), `gdn_norm_out` (gated delta nets).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts")
# `model.path` names of the embedded models, built offline on first use (model/tiny.py): the default dense Qwen2 and
# a Qwen3-MoE of the same size class for expert parallelism and routing replay.
EMBEDDED_MODELS = ("tiny", "tiny-moe")
# The reward whose full marks are the held-out accuracy of SFT, and GRPO's default reward.
DEFAULT_REWARD = "arithmetic"


@functools.cache
def have_transformer_engine() -> bool:
    """Whether Transformer Engine is installed (its layers, fusions and FusedAdam are then available)."""
    return importlib.util.find_spec("transformer_engine") is not None


def have_wandb() -> bool:
    """Whether Weights & Biases is installed (the project's optional `wandb` extra)."""
    return importlib.util.find_spec("wandb") is not None


# ---------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    path: str = field(default="tiny", metadata={"help": "HF checkpoint directory, or an embedded model built offline on first use: `tiny` (the default, a ~1M parameter Qwen2) | `tiny-moe` (a Qwen3-MoE, 8 experts, top-2)"})
    dtype: str = field(default="fp32", metadata={"help": "parameter dtype: bf16 | fp16 | fp32 (use bf16 on GPUs)"})
    attention: str = field(default="auto", metadata={"help": "core attention: auto (Transformer Engine when installed, else sdpa) | sdpa | local | transformer_engine"})
    recompute: str = field(default="none", metadata={"help": "activation recomputation: none | selective (model.recompute_modules) | full (whole layers)"})
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"], metadata={"help": "selective: submodules recomputed in backward: core_attn | mlp | moe | shared_experts | layernorm (needs Transformer Engine)"})
    recompute_method: str = field(default="uniform", metadata={"help": "full: uniform (every layer, in groups of recompute_num_layers) | block (the first recompute_num_layers of each stage)"})
    recompute_num_layers: int = field(default=1, metadata={"help": "full: layers per recomputed group (uniform) or recomputed layers per pipeline stage (block)"})
    moe_dispatcher: str = field(default="alltoall", metadata={"help": "Mixture-of-Experts token dispatcher (megatron-core's moe_token_dispatcher_type): alltoall (each token sent only to the expert-parallel ranks holding its experts) | allgather (every rank gathers every token; parallel.ep=1 only)"})
    moe_aux_loss_coeff: float | None = field(default=None, metadata={"help": "MoE: weight of the auxiliary load-balancing loss (unset: the checkpoint's, 1e-3 for Qwen3-MoE; GRPO's default 0: off, as verl and NeMo-RL run RL; slime's scripts 0)"})
    moe_aux_loss_type: str = field(default="default", metadata={"help": "MoE: which load-balancing loss: default (the checkpoint's, aux_loss for Qwen3-MoE) | aux_loss (per micro-batch) | seq_aux_loss (per sequence, DeepSeek's) | global_aux_loss (over the global batch) | none (NeMo-RL's for RL)"})
    moe_z_loss_coeff: float | None = field(default=None, metadata={"help": "MoE: weight of the router z-loss, which keeps the router's logits small (unset or 0: off, as in every peer's RL defaults)"})
    moe_router_dtype: str = field(default="default", metadata={"help": "MoE: dtype of the router's logits, top-k and softmax: default (the checkpoint's; Qwen3-MoE: the model's dtype) | fp32 | fp64 (NeMo-RL's for RL)"})
    moe_freeze_router: bool = field(default=False, metadata={"help": "MoE: the router's weights take no gradient and never change (NeMo-RL's freeze_moe_router, on in its RL recipes; expert-bias updates stop too)"})


@dataclass
class ParallelConfig:
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree (divides the attention and KV heads)"})
    pp: int = field(default=1, metadata={"help": "pipeline-parallel degree (divides the layers)"})
    vpp: int = field(default=1, metadata={"help": "virtual pipeline stages per PP rank (interleaved 1F1B when > 1)"})
    ep: int = field(default=1, metadata={"help": "expert-parallel degree of Mixture-of-Experts models: each rank holds num_experts / ep of every MoE layer's experts and tokens are exchanged with its peers (divides the experts; etp x ep x pp divides the number of processes)"})
    etp: int = field(default=0, metadata={"help": "expert tensor-parallel degree: each expert's weights split over this many ranks (0: megatron-core's default, parallel.tp)"})
    sequence_parallel: bool = field(default=True, metadata={"help": "with tp > 1, split norms, dropout and residuals along the sequence over the TP group (no effect at tp=1)"})
    use_megatron_fsdp: bool = field(default=False, metadata={"help": "shard params, grads and optimizer state with Megatron-FSDP"})
    use_distributed_optimizer: bool = field(default=True, metadata={"help": "shard optimizer state across data-parallel ranks (ZeRO-1)"})
    timeout_minutes: int = field(default=30, metadata={"help": "how long a rank waits in a collective before the run fails (torch.distributed's process-group timeout, NCCL's watchdog; megatron-core's distributed_timeout_minutes). GRPO with tools: a turn's tools run while the peers wait, and start-up refuses a turn that could take longer"})

    def data_parallel_size(self, world_size: int) -> int:
        """Processes per model replica are tp x pp; the rest is data parallelism."""
        return world_size // (self.tp * self.pp)

    @property
    def expert_tensor_parallel_size(self) -> int:
        """Ranks each expert's weights are split over: `etp`, or megatron-core's default (`tp`) when it is 0."""
        return self.etp or self.tp

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Copies of each expert: the processes left after etp x ep x pp (megatron-core's expert grid)."""
        return world_size // (self.expert_tensor_parallel_size * self.ep * self.pp)

    @property
    def uses_sequence_parallel(self) -> bool:
        """Sequence parallelism splits the tensor-parallel group's work, so it exists only with tp > 1."""
        return self.sequence_parallel and self.tp > 1

    @property
    def sequence_multiple(self) -> int:
        """Every batch's sequence length must be a multiple of this: sequence parallelism splits it over the TP ranks."""
        return self.tp if self.uses_sequence_parallel else 1


@dataclass
class OptimConfig:
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    min_lr: float | None = field(default=None, metadata={"help": "learning rate at the end of the cosine decay (unset: optim.lr x optim.min_lr_ratio)"})
    min_lr_ratio: float = field(default=0.05, metadata={"help": "with optim.min_lr unset, the decay ends at optim.lr x this (GRPO's default 1: a constant rate after warmup)"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps before the cosine decay"})
    weight_decay: float = field(default=0.01, metadata={"help": "decoupled weight decay (AdamW)"})
    clip_grad: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this value (0 disables)"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata={"help": "Adam betas [beta1, beta2]"})
    eps: float = field(default=1e-8, metadata={"help": "Adam epsilon"})
    use_precision_aware_optimizer: bool = field(default=False, metadata={"help": "bf16: keep optimizer state in the dtypes below (needs Transformer Engine)"})
    main_grads_dtype: str = field(default="fp32", metadata={"help": "precision-aware: main gradient dtype fp32 | bf16 | fp16"})
    exp_avg_dtype: str = field(default="fp32", metadata={"help": "precision-aware: Adam first-moment dtype fp32 | bf16 | fp16"})
    exp_avg_sq_dtype: str = field(default="fp32", metadata={"help": "precision-aware: Adam second-moment dtype fp32 | bf16 | fp16"})
    override_optimizer_config: dict = field(default_factory=dict, metadata={"help": "megatron-core OptimizerConfig fields set last (win over everything)"})

    @property
    def final_lr(self) -> float:
        """The learning rate the cosine decay ends at: `min_lr`, or `lr x min_lr_ratio` when it is unset."""
        return self.lr * self.min_lr_ratio if self.min_lr is None else self.min_lr


@dataclass
class DDPConfig:
    override_ddp_config: dict = field(default_factory=dict, metadata={"help": "megatron-core DistributedDataParallelConfig fields set last (always win)"})


@dataclass
class DataConfig:
    path: str = field(default="arithmetic", metadata={"help": "json/jsonl/parquet file or dir, a hub dataset name, or `arithmetic` (bundled)"})
    hub_config: str = field(default="", metadata={"help": "hub dataset configuration name (e.g. `main` for openai/gsm8k)"})
    eval_path: str = field(default="", metadata={"help": "held-out data (same forms as data.path); default: the test split of data.path"})
    prompt_field: str = field(default="question", metadata={"help": "row field holding the prompt"})
    response_field: str = field(default="answer", metadata={"help": "row field holding the response (GRPO: the reference answer the reward compares with)"})
    messages_field: str = field(default="", metadata={"help": "row field holding chat messages [{role, content}] (overrides prompt/response; the last assistant turn is the response)"})
    max_seq_len: int = field(default=128, metadata={"help": "tokens per sample, longer ones are cut from the right (GRPO: prompt + completion; longer prompts are skipped and counted)"})
    pack: bool = field(default=False, metadata={"help": "SFT: pack several samples per row (positions restart, no cross-sample attention)"})
    cache: bool = field(default=True, metadata={"help": "keep tokenized data in $TRAINER_CACHE_DIR (default ~/.cache/megatron-trainer) and reuse it while the data, tokenizer and chat template are unchanged: SFT's examples (and data.max_seq_len), GRPO's prompts"})


@dataclass
class TrainConfig:
    steps: int = field(default=600, metadata={"help": "optimizer steps (GRPO: rollout + update steps); also the learning-rate schedule's length"})
    # The embedded default SFT: 64 samples a step (one micro-batch per rank on 2 processes) learn the arithmetic table
    # in 600 steps, which 32 did not (docs/grpo.md has the measured accuracies and their command).
    global_batch_size: int = field(default=64, metadata={"help": "samples per step over all data-parallel ranks (GRPO: completions, prompts per step x grpo.n_samples)"})
    micro_batch_size: int = field(default=32, metadata={"help": "samples per forward/backward on one rank"})
    micro_batch_tokens: int = field(default=0, metadata={"help": "a token budget per micro-batch instead (verl's ppo_max_token_len_per_gpu): a rank's rows sorted by length and grouped while rows x padded length fits, every rank with the same number of micro-batches (GRPO: within each of grpo.mini_batches); at least data.max_seq_len; not with pipeline stages or data.pack; 0: train.micro_batch_size rows each, in order"})
    seed: int = field(default=1234, metadata={"help": "seed for weights init, data order and sampling"})
    out_dir: str = field(default="outputs/sft", metadata={"help": "directory for metrics.jsonl, metrics.png, hf/ and checkpoints (on a shared file system for several nodes)"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "a fresh run may replace an earlier run in train.out_dir (its checkpoints and metrics are deleted first); without it such a run is refused"})
    exit_interval: int = field(default=0, metadata={"help": "save a checkpoint and exit 0 at this step (0: off)"})
    eval_interval: int = field(default=300, metadata={"help": "evaluate on held-out data every N steps and at the end (0: only at the end)"})
    eval_samples: int = field(default=100, metadata={"help": "held-out samples per evaluation (0: no evaluation)"})
    log_interval: int = field(default=20, metadata={"help": "console line every N steps, and GRPO's sampled completions to samples.jsonl (metrics.jsonl, TensorBoard and W&B get every step)"})

    def evaluates_at(self, step: int) -> bool:
        """Held-out evaluation after `step`: every `eval_interval` steps, and after the last."""
        return step == self.steps or bool(self.eval_interval and step % self.eval_interval == 0)

    def logs_at(self, step: int) -> bool:
        """A console line (and GRPO's samples) after `step`: the first step, every `log_interval` steps, and the last."""
        return step in (1, self.steps) or step % self.log_interval == 0


@dataclass
class CkptConfig:
    dir: str = field(default="", metadata={"help": "checkpoint directory (default: <train.out_dir>/checkpoints)"})
    save_interval: int = field(default=0, metadata={"help": "save every N steps (0: only at the end)"})
    keep_last: int = field(default=2, metadata={"help": "keep the newest N complete checkpoints"})
    async_save: bool = field(default=True, metadata={"help": "write model and optimizer in the background (megatron-core's asynchronous checkpointing: a forked writer per save) while training goes on; `latest` moves when every rank's part is on disk. Megatron-FSDP saves synchronously"})


# megatron-core's names of the linear layers LoRA may adapt (attention's fused QKV and output projection, the MLP's
# fused gate/up and down projections), and the method names.
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
PEFT_METHODS = ("none", "lora")


@dataclass
class PeftConfig:
    method: str = field(default="none", metadata={"help": "parameter-efficient fine-tuning: none (every weight trains) | lora (adapters on a frozen base, Megatron-Bridge's LoRA)"})
    rank: int = field(default=8, metadata={"help": "LoRA: rank of each adapter"})
    alpha: float = field(default=16.0, metadata={"help": "LoRA: scale of the adapter's output is alpha / rank"})
    dropout: float = field(default=0.0, metadata={"help": "LoRA: dropout on the adapter's input while training"})
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES), metadata={"help": "LoRA: megatron-core's linear layers to adapt: linear_qkv | linear_proj | linear_fc1 | linear_fc2"})


@dataclass
class LogConfig:
    tensorboard: bool = field(default=False, metadata={"help": "also write every metrics.jsonl scalar to TensorBoard event files in <train.out_dir>/tb/ (rank 0)"})
    wandb: bool = field(default=False, metadata={"help": "also log every metrics.jsonl scalar to Weights & Biases (needs the `wandb` extra; WANDB_MODE=offline works without a network)"})
    wandb_project: str = field(default="", metadata={"help": "W&B project (default: $WANDB_PROJECT, else `megatron-trainer`)"})
    wandb_name: str = field(default="", metadata={"help": "W&B run name (default: $WANDB_NAME, else W&B picks one)"})


@dataclass
class GRPOSection:
    n_samples: int = field(default=8, metadata={"help": "completions sampled per prompt (one advantage group)"})
    reward: str = field(default=DEFAULT_REWARD, metadata={"help": "reward function: arithmetic | gsm8k | gsm8k_flexible | none (0: an environment's reward() alone), or your own as module:function returning a number (full marks, 1.0, are the accuracy) or (reward, correct)"})
    format_bonus: float = field(default=0.0, metadata={"help": "added to the reward of a completion that ends with a `#### N` answer"})
    overlong_buffer: int = field(default=0, metadata={"help": "DAPO's soft overlong penalty: completions longer than max_new_tokens - overlong_buffer tokens lose reward linearly, up to overlong_penalty at the budget (0: off)"})
    overlong_penalty: float = field(default=1.0, metadata={"help": "the reward lost by a completion that reaches max_new_tokens, with overlong_buffer > 0"})
    baseline: str = field(default="mean", metadata={"help": f"advantage baseline within a group: {' | '.join(BASELINES)} (the group mean, GRPO; the mean of the others, RLOO)"})
    scale_rewards: bool = field(default=True, metadata={"help": "divide advantages by the group's reward std (false: Dr. GRPO)"})
    dynamic_sampling: bool = field(default=False, metadata={"help": "DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the batch is full"})
    max_sampling_rounds: int = field(default=4, metadata={"help": "with dynamic_sampling, at most this many generation rounds per step (at least 2); a batch still short after them is filled with dropped groups"})
    filter_metric: str = field(default="accuracy", metadata={"help": f"with dynamic_sampling, what a group must vary in to be kept: {' | '.join(FILTER_METRICS)} (accuracy: the reward function's full marks or its (reward, correct), or an environment's (reward, correct), as DAPO and verl's filter_groups.metric=acc; reward: the shaped reward, environment's, overlong penalty and format bonus included)"})
    tolerate_reward_errors: bool = field(default=False, metadata={"help": "go on when the reward function fails on every completion of a step (scored 0) instead of stopping with its error"})
    # On by default: without it (TRL's default) the default GRPO damaged the held-out arithmetic, and skipping the
    # reference forward did not shorten a CPU step measurably (docs/grpo.md).
    kl_coef: float = field(default=0.01, metadata={"help": "weight of the KL penalty to a frozen copy of the starting model (0: no reference model)"})
    kl_estimator: str = field(default="k3", metadata={"help": f"per-token KL estimator: {' | '.join(KL_ESTIMATORS)}"})
    importance_ratio: str = field(default="token", metadata={"help": f"importance ratio pi / pi_old: {' | '.join(IMPORTANCE_RATIOS)} (per token, PPO and GRPO; per completion, length-normalised, GSPO: use a small clip range such as 3e-4 / 4e-4)"})
    clip_low: float = field(default=0.2, metadata={"help": "PPO ratio clip below: 1 - clip_low"})
    clip_high: float = field(default=0.28, metadata={"help": "PPO ratio clip above: 1 + clip_high (DAPO's clip-higher when > clip_low)"})
    dual_clip: float = field(default=3.0, metadata={"help": "bound the loss of negative-advantage tokens at dual_clip x |A| (0: off, else > 1)"})
    mask_truncated: bool = field(default=False, metadata={"help": "leave completions cut at max_new_tokens out of the loss (they still count in their group's advantages)"})
    entropy_coef: float = field(default=0.0, metadata={"help": "weight of an entropy bonus: the loss subtracts entropy_coef x the aggregated token entropy"})
    loss_aggregation: str = field(default="token_mean", metadata={"help": f"token losses to one loss: {' | '.join(LOSS_AGGREGATIONS)} (the token mean over the global batch, DAPO; the mean over completions of each one's token mean, GRPO; each completion's token sum over max_new_tokens, Dr. GRPO)"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each step's rollouts"})
    mini_batches: int = field(default=1, metadata={"help": "optimizer updates per pass (the rollouts are split into this many)"})
    max_new_tokens: int = field(default=32, metadata={"help": "longest completion in tokens (generation stops earlier at EOS)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of rollouts (log-probs use the same)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass of rollouts (1: off)"})
    top_k: int = field(default=0, metadata={"help": "sample rollouts from the k most likely tokens (0: off)"})
    routing_replay: bool = field(default=True, metadata={"help": "Mixture-of-Experts policies: the training forwards that score a rollout's tokens (pi_old's, the policy's and the KL reference's) route each token to the experts it took in the rollout (megatron-core's RouterReplay), so both sides run the same experts; the KL term then measures the change of weights along the rollout's experts, not a trained router's drift; `moe_route_mismatch` is logged either way (dense models: no effect)"})
    rollout_correction: str = field(default="none", metadata={"help": f"correct the gap between the sampler's and the training forward's log-probs: {' | '.join(ROLLOUT_CORRECTIONS)} (tis: each token's policy-gradient term weighted by pi_old / pi_sampler, truncated at grpo.rollout_correction_cap, as verl's rollout_is and TRL's vllm_importance_sampling_correction)"})
    rollout_correction_cap: float = field(default=2.0, metadata={"help": "with rollout_correction=tis, the largest weight (verl's rollout_is_threshold 2.0)"})
    tools: list[str] = field(default_factory=list, metadata={"help": "tools the policy may call in its rollouts, each a typed, documented function as module:function (schema from its signature and docstring; docs/tools.md)"})
    environment: str = field(default="", metadata={"help": "a stateful task as module:Class: one instance per episode, reset(row) first, its public methods the tools, an optional reward() added to grpo.reward's score"})
    max_turns: int = field(default=4, metadata={"help": "with tools, at most this many assistant turns per episode (a tool call in the last is not run)"})
    max_tool_response_tokens: int = field(default=256, metadata={"help": "with tools, a tool result longer than this many tokens is cut (its message says so)"})
    tool_timeout: float = field(default=10.0, metadata={"help": "with tools, seconds each call may take from its own start; a slower one answers with a timeout error (a plain function's episode goes on; an environment's episode ends)"})
    tool_workers: int = field(default=0, metadata={"help": "with tools, calls run at once on each rank (an episode's calls always one after another, in order); 0: this rank's share of the node's cores (raise it for tools that wait on the network)"})
    tool_isolation: str = field(default="process", metadata={"help": f"with tools, where a plain function's call runs: {' | '.join(TOOL_ISOLATIONS)} (a reused worker process, killed at the timeout, so a hung or CPU-bound tool neither leaks nor holds the trainer's GIL; or a thread of the trainer, cheaper, but one past its timeout runs on). An environment's methods always run in threads"})


# ---------------------------------------------------------------- the two loops' configurations


def _require(holds: bool, message: str) -> None:
    """Raise `message` as a UserError unless `holds`."""
    if not holds:
        raise UserError(message)


@dataclass
class TrainerConfig:
    """The sections both loops share, and the checks that apply to both."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)

    @property
    def precision_aware(self) -> bool:
        """fp16 always keeps fp32 master weights in TE's FusedAdam; bf16 only when the user opts in."""
        return self.model.dtype == "fp16" or (self.model.dtype == "bf16" and self.optim.use_precision_aware_optimizer)

    def validate(self, world_size: int) -> None:
        """Every check that needs no model and no data; each error names the key to change."""
        self._validate_parallel(world_size)
        self._validate_model()
        self._validate_optimizer()
        self._validate_schedule()
        self._validate_batch(world_size)
        self._validate_log()
        self._validate_peft()

    def validate_model_shape(self, model_path: Path) -> None:
        """The parallel layout against the checkpoint's shape (heads and layers), before the model is built."""
        hf = read_hf_config(model_path, "model.path")
        read_hf_config(model_path, "model.path", "generation_config.json")  # its end ids are read later
        parallel = self.parallel
        heads = hf.get("num_attention_heads", 1)
        kv_heads = hf.get("num_key_value_heads") or heads
        _require(heads % parallel.tp == 0 and kv_heads % parallel.tp == 0,
                 f"`parallel.tp={parallel.tp}` must divide the model's {heads} attention heads and {kv_heads} key/value heads. "
                 "Change `--parallel.tp`.")
        layers = hf.get("num_hidden_layers", 1)
        _require(layers % (parallel.pp * parallel.vpp) == 0,
                 f"`parallel.pp={parallel.pp}` x `parallel.vpp={parallel.vpp}` must divide the model's {layers} layers.")
        per_chunk = layers // (parallel.pp * parallel.vpp)
        model = self.model
        _require(model.recompute != "full" or model.recompute_num_layers <= per_chunk,
                 f"`model.recompute_num_layers={model.recompute_num_layers}` exceeds the {per_chunk} layers each model chunk "
                 f"holds ({layers} layers over `parallel.pp={parallel.pp}` x `parallel.vpp={parallel.vpp}`); with "
                 f"`model.recompute_method={model.recompute_method}` that recomputes no more than {per_chunk}. "
                 f"Set `--model.recompute_num_layers` between 1 and {per_chunk}.")
        self._validate_experts(hf)
        router_keys = self._moe_router_keys_set()
        _require(hf_expert_count(hf) or not router_keys,
                 f"{', '.join(f'`{key}`' for key in router_keys)} {'sets' if len(router_keys) == 1 else 'set'} the router "
                 f"of a Mixture-of-Experts model, and `model.path={self.model.path}` is a dense model (its config.json "
                 f"names no experts: none of {', '.join(HF_EXPERT_KEYS)}), which has no router, so "
                 f"{'it' if len(router_keys) == 1 else 'they'} would do nothing. Remove "
                 f"{'it' if len(router_keys) == 1 else 'them'}, or point `--model.path` at an MoE checkpoint (`tiny-moe` "
                 "is the embedded one).")

    def _validate_experts(self, hf: dict) -> None:
        """`parallel.ep`/`parallel.etp` against the checkpoint's experts per layer and expert width."""
        parallel, experts = self.parallel, hf_expert_count(hf)
        if not experts:
            _require(parallel.ep == 1 and parallel.etp in (0, parallel.tp),
                     f"`parallel.ep={parallel.ep}` and `parallel.etp={parallel.etp}` split the experts of a "
                     f"Mixture-of-Experts model, and `model.path={self.model.path}` is a dense model (its config.json "
                     f"names no experts: none of {', '.join(HF_EXPERT_KEYS)}), so there is nothing to split. Use "
                     "`--parallel.ep=1 --parallel.etp=0` (data parallelism takes those ranks), or point `--model.path` "
                     "at an MoE checkpoint (`tiny-moe` is the embedded one).")
            return
        _require(experts % parallel.ep == 0,
                 f"`parallel.ep={parallel.ep}` must divide the model's {experts} experts per layer (each expert-parallel "
                 f"rank holds experts / ep of them). Change `--parallel.ep` to a divisor of {experts}.")
        # Read in megatron-core 0.19.2's MoELayer.forward, which raises on a training forward in that case.
        _require(parallel.tp == 1 or parallel.sequence_parallel,
                 f"`parallel.sequence_parallel=false` with `parallel.tp={parallel.tp}` on a Mixture-of-Experts model: "
                 "megatron-core 0.19.2 refuses to train an MoE layer with tensor parallelism but without sequence "
                 "parallelism (MoELayer.forward raises: each tensor-parallel rank would route the whole sequence). Use the default "
                 "`--parallel.sequence_parallel=true`, or `--parallel.tp=1`.")
        width = hf.get("moe_intermediate_size") or hf.get("intermediate_size")
        etp = parallel.expert_tensor_parallel_size
        _require(not width or width % etp == 0,
                 f"`parallel.etp={parallel.etp}` ({etp} ranks per expert) must divide each expert's hidden width, {width} "
                 "(config.json's moe_intermediate_size, or intermediate_size). Change `--parallel.etp` (1 keeps every "
                 "expert whole).")

    def _validate_model(self) -> None:
        model = self.model
        _require(model.dtype in DTYPE_NAMES, f"`model.dtype={model.dtype}` is not one of {', '.join(DTYPE_NAMES)}. Change `--model.dtype`.")
        _require(model.moe_dispatcher in MOE_DISPATCHERS, f"`model.moe_dispatcher={model.moe_dispatcher}` is not one of "
                 f"{', '.join(MOE_DISPATCHERS)}. Change `--model.moe_dispatcher`.")
        # megatron-core 0.19.2's MoEAllGatherTokenDispatcher all-gathers the expert group's tokens into one tensor.
        _require(model.moe_dispatcher != "allgather" or self.parallel.ep == 1,
                 f"`model.moe_dispatcher=allgather` with `parallel.ep={self.parallel.ep}`: megatron-core's allgather "
                 "dispatcher gathers the tokens of every expert-parallel rank into one tensor and assumes each rank holds "
                 "as many, but every rank here pads and compacts its own batches (a rollout drops its finished rows, a "
                 "micro-batch is padded to its own longest row), so the gather would not match: a crash on gloo, "
                 "undefined on NCCL. Use the default `--model.moe_dispatcher=alltoall` (it sends each token only where "
                 "its experts are, whatever the ranks' counts), or `--parallel.ep=1`.")
        _require(model.attention in ATTENTION_NAMES, f"`model.attention={model.attention}` is not one of "
                 f"{', '.join(ATTENTION_NAMES)}. Change `--model.attention`.")
        _require(model.attention != "transformer_engine" or have_transformer_engine(),
                 "`model.attention=transformer_engine` needs Transformer Engine, which is not installed. "
                 "Use `--model.attention=auto` (SDPA without it), or install it (README, GPUs).")
        self._validate_recompute()
        self._validate_moe_router()
        if self._model_path_exists_now():
            self.validate_model_shape(Path(model.path))

    def _validate_moe_router(self) -> None:
        """The `model.moe_*` router settings, before any model is built (whether the model has experts: validate_model_shape)."""
        model = self.model
        for key, allowed in (("moe_aux_loss_type", MOE_AUX_LOSS_TYPES), ("moe_router_dtype", MOE_ROUTER_DTYPES)):
            _require(getattr(model, key) in allowed, f"`model.{key}={getattr(model, key)}` is not one of "
                     f"{', '.join(allowed)}. Change `--model.{key}`.")
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(model, key)
            _require(value is None or value >= 0, f"`model.{key}` must be 0 (off) or more, got {value}: it weighs a loss "
                     f"added to the training loss. Change `--model.{key}`, or leave it unset for the checkpoint's value.")
        coeff, loss_type = model.moe_aux_loss_coeff, model.moe_aux_loss_type
        _require(not (loss_type == "none" and coeff), f"`model.moe_aux_loss_coeff={coeff}` weighs a load-balancing loss, "
                 "but `model.moe_aux_loss_type=none` computes none, so the coefficient would do nothing. Set "
                 "`--model.moe_aux_loss_coeff=0` (or leave it unset), or choose a loss with `--model.moe_aux_loss_type` "
                 "(aux_loss, seq_aux_loss, global_aux_loss).")
        _require(not (loss_type not in ("default", "none") and coeff == 0),
                 f"`model.moe_aux_loss_type={loss_type}` chooses a load-balancing loss, but `model.moe_aux_loss_coeff=0` "
                 "switches it off (GRPO's default), so the type would do nothing. Set `--model.moe_aux_loss_coeff` "
                 "above 0 (1e-3 is Qwen3-MoE's), or remove `--model.moe_aux_loss_type`.")

    def _moe_router_keys_set(self) -> list[str]:
        """The `model.moe_*` router settings this run changes from its loop's defaults, as `key=value`."""
        defaults = type(self)().model
        values = {key: getattr(self.model, key) for key in MOE_ROUTER_KEYS if getattr(self.model, key) != getattr(defaults, key)}
        return [f"model.{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in values.items()]

    def _validate_recompute(self) -> None:
        model = self.model
        _require(model.recompute in RECOMPUTE_NAMES, f"`model.recompute={model.recompute}` is not one of "
                 f"{', '.join(RECOMPUTE_NAMES)}. Change `--model.recompute`.")
        if model.recompute == "full":
            _require(model.recompute_method in RECOMPUTE_METHODS, f"`model.recompute_method={model.recompute_method}` is "
                     f"not one of {', '.join(RECOMPUTE_METHODS)}. Change `--model.recompute_method`.")
            _require(model.recompute_num_layers >= 1, f"`model.recompute_num_layers` must be at least 1 with "
                     f"`model.recompute=full`, got {model.recompute_num_layers}. Change `--model.recompute_num_layers`.")
        if model.recompute != "selective":
            return
        modules = model.recompute_modules
        unknown = [name for name in modules if name not in RECOMPUTE_MODULES]
        _require(modules and not unknown,
                 f"`model.recompute_modules={modules}` must name one or more of {', '.join(RECOMPUTE_MODULES)} with "
                 "`model.recompute=selective`. Change `--model.recompute_modules` (e.g. `[core_attn]`), or use "
                 "`--model.recompute=full`.")
        if "layernorm" in modules:
            self._validate_layernorm_recompute()

    def _validate_layernorm_recompute(self) -> None:
        """`layernorm` recomputation needs Transformer Engine, and a layer spec that keeps the norms separate."""
        attention = self.model.attention
        # megatron-core 0.19.2's output-discarding checkpoint (CheckpointWithoutOutput, which recomputes the norms)
        # sets `fp8 = fp8 is not None`, always true, and then reads TE's FP8 state: without TE it fails (measured).
        _require(have_transformer_engine(),
                 "`model.recompute_modules` names `layernorm`, which megatron-core 0.19.2 recomputes with a checkpoint "
                 "that reads Transformer Engine's FP8 state even without FP8, and Transformer Engine is not installed. "
                 "Remove `layernorm` from `--model.recompute_modules` (e.g. `[core_attn,mlp]`).")
        # Transformer Engine's layer spec fuses each norm into the linear layer after it (no separate norm module).
        _require(attention not in ("transformer_engine", "auto"),
                 f"`model.recompute_modules` names `layernorm`, but the Transformer Engine layer spec (`model.attention="
                 f"{attention}`) fuses each norm into the linear layer after it, so megatron-core has no separate norm to "
                 "recompute. Remove `layernorm` from `--model.recompute_modules`, or use `--model.attention=sdpa`.")

    def _model_path_exists_now(self) -> bool:
        """Whether `model.path` must already be an HF directory at start-up (the embedded models are built on first use)."""
        return self.model.path not in EMBEDDED_MODELS

    def _validate_parallel(self, world_size: int) -> None:
        parallel = self.parallel
        for key in ("tp", "pp", "vpp", "timeout_minutes"):
            _require(getattr(parallel, key) >= 1, f"`parallel.{key}` must be at least 1, got {getattr(parallel, key)}.")
        _require(world_size % (parallel.tp * parallel.pp) == 0,
                 f"`parallel.tp={parallel.tp}` x `parallel.pp={parallel.pp}` must divide the number of processes "
                 f"({world_size}). Change `--parallel.tp`/`--parallel.pp` or `--nproc-per-node`.")
        _require(parallel.vpp == 1 or parallel.pp > 1, "`parallel.vpp` > 1 needs pipeline parallelism (`parallel.pp` > 1).")
        self._validate_expert_layout(world_size)
        _require(self.data.max_seq_len % parallel.sequence_multiple == 0,
                 f"`data.max_seq_len={self.data.max_seq_len}` must be a multiple of `parallel.tp={parallel.tp}`: sequence "
                 "parallelism splits every sequence over the tensor-parallel ranks. Change `--data.max_seq_len`, or set "
                 "`--parallel.sequence_parallel=false`.")
        # Measured with megatron-fsdp 0.6.1: the model build fails in its device-mesh set-up (an einops error).
        _require(not (parallel.use_megatron_fsdp and parallel.pp > 1),
                 "`parallel.use_megatron_fsdp=true` does not work with pipeline parallelism in this stack "
                 f"(`parallel.pp={parallel.pp}`). Use `--parallel.use_megatron_fsdp=false` (DDP with the distributed "
                 "optimizer, which also shards optimizer state) or `--parallel.pp=1`.")

    def _validate_expert_layout(self, world_size: int) -> None:
        """`parallel.ep` and `parallel.etp` against the number of processes (the model's experts: validate_model_shape)."""
        parallel = self.parallel
        _require(parallel.ep >= 1, f"`parallel.ep` must be at least 1 (1: no expert parallelism), got {parallel.ep}.")
        _require(parallel.etp >= 0, f"`parallel.etp` must be 0 (megatron-core's default: `parallel.tp`) or at least 1, "
                 f"got {parallel.etp}.")
        etp = parallel.expert_tensor_parallel_size
        etp_named = f"`parallel.etp={parallel.etp}`" + (f" (parallel.tp={parallel.tp})" if parallel.etp == 0 else "")
        _require(world_size % (etp * parallel.ep * parallel.pp) == 0,
                 f"{etp_named} x `parallel.ep={parallel.ep}` x `parallel.pp={parallel.pp}` = {etp * parallel.ep * parallel.pp} "
                 f"must divide the number of processes ({world_size}): megatron-core lays the experts out on a grid of "
                 "their own, each expert's weights split over etp ranks, the experts over ep ranks and the layers over pp "
                 "stages, with whole copies of that on the remaining ranks (the expert-data-parallel group). Change "
                 "`--parallel.ep`, `--parallel.etp` (1 keeps every expert whole on its rank) or `--nproc-per-node`.")
        _require(not (self.peft.method == "lora" and parallel.ep > 1),
                 f"`peft.method=lora` with expert parallelism (`parallel.ep={parallel.ep}`) is not supported: measured with "
                 "Megatron-Bridge 0.6.2 on tiny-moe, LoRA at EP=2 trains another model than at EP=1 from the first step "
                 "(gradient norm 3.433 against 3.384; full fine-tuning agrees to 1e-7), and its PEFT export writes the "
                 "expert adapters of the first expert-parallel rank only (40 of 72 tensors). Use `--parallel.ep=1` with "
                 "LoRA (LoRA on a Mixture-of-Experts model trains at EP=1), or full fine-tuning with expert parallelism.")

    def _validate_optimizer(self) -> None:
        optim = self.optim
        _require(isinstance(optim.betas, list) and len(optim.betas) == 2 and all(0 <= beta < 1 for beta in optim.betas),
                 f"`optim.betas` must be two numbers in [0, 1), [beta1, beta2], got {optim.betas}. Change `--optim.betas` "
                 "(e.g. `--optim.betas=[0.9,0.95]`).")
        for key, holds, rule in (("lr", optim.lr >= 0, "0 or more"), ("min_lr", optim.min_lr is None or optim.min_lr >= 0, "0 or more"),
                                 ("min_lr_ratio", 0 <= optim.min_lr_ratio <= 1, "between 0 and 1"),
                                 ("eps", optim.eps > 0, "positive"), ("weight_decay", optim.weight_decay >= 0, "0 or more"),
                                 ("clip_grad", optim.clip_grad >= 0, "0 (off) or more"),
                                 ("warmup_steps", optim.warmup_steps >= 0, "0 or more")):
            _require(holds, f"`optim.{key}` must be {rule}, got {getattr(optim, key)}. Change `--optim.{key}`.")
        _require(optim.final_lr <= optim.lr,
                 f"`optim.min_lr={optim.min_lr}` is above `optim.lr={optim.lr}`: the learning rate decays from optim.lr down "
                 "to optim.min_lr. Lower `--optim.min_lr`, or leave it unset (it then follows optim.lr: optim.lr x "
                 f"`optim.min_lr_ratio={optim.min_lr_ratio}`).")
        for key in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            _require(getattr(optim, key) in DTYPE_NAMES,
                     f"`optim.{key}={getattr(optim, key)}` is not one of {', '.join(DTYPE_NAMES)}. Change `--optim.{key}`.")
        # megatron-core is imported only when there are override keys to check: importing it takes several seconds,
        # which would otherwise delay every later start-up error (in the data, say) by as much.
        if optim.override_optimizer_config:
            from megatron.core.optimizer import OptimizerConfig

            _check_override_keys(optim.override_optimizer_config, OptimizerConfig, "optim.override_optimizer_config")
        if self.ddp.override_ddp_config:
            from megatron.core.distributed import DistributedDataParallelConfig

            _check_override_keys(self.ddp.override_ddp_config, DistributedDataParallelConfig, "ddp.override_ddp_config")
        if optim.use_precision_aware_optimizer and self.model.dtype == "fp32":
            log.warning("`optim.use_precision_aware_optimizer=true` has no effect with `model.dtype=fp32`: fp32 training "
                        "keeps fp32 weights, gradients and Adam state already (set `--model.dtype=bf16` to use it).")
        if not self.precision_aware:
            return
        why = "`model.dtype=fp16`" if self.model.dtype == "fp16" else "`optim.use_precision_aware_optimizer=true`"
        optimizer = optim.override_optimizer_config.get("optimizer", "adam")
        _require(optimizer == "adam", f"{why} needs the adam optimizer, but `optim.override_optimizer_config.optimizer={optimizer}`.")
        _require(self.parallel.use_distributed_optimizer or self.parallel.use_megatron_fsdp,
                 f"{why} needs the distributed optimizer: set `--parallel.use_distributed_optimizer=true`.")
        _require(have_transformer_engine(),
                 f"{why} uses Transformer Engine's FusedAdam, and Transformer Engine is not installed. Install it "
                 "(`uv sync --extra te` on a CUDA machine, or use NVIDIA's NGC PyTorch container), or use "
                 "`--model.dtype=bf16 --optim.use_precision_aware_optimizer=false`.")

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
                  ("train.micro_batch_tokens", train.micro_batch_tokens == 0 or train.micro_batch_tokens >= self.data.max_seq_len,
                   f"0 (off) or at least `data.max_seq_len={self.data.max_seq_len}` (a micro-batch holds one row at least)"))
        for key, holds, rule in checks:
            _require(holds, f"`{key}` must be {rule}, got {_value(self, key)}. Change `--{key}`.")

    def _validate_peft(self) -> None:
        peft, parallel = self.peft, self.parallel
        _require(peft.method in PEFT_METHODS, f"`peft.method={peft.method}` is not one of {', '.join(PEFT_METHODS)}. "
                 "Change `--peft.method`.")
        if peft.method != "lora":
            return
        unknown = [name for name in peft.target_modules if name not in LORA_TARGET_MODULES]
        _require(peft.target_modules and not unknown,
                 f"`peft.target_modules={peft.target_modules}` must name one or more of {', '.join(LORA_TARGET_MODULES)} "
                 f"(megatron-core's names of the attention and MLP linear layers){f'; unknown: {unknown}' if unknown else ''}. "
                 "Change `--peft.target_modules` (e.g. `[linear_qkv,linear_proj]`).")
        for key, holds, rule in (("rank", peft.rank >= 1, "at least 1"), ("alpha", peft.alpha > 0, "positive"),
                                 ("dropout", 0 <= peft.dropout < 1, "in [0, 1)")):
            _require(holds, f"`peft.{key}` must be {rule} with `peft.method=lora`, got {getattr(peft, key)}. "
                     f"Change `--peft.{key}`.")
        # Not verified with adapters in this stack: refused rather than run untested.
        _require(not parallel.use_megatron_fsdp,
                 "`peft.method=lora` with `parallel.use_megatron_fsdp=true` is not supported: LoRA freezes the base "
                 "weights, and Megatron-FSDP's sharded checkpoints and parameter gathers have not been verified with "
                 "adapters here. Use `--parallel.use_megatron_fsdp=false` (the distributed optimizer shards the "
                 "adapters' optimizer state, and the frozen base needs none).")

    def _validate_log(self) -> None:
        _require(not self.log.wandb or have_wandb(),
                 "`log.wandb=true` needs Weights & Biases, which is not installed in this environment. Install the "
                 "project's `wandb` extra (`.venv/bin/uv sync --extra wandb`; `scripts/setup.sh` installs it with the "
                 "test dependencies), or use `--log.wandb=false` (`--log.tensorboard=true` needs nothing extra).")

    def _validate_batch(self, world_size: int) -> None:
        train = self.train
        data_parallel = self.parallel.data_parallel_size(world_size)
        self._validate_token_budget()
        if train.micro_batch_tokens:
            _require(train.global_batch_size % data_parallel == 0,
                     f"`train.global_batch_size={train.global_batch_size}` must be a multiple of the data-parallel size "
                     f"{data_parallel}.")
            return
        _require(train.global_batch_size % (train.micro_batch_size * data_parallel) == 0,
                 f"`train.global_batch_size={train.global_batch_size}` must be a multiple of `train.micro_batch_size="
                 f"{train.micro_batch_size}` x data-parallel size {data_parallel}.")

    def _validate_token_budget(self) -> None:
        if not self.train.micro_batch_tokens:
            return
        _require(self.parallel.pp == 1,
                 f"`train.micro_batch_tokens={self.train.micro_batch_tokens}` groups rows by length into micro-batches "
                 f"of varying row counts, and pipeline stages (`parallel.pp={self.parallel.pp}`) exchange activations "
                 "of one shape. Use `--train.micro_batch_tokens=0` (micro-batches of `train.micro_batch_size` rows) "
                 "with `parallel.pp` > 1.")
        _require(not self.data.pack,
                 "`train.micro_batch_tokens` and `data.pack=true` both decide how a step's samples share micro-batches: "
                 "packing fills rows of `data.max_seq_len`, the budget groups rows of similar length. Choose one: "
                 "`--train.micro_batch_tokens=0` or `--data.pack=false`.")


@dataclass
class SFTConfig(TrainerConfig):
    """`trainer.sft`: the shared sections at their defaults."""

    def validate(self, world_size: int) -> None:
        """The shared checks, and packing's limit."""
        super().validate(world_size)
        _require(not (self.data.pack and self.parallel.pp > 1),
                 "`data.pack=true` gives microbatches a varying number of rows, which pipeline parallelism cannot "
                 "exchange between stages. Use `--data.pack=false` with `parallel.pp` > 1.")


# GRPO's default starting policy: the default SFT's output, trained first when missing.
DEFAULT_GRPO_START = "outputs/sft/hf"
# Starting policies a bundled SFT writes, each trained first when missing: model.path -> that SFT's `--config`
# (None: the default SFT). The tool task's (`--config tools`) teaches the calculator's call format.
BUNDLED_STARTS = {DEFAULT_GRPO_START: None, "outputs/sft-tools/hf": "sft_tools", "outputs/sft-moe/hf": "sft_moe"}


@dataclass
class GRPOConfig(TrainerConfig):
    """`trainer.grpo`: the shared sections with GRPO's defaults, and the `grpo` section."""

    # No load-balancing loss in RL (verl's and NeMo-RL's MoE defaults; slime's scripts set 0): it pulls the router
    # towards balance rather than reward, and NeMo-RL saw seq_aux_loss make the log-prob errors diverge.
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=DEFAULT_GRPO_START, moe_aux_loss_coeff=0.0))
    # A constant rate after warmup (the decay ends at optim.lr), the default SFT's final rate.
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, min_lr_ratio=1.0, warmup_steps=5))
    # 64 prompts a step: with 32 the `#### N` form is learned about as fast, but the noisier steps damage the
    # held-out arithmetic (docs/grpo.md).
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        steps=40, global_batch_size=512, micro_batch_size=64, out_dir="outputs/grpo", eval_interval=0,
        eval_samples=1000, log_interval=5))
    grpo: GRPOSection = field(default_factory=GRPOSection)

    def starts_from_default_sft(self) -> bool:
        """Whether this run starts from a bundled SFT's output (`BUNDLED_STARTS`) and that output does not exist yet."""
        return self.model.path in BUNDLED_STARTS and not (Path(self.model.path) / "config.json").is_file()

    def _model_path_exists_now(self) -> bool:
        return super()._model_path_exists_now() and not self.starts_from_default_sft()

    def validate_model_shape(self, model_path: Path) -> None:
        """The shared checks, and routing replay against the pipeline schedule's recomputed backward."""
        super().validate_model_shape(model_path)
        model = self.model
        recomputes_router = model.recompute == "full" or (model.recompute == "selective" and "moe" in model.recompute_modules)
        _require(not (self.parallel.pp > 1 and self.grpo.routing_replay and recomputes_router
                      and hf_expert_count(read_hf_config(model_path, "model.path"))),
                 f"`grpo.routing_replay=true` with `parallel.pp={self.parallel.pp}` and `model.recompute={model.recompute}` "
                 "(which recomputes the routers in backward): the pipeline schedule runs later microbatches' forwards "
                 "before a microbatch's backward, so its recomputed routers would replay a later microbatch's routes. "
                 "Set `--model.recompute=none` (or selective without `moe`), `--parallel.pp=1`, or "
                 "`--grpo.routing_replay=false`.")

    def validate(self, world_size: int) -> None:
        """The shared checks and GRPO's own (the default start's SFT is checked by `trainer.default_start`)."""
        parallel, grpo, data = self.parallel, self.grpo, self.data
        _require(parallel.vpp == 1,
                 f"GRPO samples its rollouts with the policy itself, one forward at a time through the pipeline stages, "
                 f"and that runs one model chunk per rank: `parallel.vpp={parallel.vpp}` (interleaved virtual stages) would "
                 f"send every decode step around the ranks `parallel.vpp` times for no gain, since generation does not "
                 f"fill the pipeline. Set `--parallel.vpp=1` (`parallel.pp` > 1 is fine).")
        _require(not data.pack, "`data.pack` is for SFT; GRPO batches its rollouts itself. Remove `--data.pack=true`.")
        _require(grpo.n_samples >= 2,
                 f"`grpo.n_samples` must be at least 2 (advantages compare completions of one prompt), got {grpo.n_samples}.")
        _require(grpo.rollout_correction_cap >= 1.0, f"`grpo.rollout_correction_cap` must be at least 1 (a weight cap below "
                 f"1 would shrink every token's gradient), got {grpo.rollout_correction_cap}. Change `--grpo.rollout_correction_cap`.")
        for key, allowed in (("baseline", BASELINES), ("kl_estimator", KL_ESTIMATORS), ("filter_metric", FILTER_METRICS),
                             ("rollout_correction", ROLLOUT_CORRECTIONS),
                             ("tool_isolation", TOOL_ISOLATIONS), ("importance_ratio", IMPORTANCE_RATIOS), ("loss_aggregation", LOSS_AGGREGATIONS)):
            _require(getattr(grpo, key) in allowed,
                     f"`grpo.{key}={getattr(grpo, key)}` is not one of {', '.join(allowed)}. Change `--grpo.{key}`.")
        rules = {  # key: (holds, what it must be)
            "clip_low": (0 < grpo.clip_low < 1, "between 0 and 1"), "clip_high": (grpo.clip_high > 0, "positive"),
            "dual_clip": (grpo.dual_clip == 0 or grpo.dual_clip > 1, "0 (off) or above 1"),
            "kl_coef": (grpo.kl_coef >= 0, "0 or more"), "temperature": (grpo.temperature > 0, "positive (rollouts are sampled)"),
            "top_p": (0 < grpo.top_p <= 1, "in (0, 1]"), "top_k": (grpo.top_k >= 0, "0 or more"),
            "ppo_epochs": (grpo.ppo_epochs >= 1, "at least 1"), "mini_batches": (grpo.mini_batches >= 1, "at least 1"),
            "max_new_tokens": (1 <= grpo.max_new_tokens < data.max_seq_len,
                               f"at least 1 and below `data.max_seq_len={data.max_seq_len}`"),
            "overlong_buffer": (0 <= grpo.overlong_buffer <= grpo.max_new_tokens,
                                f"between 0 (off) and `grpo.max_new_tokens={grpo.max_new_tokens}`"),
            "overlong_penalty": (grpo.overlong_penalty >= 0, "0 or more"),
            "max_sampling_rounds": (grpo.max_sampling_rounds >= 2 or not grpo.dynamic_sampling,
                                    "at least 2 with `grpo.dynamic_sampling=true` (one round samples no replacement for a "
                                    "dropped group, so dynamic sampling would do nothing)"),
            "entropy_coef": (grpo.entropy_coef >= 0, "0 or more (it weighs an entropy bonus)"),
            "max_turns": (grpo.max_turns >= 1 and (grpo.max_turns >= 2 or not (grpo.tools or grpo.environment)),
                          "at least 2 with tools (a call is answered in the next turn)"),
            "max_tool_response_tokens": (grpo.max_tool_response_tokens >= 1, "at least 1"),
            "tool_timeout": (grpo.tool_timeout > 0, "positive"),
            "tool_workers": (grpo.tool_workers >= 0, "0 (this rank's share of the cores) or more"),
        }
        for name, (holds, rule) in rules.items():
            _require(holds, f"`grpo.{name}` must be {rule}, got {getattr(grpo, name)}. Change `--grpo.{name}`.")
        # GSPO's objective is the mean over completions of one clipped sequence ratio each; any other aggregation
        # weighs a completion's single ratio by its length (token_mean) or by the budget, which is not GSPO.
        _require(grpo.importance_ratio != "sequence" or grpo.loss_aggregation == "seq_mean_token_mean",
                 f"`grpo.importance_ratio=sequence` (GSPO's one ratio per completion) needs `grpo.loss_aggregation="
                 f"seq_mean_token_mean`, the mean over completions GSPO optimises; `{grpo.loss_aggregation}` would weigh "
                 "each completion's ratio by its length instead. Use `--config gspo`, set `--grpo.loss_aggregation="
                 "seq_mean_token_mean`, or use `--grpo.importance_ratio=token`.")
        _require(grpo.reward != "none" or grpo.environment,
                 "`grpo.reward=none` scores every completion 0, for an environment whose `reward()` is the whole reward, "
                 "but no `grpo.environment` is set: every reward would be 0 and nothing would be learned. Set "
                 "`--grpo.environment module:Class`, or choose a reward function with `--grpo.reward`.")
        super().validate(world_size)

    def _validate_batch(self, world_size: int) -> None:
        train, grpo = self.train, self.grpo
        data_parallel = self.parallel.data_parallel_size(world_size)
        _require(train.global_batch_size % grpo.n_samples == 0 and (train.global_batch_size // grpo.n_samples) % data_parallel == 0,
                 f"`train.global_batch_size={train.global_batch_size}` counts completions: it must be a multiple of "
                 f"`grpo.n_samples={grpo.n_samples}` whose number of prompts divides over the data-parallel size "
                 f"{data_parallel}. Change `--train.global_batch_size`.")
        self._validate_token_budget()
        micro = 1 if train.micro_batch_tokens else train.micro_batch_size  # a token budget groups rows of any count
        _require(train.global_batch_size % (grpo.mini_batches * micro * data_parallel) == 0,
                 f"`train.global_batch_size={train.global_batch_size}` must be a multiple of `grpo.mini_batches="
                 f"{grpo.mini_batches}`"
                 + ("" if train.micro_batch_tokens else f" x `train.micro_batch_size={train.micro_batch_size}`")
                 + f" x data-parallel size {data_parallel}. Change one of them.")


# ---------------------------------------------------------------- helpers


def read_hf_config(path: Path, key: str, name: str = "config.json") -> dict:
    """config.json (or another JSON file `name`, such as generation_config.json, when present: else {}) of an HF
    checkpoint directory, or a UserError naming the file and `key`."""
    config_file = Path(path) / name
    if not config_file.is_file():
        if name != "config.json":
            return {}
        raise UserError(f"`{key}={path}` is not a Hugging Face checkpoint directory (no config.json there). "
                        f"Point `--{key}` at a directory saved with `save_pretrained`, or use `tiny`.")
    try:
        return json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"`{config_file}` is not valid JSON ({error}). Fix the file or point `--{key}` elsewhere.") from None


def hf_expert_count(hf: dict) -> int:
    """Routed experts per MoE layer of an HF config.json (0: a dense model)."""
    return next((int(hf[key]) for key in HF_EXPERT_KEYS if hf.get(key)), 0)


def _check_override_keys(overrides: dict, config_class, key: str) -> None:
    """Reject override keys the megatron-core class does not have, naming our config key."""
    known = {item.name for item in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - known)
    _require(not unknown, f"`{key}` sets {', '.join(f'`{name}`' for name in unknown)}, which megatron-core's "
             f"{config_class.__name__} does not have. Remove or rename them in `{key}`.")


def _value(config, dotted: str):
    """The value of a dotted key."""
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)
