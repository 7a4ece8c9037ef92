"""LoRA through Megatron-Bridge's PEFT (`megatron.bridge.peft.lora.LoRA`), written only where Bridge has nothing.

`apply` wraps the chosen linear layers of the bare model chunks in Bridge's `LoRALinear` before the DDP wrap: the
base is frozen, so DDP's buffers and the optimizer hold the adapters only, and under tensor parallelism each
adapter is split like its base layer. With the adapters switched off (`LoRA.disable_adapter`) the model is the base
model exactly: GRPO's KL reference without a second copy. A checkpoint keeps the adapters only
(`ckpt.checkpoint`); the export merges them (`hf/`) and also writes them in Hugging Face PEFT format (`hf_adapter/`).

Without Transformer Engine: `megatron.bridge.peft.lora_layers` imports `transformer_engine.pytorch` at import time,
for its TE-fused variant only (chosen when `use_transformer_engine_op_fuser` is set, never here). While that one
module executes, and only then, placeholder `transformer_engine` modules stand in (`allow_import_without_te`);
every other module, megatron-core's TE checks included, is imported before or after and sees no TE. Bridge's PEFT
helpers also take megatron-core's placeholders for TE layers (MagicMocks when TE is absent) for TE, so their
`HAVE_TE*` flags are corrected to False.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# Bound at import, as model.build decides at import: the fused-Adam test double later replaces
# `sections.have_transformer_engine` (for the optimizer), and Bridge must still be imported as without TE.
from config.sections import have_transformer_engine

LORA_LAYERS = "megatron.bridge.peft.lora_layers"
# What lora_layers imports besides Transformer Engine: imported first, outside the placeholder's window.
LORA_LAYERS_DEPENDENCIES = ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
                            "megatron.bridge.peft.lora_merge", "megatron.bridge.peft.module_matcher")
# Bridge modules whose HAVE_TE* flags read megatron-core's TE placeholders as Transformer Engine.
MISREAD_TE_FLAGS = ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher")
TRANSFORMER_ENGINE_MODULES = ("transformer_engine", "transformer_engine.pytorch")


class _Absent(type):
    """A Transformer Engine name seen while lora_layers executes: usable in annotations, refuses to be built."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__} needs Transformer Engine, which is not installed")


def _placeholder(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def attribute(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{name}.{attr}", (), {})

    module.__getattr__ = attribute
    return module


def _correct_misread_te_flags() -> None:
    """Without TE, set Bridge's PEFT `HAVE_TE*` flags that megatron-core's placeholders turned True back to False."""
    import megatron.core.extensions.transformer_engine as core_te

    if core_te.HAVE_TE:
        return
    for name in MISREAD_TE_FLAGS:
        module = importlib.import_module(name)
        for attr in dir(module):
            if attr.startswith("HAVE_TE") and getattr(module, attr) is True:
                setattr(module, attr, False)


class _LoraLayersLoader(importlib.abc.Loader):
    """Executes lora_layers with placeholder TE modules present for exactly that long."""

    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        for dependency in LORA_LAYERS_DEPENDENCIES:
            importlib.import_module(dependency)
        _correct_misread_te_flags()
        top = _placeholder("transformer_engine")
        top.pytorch = _placeholder("transformer_engine.pytorch")
        sys.modules.update({"transformer_engine": top, "transformer_engine.pytorch": top.pytorch})
        try:
            self.real.exec_module(module)
        finally:
            for name in TRANSFORMER_ENGINE_MODULES:
                sys.modules.pop(name, None)


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = _LoraLayersLoader(spec.loader)
        return spec


def allow_import_without_te() -> None:
    """Make `import megatron.bridge` (which imports lora_layers) work without Transformer Engine; before that import."""
    if have_transformer_engine() or LORA_LAYERS in sys.modules:
        return
    if not any(isinstance(finder, _LoraLayersFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LoraLayersFinder())


def apply(chunks: list, peft, provider):
    """Wrap `peft.target_modules` of the bare chunks in LoRA adapters and freeze the rest; returns Bridge's `LoRA`
    (its `disable_adapter(chunks)` switches the adapters off). Before the DDP wrap."""
    from megatron.bridge.peft.lora import LoRA

    _correct_misread_te_flags()
    lora = LoRA(target_modules=list(peft.target_modules), dim=peft.rank, alpha=peft.alpha, dropout=peft.dropout)
    initialise = provider.perform_initialization
    lora(chunks, training=True)
    # Bridge sets the provider to initialise weights; later builds from it (a KL reference copy) load HF weights.
    provider.perform_initialization = initialise
    if provider.recompute_granularity is not None:
        _decoder_input_requires_grad(chunks)
    return lora


def _decoder_input_requires_grad(chunks: list) -> None:
    """With activation recomputation, make each chunk's decoder input require grad (the frozen embedding's output does
    not). megatron-core's checkpoint runs its backward only when an input requires grad, so an MLP recomputed
    (`model.recompute=selective`, `mlp`/`moe`/`shared_experts`) whose input came through frozen layers only, as with
    `peft.target_modules=[linear_fc1,linear_fc2]`, gave its adapters no gradient: grad_norm 0 at every step, nothing
    trained. Bridge's own fix (`maybe_enable_recompute_inputs_grad`) covers `model.recompute=full` only."""
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.utils import WrappedTensor

    def input_requires_grad(module, args, kwargs):
        hidden = kwargs.get("hidden_states")  # None past the first pipeline stage: its input arrives requiring grad
        wrapped = isinstance(hidden, WrappedTensor)  # how GPTModel hands the embedding's output over
        tensor = hidden.unwrap() if wrapped else hidden
        if torch.is_grad_enabled() and tensor is not None and not tensor.requires_grad:
            tensor = tensor.detach().requires_grad_()  # made from frozen weights only: nothing upstream to cut off
        kwargs["hidden_states"] = WrappedTensor(tensor) if wrapped else tensor
        return args, kwargs

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerBlock):
                module.register_forward_pre_hook(input_requires_grad, with_kwargs=True)
