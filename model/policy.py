"""`Policy`: the model a loop trains and everything built with it (Bridge and its provider, chunks, optimizer, LR
schedule, tokenizer), with what the loops ask of it: generation, routes, a frozen copy, token counts, exports.
"""

import contextlib
import dataclasses
import functools
import logging
from pathlib import Path


from config import outputs
from model import collectives, moe
from model.providers import declare_end_ids, declare_saved_dtype, export_hf, keep_source_tokenizer_settings
from model.wrapping import build_chunks, experts_span_data_parallel, training_hooks_detached

log = logging.getLogger(__name__)



@dataclasses.dataclass
class Policy:
    """The trained model and everything built with it: Bridge and its provider, chunks, optimizer, LR schedule, tokenizer."""

    bridge: object
    provider: object  # Bridge's model provider, a megatron-core TransformerConfig: every chunk's settings
    chunks: list
    optimizer: object
    lr_schedule: object
    tokenizer: object
    hf_config: dict
    lora: object = None  # Megatron-Bridge's LoRA transform when `peft.method=lora` (its adapters are the trained part)

    @property
    def vocab_size(self) -> int:
        """Rows of the HF vocabulary (megatron pads its embedding beyond this)."""
        return self.hf_config["vocab_size"]

    @property
    def can_generate(self) -> bool:
        """Generation runs one model chunk per rank through the pipeline stages: no virtual pipeline stages."""
        return len(self.chunks) == 1

    @functools.cached_property
    def engine(self):
        """The policy's generation object: end ids from the tokenizer and `generation_config.json`; under Megatron-FSDP,
        whose every forward gathers parameters, and where a Mixture-of-Experts layer exchanges tokens between
        data-parallel ranks (`experts_span_data_parallel`), the data-parallel group inside (so every rank runs the same
        forwards). DDP's forwards otherwise communicate nothing across data-parallel ranks, so there each rank
        generates on its own, with no agreement per step, but for multi-turn rollouts (see `Engine`)."""
        from megatron.core import parallel_state

        from model.generate import Engine, end_token_ids

        gathers_per_forward = any(getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False)
                                  for chunk in self.chunks) or experts_span_data_parallel(self.provider)
        data_parallel = (parallel_state.get_data_parallel_group()
                         if parallel_state.get_data_parallel_world_size() > 1 else None)
        return Engine(self.chunks, self.vocab_size,
                         end_token_ids(self.bridge.hf_pretrained.model_name_or_path, self.tokenizer),
                         data_parallel if gathers_per_forward else None, data_parallel, self.routes)

    @functools.cached_property
    def routes(self):
        """The routers of a Mixture-of-Experts policy, to record, replay and compare routes (`model.routing`); empty
        (false) for a dense model."""
        from model.routing import Routes

        return Routes(self.chunks)

    @functools.cached_property
    def routing_figures(self):
        """The per-step routing figures of a Mixture-of-Experts policy (`moe.RoutingFigures`: hooks on its routers, set
        on first use); a dense policy's report nothing."""
        return moe.RoutingFigures(self.chunks, self.provider)

    def optimizer_step(self) -> float | None:
        """One optimizer step over the gradients the pipeline schedule accumulated: the gradient norm, or None when
        megatron-core skipped the update (`model.dtype=fp16`: the dynamic loss scale found an inf or NaN gradient, on
        every rank alike, so the weights stay as they were and the scale is lowered)."""
        applied, grad_norm, _ = self.optimizer.step()
        return float(grad_norm or 0.0) if applied else None

    def next_lr(self, applied: bool = True) -> float:
        """Move the learning-rate schedule on by one step, after the step's optimizer steps; the rate the step used
        (what its metrics row reports: the optimizer's rate now is the next step's). As in megatron-core and
        transformers, warmup starts at 0: the first step's rate is 0 when `optim.warmup_steps` > 0. A step none of whose
        updates was `applied` (fp16 overflows) leaves the schedule where it is, as megatron's training loop does: skipped
        steps use up neither warmup nor decay."""
        lr = self.optimizer.param_groups[0]["lr"]
        if applied:
            self.lr_schedule.step(increment=1)
        return lr

    def loss_scale_figures(self, skipped_updates: int) -> dict:
        """With fp16's dynamic loss scale: the scale after the step (`loss_scale`) and the step's updates it skipped
        (`skipped_updates`); empty in bf16 and fp32, which have no loss scale."""
        if not self.provider.fp16:
            return {}
        return {"loss_scale": float(self.optimizer.get_loss_scale()), "skipped_updates": skipped_updates}

    def global_tokens(self, local_tokens: int) -> float:
        """Tokens of a step over every rank, each model replica's batch counted once (its TP/PP ranks saw the same)."""
        provider = self.provider
        return collectives.all_reduce_sum([float(local_tokens)])[0] / (provider.tensor_model_parallel_size
                                                                     * provider.pipeline_model_parallel_size)

    def sync_parameters(self) -> None:
        """Finish the parameter gathers of the last optimizer step, before anything reads parameters outside a forward
        (checkpoint save, HF export, shutdown). Collective.

        DDP with `overlap_param_gather`: the gather of updated shards waits for the next forward, so run it now.
        Megatron-FSDP with it: the step's asynchronous all-gathers may still be writing into parameter storage;
        wait for every one of them (`synchronize_param_gather`), which leaves the parameters as their shards.
        """
        for chunk in self.chunks:
            ddp_config = getattr(chunk, "ddp_config", None)
            if ddp_config is None or not ddp_config.overlap_param_gather:
                continue
            if ddp_config.use_megatron_fsdp:
                chunk.synchronize_param_gather()
            else:
                chunk.start_param_sync(force_sync=True)

    @contextlib.contextmanager
    def adapters_disabled(self):
        """With LoRA: the base model inside the block (the adapters switched off), exactly as it was built."""
        with self.lora.disable_adapter(self.chunks):
            yield

    def frozen_copy(self) -> list:
        """A second copy of the starting weights that is never trained (GRPO's KL reference without LoRA)."""
        with training_hooks_detached(self.provider):
            chunks = build_chunks(self.provider)
        for chunk in chunks:
            chunk.requires_grad_(False).eval()
        return chunks

    def export(self, directories: dict, is_main: bool) -> None:
        """Write the model and its tokenizer as a Hugging Face checkpoint into `directories[outputs.HF]`, and with LoRA
        the adapter in PEFT format into `directories[outputs.HF_ADAPTER]` (`ckpt.checkpoint` stages and publishes
        them). Collective."""
        self.sync_parameters()
        export_hf(self.bridge, self.chunks, directories[outputs.HF])  # with LoRA: the adapters merged into the weights
        if self.lora is not None:
            # The base as an absolute path, so the adapter loads from wherever it is read.
            base = Path(self.bridge.hf_pretrained.model_name_or_path).resolve()
            self.bridge.save_hf_adapter(self.chunks, str(directories[outputs.HF_ADAPTER]), peft_config=self.lora,
                                        base_model_name_or_path=str(base))
        if is_main:
            self.tokenizer.save_pretrained(directories[outputs.HF])
            declare_end_ids(directories[outputs.HF], self.engine.end_ids)
            declare_saved_dtype(directories[outputs.HF])
            keep_source_tokenizer_settings(directories[outputs.HF], self.bridge.hf_pretrained.model_name_or_path)

    def exports(self) -> tuple[str, ...]:
        """The names of what `export` writes into `train.out_dir`."""
        return outputs.EXPORTS if self.lora is not None else (outputs.HF,)
