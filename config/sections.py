"""The configuration's sections, nested dataclasses with defaults in code (`--section.key=value` on the command line),
the names each choice may take, and the derived values of one section (the data-parallel size, the sequence multiple;
whether Transformer Engine is installed). `config.loops` assembles them into the two loops' configurations and
`config.checks` holds the rules across keys.
"""

import functools
import importlib.util
from dataclasses import dataclass, field


DTYPE_NAMES = ("fp32", "bf16", "fp16")
# GRPO's named choices; trainer/grpo_math.py maps each name to its function.
BASELINES = ("mean", "leave_one_out")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_RATIOS = ("token", "sequence")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
FILTER_METRICS = ("accuracy", "reward")  # what dynamic sampling's groups must vary in (trainer/grpo.py)
ROLLOUT_CORRECTIONS = ("auto", "none", "tis", "token_reject", "sequence_reject")  # grpo.rollout_correction (trainer/grpo_update.py)
TOOL_ISOLATIONS = ("process", "thread")  # where a plain-function tool call runs (tool_runtime/runner.py)
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
# `data.path` names of the bundled data sets (data/arithmetic.py, data/calculator.py): read as such even where a folder
# of that name exists.
BUNDLED_DATA = ("arithmetic", "calculator")
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
    path: str = field(default="tiny", metadata={"help": "HF checkpoint directory, or an embedded model built offline on first use: `tiny` (a 0.8M-parameter Qwen2: SFT's default; GRPO and trainer.rm start from the default SFT's output, built first when missing) | `tiny-moe` (a Qwen3-MoE, 8 experts, top-2)"})
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
    warmup_steps: int = field(default=10, metadata={"help": "linear warmup steps before the cosine decay, from 0 (the first step runs at rate 0; 0 here: at optim.lr from the first step), at most train.steps - 1"})
    weight_decay: float = field(default=0.01, metadata={"help": "decoupled weight decay (AdamW)"})
    clip_grad: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this value (0 disables)"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata={"help": "Adam betas [beta1, beta2]"})
    eps: float = field(default=1e-8, metadata={"help": "Adam epsilon"})
    use_precision_aware_optimizer: bool = field(default=False, metadata={"help": "bf16: keep optimizer state in the dtypes below (needs Transformer Engine)"})
    main_grads_dtype: str = field(default="fp32", metadata={"help": "precision-aware: main gradient dtype fp32 | bf16"})
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
    path: str = field(default="arithmetic", metadata={"help": "json/jsonl/parquet file or dir, a hub dataset name, `arithmetic` (bundled word problems) or `calculator` (the bundled tool task)"})
    hub_config: str = field(default="", metadata={"help": "hub dataset configuration name (e.g. `main` for openai/gsm8k)"})
    eval_path: str = field(default="", metadata={"help": "held-out data (same forms as data.path); default: data.eval_split of data.path"})
    train_split: str = field(default="train", metadata={"help": "the split trained on: a hub dataset's split name (train_sft for HuggingFaceH4/ultrachat_200k, train_prefs for HuggingFaceH4/ultrafeedback_binarized), or the name a local folder's files start with (without such files: every file not named test*/eval*/valid*)"})
    eval_split: str = field(default="test", metadata={"help": "the held-out split of data.eval_path, else of data.path: a hub split name, or the name a local folder's files start with; a single file, or a set without it, has none (evaluation skipped with a warning)"})
    prompt_field: str = field(default="question", metadata={"help": "row field holding the prompt"})
    response_field: str = field(default="answer", metadata={"help": "row field holding the response (GRPO: the reference answer the reward compares with)"})
    messages_field: str = field(default="", metadata={"help": "row field holding chat messages [{role, content}] (overrides prompt/response; every assistant turn is trained)"})
    max_seq_len: int = field(default=128, metadata={"help": "tokens per sample, longer ones are cut from the right (GRPO: prompt + completion; longer prompts are skipped and counted)"})
    pack: bool = field(default=False, metadata={"help": "SFT: pack several samples per row (positions restart, no cross-sample attention)"})
    chat_template_kwargs: dict = field(default_factory=dict, metadata={"help": "variables for the chat template at every rendering (training rows, prompts, multi-turn rollouts), as transformers' `apply_chat_template(**kwargs)`: `{enable_thinking: false}` is Qwen3's non-thinking mode (GRPO's prompts then end with an empty think block, so completions answer at once); default: none"})
    cache: bool = field(default=True, metadata={"help": "keep tokenized data in $TRAINER_CACHE_DIR (default ~/.cache/megatron-trainer) and reuse it while the data, tokenizer and chat template are unchanged: SFT's examples (and data.max_seq_len), GRPO's prompts"})


@dataclass
class PreferenceDataConfig(DataConfig):
    """`trainer.rm`'s data: preference pairs (the embedded set, `outputs/preferences`, is built on first use)."""

    path: str = field(default="outputs/preferences", metadata={"help": "preference pairs: a json/jsonl/parquet file or dir, or a hub dataset name (`outputs/preferences`: the embedded set, sampled from the default SFT and judged by the arithmetic rule, built on first use)"})
    prompt_field: str = field(default="prompt", metadata={"help": "row field holding the prompt (text or chat messages); without a `prompt` column (this default) each side is a whole conversation, and a name set here must be a column"})
    chosen_field: str = field(default="chosen", metadata={"help": "row field holding the preferred response (text or chat messages)"})
    rejected_field: str = field(default="rejected", metadata={"help": "row field holding the other response (text or chat messages)"})
    response_field: str = field(default="answer", metadata={"help": "not read by trainer.rm (refused when set): a pair's sides are data.chosen_field and data.rejected_field"})
    messages_field: str = field(default="", metadata={"help": "not read by trainer.rm (refused when set): a side that is a whole conversation is data.chosen_field / data.rejected_field without a data.prompt_field column"})
    pack: bool = field(default=False, metadata={"help": "refused by trainer.rm: each side is scored at its own row's last token"})
    cache: bool = field(default=True, metadata={"help": "not used by trainer.rm: preference pairs are tokenized at each start"})
    max_seq_len: int = field(default=128, metadata={"help": "tokens per side of a pair; a pair with a longer side is dropped and counted in the start-up line"})


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
    exit_interval: int = field(default=0, metadata={"help": "save a checkpoint and exit 0 after every N-th step before the last, as Megatron's exit_interval (a resumed run stops at the next multiple: jobs of N steps each; 0: off)"})
    eval_interval: int = field(default=300, metadata={"help": "evaluate on held-out data every N steps and at the end (0: only at the end)"})
    eval_samples: int = field(default=100, metadata={"help": "held-out samples per evaluation (0: no evaluation)"})
    log_interval: int = field(default=20, metadata={"help": "console line every N steps, and GRPO's sampled completions to samples.jsonl (metrics.jsonl, TensorBoard and W&B get every step)"})

    def evaluates_at(self, step: int) -> bool:
        """Held-out evaluation after `step`: every `eval_interval` steps, and after the last."""
        return step == self.steps or bool(self.eval_interval and step % self.eval_interval == 0)

    def exits_at(self, step: int) -> bool:
        """Stop (saved) after `step`: every `exit_interval` steps, as Megatron-LM's and Megatron-Bridge's `step %
        exit_interval == 0`, so each resumed job runs N steps more; the last step is a finish, not a stop."""
        return bool(self.exit_interval and step % self.exit_interval == 0 and step < self.steps)

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


# The `peft` keys that set up LoRA's adapters (refused without `peft.method=lora`, which they would not change).
LORA_SETTINGS = ("rank", "alpha", "dropout", "target_modules")


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
    format_bonus: float = field(default=0.0, metadata={"help": "added to the reward of a completion that ends with a `#### N` answer (shaping: not scaled by grpo.reward_weight)"})
    overlong_buffer: int = field(default=0, metadata={"help": "DAPO's soft overlong penalty: completions longer than max_new_tokens - overlong_buffer tokens lose reward linearly, up to overlong_penalty at the budget (0: off)"})
    overlong_penalty: float = field(default=1.0, metadata={"help": "the reward lost by a completion that reaches max_new_tokens, with overlong_buffer > 0"})
    baseline: str = field(default="mean", metadata={"help": f"advantage baseline within a group: {' | '.join(BASELINES)} (the group mean, GRPO; the mean of the others, RLOO)"})
    scale_rewards: bool = field(default=True, metadata={"help": "divide advantages by the group's reward std (false: Dr. GRPO)"})
    dynamic_sampling: bool = field(default=False, metadata={"help": "DAPO's dynamic sampling: drop groups that do not vary in grpo.filter_metric and sample more prompts until the batch is full"})
    max_sampling_rounds: int = field(default=4, metadata={"help": "with dynamic_sampling, at most this many generation rounds per step (at least 2); a batch still short after them is filled with dropped groups, trained with advantage 0"})
    filter_metric: str = field(default="accuracy", metadata={"help": f"with dynamic_sampling, what a group must vary in to be kept: {' | '.join(FILTER_METRICS)} (accuracy: the reward function's full marks or its (reward, correct), or an environment's (reward, correct), as DAPO and verl's filter_groups.metric=acc; reward: the shaped reward, environment's, overlong penalty and format bonus included)"})
    tolerate_reward_errors: bool = field(default=False, metadata={"help": "go on when the reward function fails on every completion of a step (scored 0) instead of stopping with its error"})
    reward_timeout: float = field(default=30.0, metadata={"help": "seconds one call of a module:function reward may take: such a reward runs in worker processes (grpo.tool_workers of them on each rank), a call past this is stopped and scores 0 as a failure, and when 4 of a batch's calls (or one per worker), spread over it, all timed out the rest are not made; 0: called in the trainer's process with no limit (a reward that must share the trainer's memory, such as a model on its GPU). An environment's reward() runs on the trainer's main thread within the same limit (a SIGALRM timer; 0: none), and past it scores 0 as a failure; when 4 spread over a batch all ran past it, the rest are not made"})
    # On by default: without it (TRL's default) the default GRPO damaged the held-out arithmetic, and skipping the
    # reference forward did not shorten a CPU step measurably (docs/grpo.md).
    kl_coef: float = field(default=0.01, metadata={"help": "weight of the KL penalty to a frozen copy of the starting model (0: no reference model)"})
    kl_estimator: str = field(default="k3", metadata={"help": f"the KL penalty's per-token term: {' | '.join(KL_ESTIMATORS)}. k3 (exp(d) - d - 1, d = log pi_ref - log pi; TRL's and verl's usual choice, uncapped as TRL's) pulls toward the reference as the gradient of KL(pi_ref || pi); k2 ((log pi - log pi_ref)^2 / 2) as that of KL(pi || pi_ref); k1 (log pi - log pi_ref) has zero gradient on average, so it penalises nothing (a warning says so)"})
    importance_ratio: str = field(default="token", metadata={"help": f"importance ratio pi / pi_old: {' | '.join(IMPORTANCE_RATIOS)} (per token, PPO and GRPO; per completion, length-normalised, GSPO: use a small clip range such as 3e-4 / 4e-4)"})
    clip_low: float = field(default=0.2, metadata={"help": "PPO ratio clip below: 1 - clip_low"})
    clip_high: float = field(default=0.28, metadata={"help": "PPO ratio clip above: 1 + clip_high (DAPO's clip-higher when > clip_low)"})
    dual_clip: float = field(default=3.0, metadata={"help": "bound the loss of negative-advantage tokens at dual_clip x |A| (0: off, else > 1)"})
    mask_truncated: bool = field(default=False, metadata={"help": "leave completions cut at max_new_tokens out of the loss (they still count in their group's advantages)"})
    entropy_coef: float = field(default=0.0, metadata={"help": "weight of an entropy bonus: the loss subtracts entropy_coef x the aggregated token entropy"})
    loss_aggregation: str = field(default="token_mean", metadata={"help": f"token losses to one loss: {' | '.join(LOSS_AGGREGATIONS)} (the token mean over the global batch, DAPO; the mean over completions of each one's token mean, GRPO; each completion's token sum over max_new_tokens, Dr. GRPO)"})
    teacher: str = field(default="", metadata={"help": "on-policy distillation: a Hugging Face checkpoint directory with the policy's tokenizer (any size, dense), frozen at the policy's parallel layout, whose log-prob of every sampled token adds teacher_coef x (log pi_teacher - log pi_old) to that token's advantage (the per-token reverse KL, as the Thinking Machines recipe; with grpo.reward_weight=0 it is the whole signal but for a format bonus or overlong penalty); empty: off"})
    teacher_coef: float = field(default=1.0, metadata={"help": "with grpo.teacher, the weight of the teacher's per-token term in the advantage, against the group advantage of the reward"})
    reward_weight: float = field(default=1.0, metadata={"help": "the weight of the reward function's score (and an environment's reward) in each rollout's reward, beside grpo.reward_model_weight x a reward model's score (with grpo.scale_rewards only their ratio counts; a teacher's term is weighed by grpo.teacher_coef); 0: the reward model alone, or with grpo.teacher distillation alone (a format bonus and an overlong penalty still apply) (the reward function still gives `accuracy` and the held-out evaluation)"})
    reward_model: str = field(default="", metadata={"help": "a reward model scoring every rollout: a Hugging Face ...ForSequenceClassification directory with one label (trainer.rm's hf/ output, or a downloaded one of a family Megatron-Bridge loads), frozen at the policy's parallel layout; it reads each conversation as the chat template renders it; empty: off"})
    reward_model_weight: float = field(default=1.0, metadata={"help": "with grpo.reward_model, the weight of its score in each rollout's reward"})
    share_prompts: bool = field(default=True, metadata={"help": "the training forwards (the update's, pi_old's, the reference's) lay each group out as one row, its prompt once and then every completion, each completion seeing the prompt and itself: the same log-probs and gradients as a row per completion, the prompt computed once per group (off by itself, with a start-up line saying why, where the attention cannot take the layout: pipeline stages, Transformer Engine or fused-softmax attention, sliding windows, context parallelism)"})
    rollout_processes: int = field(default=0, metadata={"help": "asynchronous GRPO: how many of the torchrun world's processes (its last ranks) only sample; each holds a whole forward-only replica of the policy (tensor-, pipeline- and expert-parallel size 1), samples and scores rollouts for the trainers (the other processes, at any layout) and receives their weights after every update (trainer rank 0 broadcasts them over gloo, in Hugging Face names through Megatron-Bridge); 0: every process samples and trains in turn"})
    max_staleness: int = field(default=1, metadata={"help": "with grpo.rollout_processes > 0: the batch trained at step s is sampled by the policy after step s - 1 - max_staleness (or the start), so with 1 the rollout processes sample step s+1 while step s trains; 0: synchronous, through the same processes. A checkpoint holds the batches already sampled for the next steps"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each step's rollouts"})
    mini_batches: int = field(default=1, metadata={"help": "optimizer updates per pass (the rollouts are split into this many)"})
    max_new_tokens: int = field(default=32, metadata={"help": "longest completion in tokens (generation stops earlier at EOS)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of rollouts (log-probs use the same)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass of rollouts (1: off)"})
    top_k: int = field(default=0, metadata={"help": "sample rollouts from the k most likely tokens (0: off)"})
    routing_replay: bool = field(default=True, metadata={"help": "Mixture-of-Experts policies: the training forwards that score a rollout's tokens (pi_old's, the policy's and the KL reference's) route each token to the experts it took in the rollout (megatron-core's RouterReplay), so both sides run the same experts; the KL term then measures the change of weights along the rollout's experts, not a trained router's drift; `moe_route_mismatch` is logged either way (dense models: no effect)"})
    rollout_correction: str = field(default="auto", metadata={"help": f"correct the gap between the sampler's and the training forward's log-probs: {' | '.join(ROLLOUT_CORRECTIONS)} (auto: tis where rollouts are stale, grpo.rollout_processes with grpo.max_staleness > 0, else none; tis: each token's policy-gradient term weighted by pi_old / pi_sampler, truncated at grpo.rollout_correction_cap, as verl's rollout_is and TRL's vllm_importance_sampling_correction; with stale rollouts, grpo.max_staleness, this is AReaL's decoupled objective: clipped against pi_old, the proximal policy, weighted by the truncated behaviour-to-proximal ratio; token_reject / sequence_reject: tokens, or whole completions by their mean log-ratio, whose pi_old / pi_sampler lies outside [1 / cap, cap] leave the loss, as verl's rollout_rs)"})
    rollout_correction_cap: float = field(default=2.0, metadata={"help": "with rollout_correction=tis, the largest weight (verl's rollout_is_threshold 2.0); with token_reject / sequence_reject, the ratio bound"})
    tools: list[str] = field(default_factory=list, metadata={"help": "tools the policy may call in its rollouts, each a typed, documented function as module:function (schema from its signature and docstring; docs/tools.md)"})
    environment: str = field(default="", metadata={"help": "a stateful task as module:Class: one instance per episode, reset(row) first, its public methods the tools, an optional reward() added to grpo.reward's score"})
    max_turns: int = field(default=4, metadata={"help": "with tools, at most this many assistant turns per episode (a tool call in the last is not run)"})
    max_tool_response_tokens: int = field(default=256, metadata={"help": "with tools, a tool result longer than this many tokens is cut (its message says so)"})
    tool_timeout: float = field(default=10.0, metadata={"help": "with tools, seconds each call may take from its own start; a slower one answers with a timeout error (a plain function's episode goes on; an environment's episode ends)"})
    tool_workers: int = field(default=0, metadata={"help": "with tools (or a module:function reward), calls run at once on each rank (an episode's calls always one after another, in order); 0: this rank's share of the node's cores (raise it for tools that wait on the network)"})
    tool_isolation: str = field(default="process", metadata={"help": f"with tools, where a plain function's call runs: {' | '.join(TOOL_ISOLATIONS)} (a reused worker process, killed at the timeout, so a hung or CPU-bound tool neither leaks nor holds the trainer's GIL; or a thread of the trainer, cheaper, but one past its timeout runs on). An environment's methods always run in threads"})

    def filters_by_accuracy(self) -> bool:
        """Whether dynamic sampling keeps the groups whose accuracy varies (`filter_metric=accuracy`)."""
        return self.dynamic_sampling and self.filter_metric == "accuracy"

    def correction(self) -> str:
        """`rollout_correction` with `auto` resolved: the decoupled objective (`tis`) where the rollouts are stale
        (measured on the default task, one update behind: held-out 0.674 without a correction, 0.937 with it), else none."""
        if self.rollout_correction != "auto":
            return self.rollout_correction
        return "tis" if self.rollout_processes and self.max_staleness else "none"
