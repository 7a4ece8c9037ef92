"""PyTorch's LayerNorm/RMSNorm for megatron-core's local layer specs, usable under sequence parallelism.

Without Transformer Engine or apex, megatron-core builds its norms with `WrappedTorchNorm`, which refuses
sequence parallelism ("sequence parallel not supported by torch LayerNorm"). Nothing in the norm's computation
needs to change: each token is normalised on its own, so a rank holding a slice of the sequence normalises its
slice. What changes is the weights' gradient: each tensor-parallel rank sees only its slice's contribution, and
megatron-core's `finalize_model_grads` sums those over the tensor-parallel group for every parameter tagged
`sequence_parallel=True`, the tag Transformer Engine's and apex's norms put on theirs. `TorchNorm` is
`WrappedTorchNorm` with that tag; `torch_norm_block_spec` puts it into a local layer spec wherever megatron-core
would use `WrappedTorchNorm`, the decoder's final norm included.
"""

import dataclasses

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules, get_num_layers_to_build

NORM_CLASSES = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class TorchNorm:
    """megatron-core's `WrappedTorchNorm` (same arguments, same torch module) that also runs under sequence parallelism."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        # The same refusals as WrappedTorchNorm, bar sequence parallelism (the arguments above are ignored there too).
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag):
                raise ValueError(f"{flag} is not supported by torch's LayerNorm/RMSNorm (it needs Transformer Engine)")
        if config.normalization not in NORM_CLASSES:
            raise ValueError(f"normalization={config.normalization} has no torch implementation; use Transformer Engine")
        norm = NORM_CLASSES[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _with_torch_norms(spec):
    """A copy of a layer spec whose WrappedTorchNorm submodules (at any depth) are TorchNorm."""
    if spec is WrappedTorchNorm:
        return TorchNorm
    if isinstance(spec, ModuleSpec):
        if spec.module is WrappedTorchNorm:
            return dataclasses.replace(spec, module=TorchNorm)
        if spec.submodules is not None:
            return dataclasses.replace(spec, submodules=_with_torch_norms(spec.submodules))
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{item.name: _with_torch_norms(getattr(spec, item.name))
                                            for item in dataclasses.fields(spec) if item.init})
    return spec


def torch_norm_block_spec(layer_spec_fn, config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The decoder block spec megatron-core derives from `layer_spec_fn(config)` (that layer on every layer of this
    stage, and its default final norm), with TorchNorm wherever that would be WrappedTorchNorm."""
    layer_spec = _with_torch_norms(layer_spec_fn(config))
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=_with_torch_norms(LayerNormImpl))
