"""HF checkpoint -> Megatron-Bridge -> megatron-core model chunks (TP/PP/VPP, DDP or Megatron-FSDP), and back to HF.

`build_policy` assembles everything a loop trains, always in the same order: Bridge's provider with the parallel
sizes and the layer spec (`model.providers`), the chunks wrapped for data parallelism (`model.wrapping`), the
optimizer and LR schedule, into a `model.policy.Policy`. Parallelism is applied to the model in these three modules
and nowhere else.
"""

import contextlib
import dataclasses
import functools
import logging
import os
from pathlib import Path

import torch

from config.errors import UserError
from config.checkpoint_shape import check_tokenizer_fits
from config.hf import check_tokenizer_files, read_hf_config, set_template_variables
from config.sections import EMBEDDED_MODELS
from model import lora, moe, parallel, rules, score_head as score_heads
from model.policy import Policy
from model.providers import auto_bridge, configure_provider
from model.wrapping import attach_training_hooks, build_chunks, environment_ddp_defaults, wrap_for_data_parallel

log = logging.getLogger(__name__)


def resolve_model_path(config) -> Path:
    """`model.path`: an embedded model (`tiny`, `tiny-moe`: built offline on first use), else an HF directory; its
    shape is checked against the parallel layout before anything is built."""
    if config.model.path in EMBEDDED_MODELS:
        from model.tiny import ensure_tiny_checkpoint

        path = ensure_tiny_checkpoint(name=config.model.path)
    else:
        path = Path(config.model.path)
    config.validate_model_shape(path)
    check_weight_files(path)
    return path


def check_weight_files(path: Path) -> None:
    """Every safetensors file's header and length, read without loading weights: a truncated download is named now."""
    from safetensors import SafetensorError, safe_open

    if not any(path.glob("*.safetensors")):
        raise UserError(f"`{path}` holds no `*.safetensors` weight files (a config without its weights, or weights "
                        "saved as .bin). Save the model with `save_pretrained(..., safe_serialization=True)`, or point "
                        "the setting at a complete checkpoint.")
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(weights, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise UserError(f"`{weights}` is truncated or corrupted ({error}). Download or save the checkpoint again, "
                            "or point `--model.path` at another one.") from None


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode inside the block (dropout off), in the mode it was in after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


# ---------------------------------------------------------------- the policy a loop trains


def load_tokenizer(model_path: Path, key: str = "model.path", template_variables: dict | None = None):
    """The checkpoint's tokenizer (loaded before the model, so data errors come first); a directory without one, or one
    with ids past config.json's vocab_size (`check_tokenizer_fits`), is refused naming `key`. One without a padding token (Llama 3's, Mistral's) pads with its end token, as TRL does:
    padding is masked out of every loss, and a reward model scores each row's last token that is not padding, as
    transformers does with that `pad_token_id`. `template_variables` (`data.chat_template_kwargs`) go to its chat
    template at every rendering (`config.hf.set_template_variables`)."""
    import transformers

    check_tokenizer_files(model_path, key)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    except Exception as error:  # the files are the user's: a corrupt tokenizer.json, a tokenizer class not installed
        raise UserError(f"The tokenizer of `{key}={model_path}` cannot be loaded by transformers "
                        f"({type(error).__name__}: {error}). Check its tokenizer files (tokenizer.json, "
                        "tokenizer_config.json, or the vocabulary files its tokenizer class reads), or point "
                        f"`--{key}` at a checkpoint whose tokenizer loads with `AutoTokenizer.from_pretrained`.") from None
    if (Path(model_path) / "config.json").is_file():  # a tokenizer saved alone has no vocabulary size to fit
        check_tokenizer_fits(tokenizer, read_hf_config(model_path, key), model_path, key)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"The tokenizer of `{model_path}` has neither a padding token nor an end token to pad "
                            "with. Set `pad_token` (or `eos_token`) in its tokenizer_config.json.")
        log.info("the tokenizer has no padding token: padding with its end token %r", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    set_template_variables(tokenizer, template_variables or {})
    return tokenizer


def build_policy(config, model_path: Path, tokenizer, *, trainable: bool = True,
                 on_phase=lambda phase: None, score_head: tuple | None = None, key: str = "model.path") -> Policy:
    """Everything a loop trains, in one fixed order: layer spec and TP/PP/VPP, DDP or Megatron-FSDP (after a
    parameter sync over every chunk), optimizer and LR schedule, then the pipeline schedule's training hooks.

    `trainable=False` stops after the layer spec and parallel layout: bare chunks for generation and parity
    checks, no optimizer.
    `on_phase(name)` is called as each phase ends (the loops' start-up report times them).
    `score_head=(seed, weight or None)` builds a reward model (`model.score_head.Classifier`): a scalar head in place
    of the output layer, given before the chunks are wrapped.
    `key` is the setting that names the checkpoint (`grpo.teacher` for a teacher), said in a refusal with its value.
    """
    from megatron.core.optimizer import get_megatron_optimizer

    setting = f"{key}={functools.reduce(getattr, key.split('.'), config)}"
    bridge = auto_bridge(model_path, setting)
    on_phase("megatron and Bridge import")
    provider = configure_provider(
        bridge, dtype=config.model.dtype, tp=config.parallel.tp, pp=config.parallel.pp,
        vpp=config.parallel.vpp if config.parallel.vpp > 1 else None, seq_length=config.data.max_seq_len,
        attention=config.model.attention, ep=config.parallel.ep, etp=config.parallel.expert_tensor_parallel_size,
        moe_dispatcher=config.model.moe_dispatcher,
        moe_router=rules.moe_router_overrides(config.model, lora=config.peft.method == "lora"),
        setting=setting,
        transformer_overrides={"calculate_per_token_loss": True, **rules.transformer_overrides(config)})
    hf_config = bridge.hf_pretrained.config.to_dict()
    kind = Policy if score_head is None else score_heads.Classifier
    log.info("loading %s (%s)", model_path, ", ".join(hf_config.get("architectures") or [hf_config.get("model_type", "")]))

    def bare_chunks():
        chunks = build_chunks(provider)
        if score_head is not None:
            score_heads.attach_head(chunks, provider, *score_head)
        return chunks

    if not trainable:
        return kind(bridge, provider, bare_chunks(), None, None, tokenizer, hf_config)
    optimizer_config = rules.optimizer_config(config)
    environment = parallel.detect_environment(config.parallel, torch.distributed.get_world_size())
    ddp_config = rules.ddp_config(config, optimizer_config, environment_ddp_defaults(), environment)
    chunks = bare_chunks()
    if config.model.moe_freeze_router:
        moe.freeze_routers(chunks)  # before the DDP wrap and the optimizer: neither then holds the routers' weights
    adapters = lora.apply(chunks, config.peft, provider) if config.peft.method == "lora" else None
    chunks = wrap_for_data_parallel(chunks, provider, ddp_config)
    on_phase("model build and HF weights")
    optimizer = get_megatron_optimizer(optimizer_config, chunks)
    lr_schedule = warmup_cosine_schedule(optimizer, config)
    attach_training_hooks(provider, chunks, optimizer, ddp_config)
    on_phase("optimizer")
    log.info("resolved settings:\n%s", rules.settings_table(
        optimizer_config, ddp_config, provider, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), environment.cuda))
    return kind(bridge, provider, chunks, optimizer, lr_schedule, tokenizer, hf_config, adapters)


def build_frozen_dense(config, model_path: Path, tokenizer, key: str, score_head: tuple | None = None) -> Policy:
    """A frozen dense model beside the policy (a distillation teacher, a reward model; `key` the setting naming it):
    forward only, in eval mode, at the policy's TP and PP; expert parallelism, which a dense model has nothing to spread
    over, left at 1 for it."""
    layout = dataclasses.replace(config.parallel, ep=1, etp=0)
    model = build_policy(dataclasses.replace(config, parallel=layout), model_path, tokenizer, trainable=False,
                         score_head=score_head, key=key)
    for chunk in model.chunks:
        chunk.requires_grad_(False).eval()
    return model


def warmup_cosine_schedule(optimizer, config):
    """megatron-core's LR schedule: linear warmup over `optim.warmup_steps`, cosine decay to `optim.final_lr` at `train.steps`.

    Its peak, floor and weight decay are the resolved OptimizerConfig's (`optim.override_optimizer_config` included):
    the schedule sets every group's weight decay at each step, so `optim.weight_decay` here would undo an override."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    resolved = rules.optimizer_config(config)
    warmup = min(config.optim.warmup_steps, max(config.train.steps - 1, 0))
    if warmup < config.optim.warmup_steps:
        log.info("optim.warmup_steps=%d is cut to %d: the run has %d step%s (the rate reaches optim.lr at the last)",
                 config.optim.warmup_steps, warmup, config.train.steps, "" if config.train.steps == 1 else "s")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=resolved.lr,
        min_lr=resolved.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=config.train.steps,
        lr_decay_style="cosine",
        start_wd=resolved.weight_decay,
        end_wd=resolved.weight_decay,
        wd_incr_steps=config.train.steps,
        wd_incr_style="constant",
    )
