"""The two loops' configurations: `SFTConfig` and `GRPOConfig` over the shared sections (`config.sections`), GRPO's
defaults as overrides of the same sections. `config.validate(world_size)` runs every check that needs neither a model
nor data (`config.checks`) and raises a `UserError` naming the key to change; derived values (the data-parallel size,
whether the precision-aware optimizer is in use) are defined on the sections and here, once."""

import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path

from config.checks import TrainingChecks, require
from config.checkpoint_shape import carried_window
from config.hf import architecture, check_tokenizer_files, hf_expert_count, is_classifier, read_hf_config
from config.model_checks import ModelChecks, check_decoder_classifier
from config.sections import (
    BASELINES, CkptConfig, DDPConfig, DataConfig, FILTER_METRICS, GRPOSection, IMPORTANCE_RATIOS, KL_ESTIMATORS,
    LOSS_AGGREGATIONS, LogConfig, ModelConfig, OptimConfig, ParallelConfig, PeftConfig, PreferenceDataConfig, ROLLOUT_CORRECTIONS,
    TOOL_ISOLATIONS, TrainConfig, have_transformer_engine
)

log = logging.getLogger(__name__)


@dataclass
class TrainerConfig(ModelChecks, TrainingChecks):
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

    def starts_from_default_sft(self) -> bool:
        """Whether this run starts from a bundled SFT's output (`BUNDLED_STARTS`) and that output does not exist yet."""
        return self.model.path in BUNDLED_STARTS and not (Path(self.model.path) / "config.json").is_file()

    def _model_path_exists_now(self) -> bool:
        return super()._model_path_exists_now() and not self.starts_from_default_sft()

    def validate(self, world_size: int) -> None:
        """Every check that needs no model and no data; each error names the key to change."""
        self._validate_parallel(world_size)
        self._validate_model()
        self._validate_optimizer()
        self._validate_schedule()
        self._validate_batch(world_size)
        self._validate_log()
        self._validate_peft()

@dataclass
class SFTConfig(TrainerConfig):
    """`trainer.sft`: the shared sections at their defaults."""

    def validate(self, world_size: int) -> None:
        """The shared checks, and packing's limit."""
        super().validate(world_size)
        require(not (self.data.pack and self.parallel.pp > 1),
                 "`data.pack=true` gives microbatches a varying number of rows, which pipeline parallelism cannot "
                 "exchange between stages. Use `--data.pack=false` with `parallel.pp` > 1.")
        attention = self.model.attention
        causal_only = (attention == "transformer_engine" or (attention == "auto" and have_transformer_engine())
                       or (attention == "local" and importlib.util.find_spec("scaled_masked_softmax_cuda") is not None))
        require(not (self.data.pack and causal_only),
                 f"`data.pack=true` keeps packed samples apart with a block-diagonal attention mask, and the attention "
                 f"`model.attention={attention}` runs here (Transformer Engine's, or the fused causal softmax) applies a "
                 "causal mask over the whole row instead: each sample would attend to the ones packed before it. Set "
                 "`--model.attention=sdpa` with packing, or `--data.pack=false`.")
        # megatron-core's seq_aux_loss balances the experts within each row of a micro-batch: a packed row's samples
        # would be balanced as one sequence (tiny-moe, 3 samples: router gradients 4.5 apart, on a scale of 5.6).
        require(not (self.data.pack and self.model.moe_aux_loss_type == "seq_aux_loss"),
                 "`data.pack=true` with `model.moe_aux_loss_type=seq_aux_loss`: megatron-core computes the per-sequence "
                 "load-balancing loss over each row of a micro-batch, so the samples packed into one row would be "
                 "balanced as one sequence, not each on its own as unpacked. Set `--data.pack=false`, or choose "
                 "`--model.moe_aux_loss_type=aux_loss` (per micro-batch: the same with and without packing).")
        if self.data.pack and self.train.micro_batch_size == 1:
            log.warning("`data.pack=true` packs the samples of one micro-batch into rows of `data.max_seq_len`, and "
                        "`train.micro_batch_size=1` gives each micro-batch one sample: nothing is packed, and every "
                        "sample is padded to %d tokens. Raise `--train.micro_batch_size` (packing's rows are then "
                        "fewer than its samples), or set `--data.pack=false`.", self.data.max_seq_len)

    def validate_model_shape(self, model_path: Path) -> None:
        """The shared checks, and packing against a sliding window megatron-core's own attention computes."""
        super().validate_model_shape(model_path)
        window = carried_window(read_hf_config(model_path, "model.path"))
        # megatron-core's local softmax builds its own sliding-window mask and drops the one it is given: packed
        # samples would attend to the ones before them in the row (per-token losses 0.49-0.57 off transformers' on a
        # tiny Mistral, against 5e-7 with SDPA, which applies both masks).
        require(not (self.data.pack and self.model.attention == "local" and window),
                 f"`data.pack=true` with `model.attention=local` and `model.path={model_path}`, whose sliding window of "
                 f"{window} tokens megatron-core's local attention applies in place of the block-diagonal mask that "
                 "keeps packed samples apart: each sample would attend to the ones packed before it in its row. Set "
                 "`--model.attention=sdpa` (it applies both), or `--data.pack=false`.")


# The longest a tool or reward call may be given: a queue's wait (threading.TIMEOUT_MAX, 9.2e9 s) and a SIGALRM timer
# (time_t) raise OverflowError beyond it, at the first call, once the model is built.
LONGEST_TIMER_S = 1e9
TIMER_WHY = "about 31 years; Python's timers overflow beyond it"

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

    def validate_model_shape(self, model_path: Path) -> None:
        """The shared checks, routing replay against the pipeline schedule's recomputed backward, and a teacher's
        vocabulary rows against the policy's."""
        super().validate_model_shape(model_path)
        model = self.model
        # The policy samples from every row of its vocabulary (config.json's vocab_size pads the tokenizer's), and the
        # teacher reads each sampled id: one past its rows indexes past its embedding (an IndexError on one rank).
        rows = read_hf_config(model_path, "model.path").get("vocab_size") or 0
        teacher_rows = (read_hf_config(Path(self.grpo.teacher), "grpo.teacher").get("vocab_size") or 0
                        if self.grpo.teacher else rows)
        require(teacher_rows >= rows,
                 f"`grpo.teacher={self.grpo.teacher}` has {teacher_rows} vocabulary rows (config.json's vocab_size), fewer "
                 f"than the policy's {rows}: the policy samples from all of its rows (those past its tokenizer's tokens "
                 "with a tiny probability), and the teacher reads every sampled id, so one past its rows would index "
                 "past its embedding. Distil from a teacher with at least as many rows (a larger size of the family), or "
                 "leave `--grpo.teacher` empty.")
        recomputes_router = model.recompute == "full" or (model.recompute == "selective" and "moe" in model.recompute_modules)
        require(not (self.parallel.pp > 1 and self.grpo.routing_replay and recomputes_router
                      and hf_expert_count(read_hf_config(model_path, "model.path"))),
                 f"`grpo.routing_replay=true` with `parallel.pp={self.parallel.pp}` and `model.recompute={model.recompute}` "
                 "(which recomputes the routers in backward): the pipeline schedule runs later microbatches' forwards "
                 "before a microbatch's backward, so its recomputed routers would replay a later microbatch's routes. "
                 "Set `--model.recompute=none` (or selective without `moe`), `--parallel.pp=1`, or "
                 "`--grpo.routing_replay=false`.")

    def validate(self, world_size: int) -> None:
        """The shared checks and GRPO's own (the default start's SFT is checked by `trainer.default_start`)."""
        parallel, grpo, data = self.parallel, self.grpo, self.data
        self._validate_parallel_sizes()  # first: the rollout processes' and frozen models' rules divide by them
        require(parallel.vpp == 1,
                 f"GRPO samples its rollouts with the policy itself, one forward at a time through the pipeline stages, "
                 f"and that runs one model chunk per rank: `parallel.vpp={parallel.vpp}` (interleaved virtual stages) would "
                 f"send every decode step around the ranks `parallel.vpp` times for no gain, since generation does not "
                 f"fill the pipeline. Set `--parallel.vpp=1` (`parallel.pp` > 1 is fine).")
        require(not data.pack, "`data.pack` is for SFT; GRPO batches its rollouts itself. Remove `--data.pack=true`.")
        require(grpo.n_samples >= 2,
                 f"`grpo.n_samples` must be at least 2 (advantages compare completions of one prompt), got {grpo.n_samples}.")
        require(grpo.rollout_correction_cap >= 1.0, f"`grpo.rollout_correction_cap` must be at least 1 (a weight cap below "
                 f"1 would shrink every token's gradient), got {grpo.rollout_correction_cap}. Change `--grpo.rollout_correction_cap`.")
        for key, allowed in (("baseline", BASELINES), ("kl_estimator", KL_ESTIMATORS), ("filter_metric", FILTER_METRICS),
                             ("rollout_correction", ROLLOUT_CORRECTIONS),
                             ("tool_isolation", TOOL_ISOLATIONS), ("importance_ratio", IMPORTANCE_RATIOS), ("loss_aggregation", LOSS_AGGREGATIONS)):
            require(getattr(grpo, key) in allowed,
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
                          "at least 1, and at least 2 with tools (a call is answered in the next turn)"),
            "max_tool_response_tokens": (grpo.max_tool_response_tokens >= 1, "at least 1"),
            "tool_timeout": (0 < grpo.tool_timeout <= LONGEST_TIMER_S, f"positive, at most {LONGEST_TIMER_S:g} s ({TIMER_WHY})"),
            "reward_timeout": (0 <= grpo.reward_timeout <= LONGEST_TIMER_S,
                               f"0 (no limit, in the trainer's process) or more, at most {LONGEST_TIMER_S:g} s ({TIMER_WHY})"),
            "tool_workers": (grpo.tool_workers >= 0, "0 (this rank's share of the cores) or more"),
        }
        for name, (holds, rule) in rules.items():
            require(holds, f"`grpo.{name}` must be {rule}, got {getattr(grpo, name)}. Change `--grpo.{name}`.")
        # GSPO's objective is the mean over completions of one clipped sequence ratio each; any other aggregation
        # weighs a completion's single ratio by its length (token_mean) or by the budget, which is not GSPO.
        require(grpo.importance_ratio != "sequence" or grpo.loss_aggregation == "seq_mean_token_mean",
                 f"`grpo.importance_ratio=sequence` (GSPO's one ratio per completion) needs `grpo.loss_aggregation="
                 f"seq_mean_token_mean`, the mean over completions GSPO optimises; `{grpo.loss_aggregation}` would weigh "
                 "each completion's ratio by its length instead. Use `--config gspo`, set `--grpo.loss_aggregation="
                 "seq_mean_token_mean`, or use `--grpo.importance_ratio=token`.")
        require(grpo.reward != "none" or grpo.environment or grpo.teacher or grpo.reward_model,
                 "`grpo.reward=none` scores every completion 0, for an environment whose `reward()` is the whole reward, "
                 "a reward model or a teacher whose log-probs are the whole signal, but none of `grpo.environment`, "
                 "`grpo.reward_model`, `grpo.teacher` is set: every reward would be 0 and nothing would be learned. Set "
                 "one of them, or choose a reward function with `--grpo.reward`.")
        if grpo.kl_coef > 0 and grpo.kl_estimator == "k1":
            log.warning("`grpo.kl_estimator=k1` (log pi - log pi_ref) has zero gradient on average over tokens the "
                        "policy sampled: `grpo.kl_coef` penalises nothing, it only adds noise (the logged `kl` is still "
                        "an unbiased estimate). `--grpo.kl_estimator=k3` (the default) or `k2` pull the policy toward "
                        "the reference.")
        self._validate_dynamic_sampling()
        self._validate_frozen_models()
        self._validate_rollout_processes(world_size)
        super().validate(world_size - grpo.rollout_processes)

    def _validate_dynamic_sampling(self) -> None:
        """DAPO's filter where no group could ever be kept: every step would run all its rounds and train fill-ins."""
        grpo = self.grpo
        no_verdict = grpo.reward == "none" and not grpo.environment  # an environment's verdict is probed later
        constant = (no_verdict or not grpo.reward_weight) and not (grpo.reward_model and grpo.reward_model_weight)
        for never, why in ((grpo.filter_metric == "accuracy" and no_verdict,
                            "accuracy comes from the reward function or an environment's `(reward, correct)`, and "
                            "`grpo.reward=none` with no `grpo.environment` marks no completion correct"),
                           (grpo.filter_metric == "reward" and constant and not (grpo.overlong_buffer or grpo.format_bonus),
                            "the reward has no part that varies (a teacher's term is per token, not in the reward)")):
            require(not (grpo.dynamic_sampling and never),
                     f"`grpo.dynamic_sampling=true` keeps groups whose {grpo.filter_metric} varies, but {why}: every "
                     "group would be dropped, and every step would run all its sampling rounds to train on groups of "
                     "advantage 0. Remove `--grpo.dynamic_sampling`, or change `--grpo.filter_metric` or the reward.")
        if grpo.filters_by_accuracy() and not grpo.reward_weight and not no_verdict:
            log.warning("`grpo.dynamic_sampling=true` keeps the groups whose accuracy (the reward function's verdict) "
                        "varies, but `grpo.reward_weight=0` leaves that function out of the trained reward: a group "
                        "whose reward-model score or teacher term varies and whose accuracy does not is dropped. "
                        "`--grpo.filter_metric=reward` keeps the groups whose trained reward varies.")

    def _validate_rollout_processes(self, world_size: int) -> None:
        """`grpo.rollout_processes`: the trainers keep a layout, each rollout process samples for whole data-parallel
        ranks, and what a rollout process cannot reproduce of the colocated loop is refused."""
        grpo, processes = self.grpo, self.grpo.rollout_processes
        require(processes >= 0 and grpo.max_staleness >= 0,
                 f"`grpo.rollout_processes` and `grpo.max_staleness` must be 0 or more, got {processes} and "
                 f"{grpo.max_staleness}. Change them.")
        require(processes or grpo.max_staleness <= 1,
                 f"`grpo.max_staleness={grpo.max_staleness}` bounds how stale rollout processes' batches may be, and "
                 "`grpo.rollout_processes=0` (the colocated loop) trains each step on its own fresh rollouts. Set "
                 "`--grpo.rollout_processes`, or leave `grpo.max_staleness` at 1.")
        require(grpo.correction() != "none" or grpo.rollout_correction_cap == 2.0,
                 f"`grpo.rollout_correction_cap={grpo.rollout_correction_cap}` bounds a rollout correction, and none "
                 f"runs (`grpo.rollout_correction={grpo.rollout_correction}` resolves to none here). Set "
                 "`--grpo.rollout_correction tis` (or a rejection), or leave the cap at 2.")
        if not processes:
            return
        trainers = world_size - processes
        require(trainers >= 1,
                 f"`grpo.rollout_processes={processes}` leaves {trainers} of the {world_size} processes to train. Start "
                 f"more processes (`torchrun --nproc-per-node`) or set `--grpo.rollout_processes` below {world_size}.")
        divides = trainers % (self.parallel.tp * self.parallel.pp) == 0
        data_parallel = self.parallel.data_parallel_size(trainers) if divides else 0
        require(data_parallel and data_parallel % processes == 0,
                 f"`grpo.rollout_processes={processes}` must divide the trainers' data-parallel size: the {trainers} "
                 f"trainers at TP={self.parallel.tp} x PP={self.parallel.pp} make {data_parallel or 'no whole'} "
                 "data-parallel ranks, and each rollout process samples the batches of whole data-parallel ranks. "
                 "Change `--grpo.rollout_processes` or the number of processes.")
        for refused, why in (
                (grpo.dynamic_sampling, "`grpo.dynamic_sampling` (its extra rounds need the trainers' data-parallel "
                                        "ranks to agree after every round)"),
                (self.peft.method != "none", f"`peft.method={self.peft.method}` (a rollout replica holds merged weights, "
                                             "which differ from the adapters' forward in the last bits)"),
                (grpo.reward_model, "`grpo.reward_model` (the rollout processes score what they sample, and hold no "
                                    "reward model)")):
            require(not refused, f"`grpo.rollout_processes={processes}` does not run with {why}. Drop one of them.")

    def _validate_frozen_models(self) -> None:
        """`grpo.teacher` and `grpo.reward_model`: HF directories of dense models the parallel layout divides, the
        weights beside them meaningful (the tokenizers are compared with the policy's once loaded)."""
        grpo = self.grpo
        require(min(grpo.teacher_coef, grpo.reward_weight, grpo.reward_model_weight) >= 0,
                 f"`grpo.teacher_coef`, `grpo.reward_weight` and `grpo.reward_model_weight` must be 0 or more, got "
                 f"{grpo.teacher_coef}, {grpo.reward_weight} and {grpo.reward_model_weight}. Change them.")
        # (Beside the format bonus or the overlong penalty, which no weight scales, a weight sets their ratio.)
        require(grpo.teacher or grpo.reward_model or grpo.reward_weight == 1.0 or grpo.format_bonus or grpo.overlong_buffer,
                 f"`grpo.reward_weight={grpo.reward_weight}` weighs the reward function's score against a reward "
                 "model's (or, at 0, leaves a teacher's term alone), and neither `grpo.reward_model` nor `grpo.teacher` "
                 "is set (alone it would only scale the learning rate). Set one of them, or leave "
                 "`grpo.reward_weight` at 1.")
        for key, value, owner in (("reward_model_weight", grpo.reward_model_weight, "reward_model"),
                                  ("teacher_coef", grpo.teacher_coef, "teacher")):
            require(getattr(grpo, owner) or value == 1.0,
                     f"`grpo.{key}={value}` weighs the {owner.replace('_', ' ')}'s part, and no `grpo.{owner}` is set. "
                     f"Set `--grpo.{owner} DIR`, or leave `grpo.{key}` at 1.")
        # Under the group's std scaling a common factor of the reward's parts cancels: a weight on its only part
        # would change nothing (a teacher's term is weighed against the reward by teacher_coef; the format bonus and
        # the overlong penalty are parts no weight scales).
        parts = {key: value for key, value in (("reward_weight", grpo.reward_weight),
                                               ("reward_model_weight", grpo.reward_model_weight if grpo.reward_model else 0))
                 if value}
        if grpo.scale_rewards and not grpo.overlong_buffer and not grpo.format_bonus and len(parts) == 1:
            (key, value), = parts.items()
            require(value == 1.0,
                     f"`grpo.{key}={value}` would change nothing: it weighs the only part of each rollout's reward, and "
                     "a group's rewards are divided by their standard deviation (`grpo.scale_rewards=true`), so the "
                     "factor cancels. A teacher's term is weighed against the reward by `grpo.teacher_coef`. Leave "
                     f"`grpo.{key}` at 1 (0 drops that part), or set `--grpo.scale_rewards=false`.")
        for key, path, role in (("teacher", grpo.teacher, "distil from a dense teacher"),
                                ("reward_model", grpo.reward_model, "score with a dense reward model")):
            if not path:
                continue
            require((Path(path) / "config.json").is_file(),
                     f"`grpo.{key}={path}` is not a Hugging Face checkpoint directory (no config.json there). Point "
                     f"`--grpo.{key}` at a directory saved with `save_pretrained` (a run's `<train.out_dir>/hf`, for "
                     "one), or leave it empty.")
            hf = read_hf_config(Path(path), f"grpo.{key}")
            self.check_layout_divides(hf, key.replace("_", " "), f"grpo.{key}")
            require(not hf_expert_count(hf),
                     f"`grpo.{key}={path}` is a Mixture-of-Experts model; it is built at the policy's parallel layout, "
                     f"which expert parallelism would have to match, and that is not supported: {role}, or leave "
                     f"`--grpo.{key}` empty.")
            if key == "teacher":
                require(not is_classifier(hf),
                         f"`grpo.teacher={path}` is a reward model ({architecture(hf)}: a score head, no "
                         "language-model head), and a teacher gives log-probs of the sampled tokens. Point "
                         "`--grpo.teacher` at a causal language model, or score with it through `--grpo.reward_model`.")
            else:
                require(is_classifier(hf),
                         f"`grpo.reward_model={path}` is not a reward model (a `...ForSequenceClassification` with one "
                         f"label), its config.json names {architecture(hf) or 'no architecture'}. Train "
                         "one with `torchrun -m trainer.rm` and point `--grpo.reward_model` at its `hf/` output.")
                check_decoder_classifier(hf, path, "grpo.reward_model")
            check_tokenizer_files(Path(path), f"grpo.{key}")

    def _validate_batch(self, world_size: int) -> None:
        train, grpo = self.train, self.grpo
        data_parallel = self.parallel.data_parallel_size(world_size)
        require(train.global_batch_size % grpo.n_samples == 0 and (train.global_batch_size // grpo.n_samples) % data_parallel == 0,
                 f"`train.global_batch_size={train.global_batch_size}` counts completions: it must be a multiple of "
                 f"`grpo.n_samples={grpo.n_samples}` whose number of prompts divides over the data-parallel size "
                 f"{data_parallel}. Change `--train.global_batch_size`.")
        self._validate_token_budget()
        micro = 1 if train.micro_batch_tokens else train.micro_batch_size  # a token budget groups rows of any count
        require(train.global_batch_size % (grpo.mini_batches * micro * data_parallel) == 0,
                 f"`train.global_batch_size={train.global_batch_size}` must be a multiple of `grpo.mini_batches="
                 f"{grpo.mini_batches}`"
                 + ("" if train.micro_batch_tokens else f" x `train.micro_batch_size={train.micro_batch_size}`")
                 + f" x data-parallel size {data_parallel}. Change one of them.")


@dataclass
class RMConfig(TrainerConfig):
    """`trainer.rm`: the shared sections with reward-model training's defaults: the embedded preference set, the
    default SFT's output as the start."""

    # No router losses: megatron-core scales them for a loss averaged over tokens, and this one is over pairs.
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=DEFAULT_GRPO_START, moe_aux_loss_coeff=0.0))
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, min_lr_ratio=0.1, warmup_steps=10))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        steps=50, global_batch_size=32, micro_batch_size=16, out_dir="outputs/rm", eval_interval=25,
        eval_samples=1000, log_interval=10))

    STARTS_FROM_A_CLASSIFIER = True  # a reward model's export trains on

    def _embedded_pairs_renamed(self) -> list[str]:
        """The column keys (`data.*_field`) set to other names while the embedded set, not built yet, is the data."""
        data, default = self.data, PreferenceDataConfig
        if data.path != default.path or Path(data.path).exists():
            return []
        return [f"`data.{key}={getattr(data, key)}`" for key in ("prompt_field", "chosen_field", "rejected_field")
                if getattr(data, key) != getattr(default, key)]

    def validate(self, world_size: int) -> None:
        """The shared checks, and what a scalar head over pairs of rows cannot take."""
        super().validate(world_size)
        for holds, message in (
                (self.data.response_field == "answer" and not self.data.messages_field,
                 "`data.response_field` and `data.messages_field` are not read by `trainer.rm`: a pair's sides are "
                 "the columns `data.chosen_field` and `data.rejected_field` (each text, chat messages, or without a "
                 "`data.prompt_field` column a whole conversation). Remove them and set those two."),
                (not self.data.pack, "`data.pack=true` would put a pair's sides into shared rows, but a reward model "
                 "scores each side at its own row's last token. Remove `--data.pack=true`."),
                (self.parallel.vpp == 1, f"`parallel.vpp={self.parallel.vpp}`: reward-model training runs one model "
                 "chunk per pipeline rank. Set `--parallel.vpp=1` (`parallel.pp` > 1 is fine)."),
                (self.peft.method == "none", "`peft.method=lora` trains adapters only, but a reward model's new score "
                 "head must train whole. Set `--peft.method=none`."),
                (not self.train.micro_batch_tokens, "`train.micro_batch_tokens` groups rows by length, which would "
                 "split a pair's sides. Use `--train.micro_batch_size` (pairs per micro-batch) instead."),
                (self.data.chosen_field != self.data.rejected_field,
                 f"`data.chosen_field` and `data.rejected_field` are both `{self.data.chosen_field}`: every pair would "
                 "set a response against itself (each is dropped as alike). Set them to the two columns of each pair."),
                (not self._embedded_pairs_renamed(),
                 f"`data.path={self.data.path}` is the embedded preference set, built on first use with the columns "
                 f"{PreferenceDataConfig.prompt_field}, {PreferenceDataConfig.chosen_field} and "
                 f"{PreferenceDataConfig.rejected_field}: {', '.join(self._embedded_pairs_renamed())} names no column "
                 "of it (found only once the set is sampled, after the default SFT's run). Leave the `data.*_field` "
                 "keys unset, or point `--data.path` at your own preference set."),
                (not (self.model.moe_aux_loss_coeff or self.model.moe_z_loss_coeff),
                 "`model.moe_aux_loss_coeff` / `model.moe_z_loss_coeff`: megatron-core scales a Mixture-of-Experts "
                 "router's losses for a loss averaged over tokens, and a reward model's is averaged over pairs, so the "
                 "coefficient would act about 2 x the padded length times stronger than set. Leave both at 0 for "
                 "`trainer.rm`.")):
            require(holds, message)
