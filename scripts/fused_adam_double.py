"""Test double of Transformer Engine's `FusedAdam` for scripts/bench/bench_optimizer_memory.py and the tests; the product never uses it.

megatron-core's precision-aware optimizer (`use_precision_aware_optimizer=True`) needs TE's FusedAdam,
and TE cannot be installed without CUDA. This plain-torch class honours the part of FusedAdam's
contract that megatron-core 0.19.2 relies on, so the precision-aware branch of our trainer (bf16
moments, fp32 master weights held by the optimizer, bf16 main gradients read from
`param.decoupled_grad`) can be exercised end to end on CPU:

- constructor keywords `adam_w_mode`, `capturable`, `master_weights`, `master_weight_dtype`,
  `exp_avg_dtype`, `exp_avg_sq_dtype`, `use_decoupled_grad`, `store_param_remainders`
  (`OptimizerConfig.__post_init__` checks four of them by `inspect.signature`);
- `initialize_state(param)` (megatron's `init_state_fn` calls it with one argument),
  `get_unscaled_state(param, name)` -> fp32, `set_scaled_state(param, name, fp32 tensor)`;
- `step()` that keeps the moments in their configured dtypes, updates the fp32 master weights and
  copies them into the (bf16) parameter in place: megatron hands the optimizer views into its
  parameter buffer and all-gathers that buffer afterwards;
- the step count in each param group (`group["step"]`), as TE keeps it;
- `load_state_dict` storing the loaded states back in their configured dtypes (torch's casts them to the parameter's);
- Megatron-FSDP's DTensor parameters: as TE's `empty_like(param)` makes them, their states are DTensors too (what
  the fsdp_dtensor checkpoints save), and the update runs on each rank's local shard.

It models TE 2.0: whole fp32 master weights only. TE 2.1 added `store_param_remainders` (bf16 param
plus an int16 remainder instead of an fp32 copy), which megatron turns on by default when
`is_te_min_version("2.1.0")`; the double reports version 2.0.0 so megatron leaves it off.
fp16 and fp8 moments (which TE keeps with per-tensor scales) are refused rather than faked.

`install()` makes megatron-core build this class wherever it would build TE's FusedAdam.
"""

import sys
import types

import torch
from packaging.version import Version

from config.sections import have_transformer_engine

DOUBLE_TE_VERSION = "2.0.0"
SUPPORTED_STATE_DTYPES = (torch.float32, torch.bfloat16)


class FusedAdamDouble(torch.optim.Optimizer):
    """AdamW/Adam with TE FusedAdam's precision-aware state handling, in plain torch (test double)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, adam_w_mode=True, set_grad_none=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False):
        if amsgrad or capturable:
            raise NotImplementedError("the FusedAdam double supports neither amsgrad nor capturable (CUDA graphs)")
        if store_param_remainders:
            raise NotImplementedError(f"the FusedAdam double models TE {DOUBLE_TE_VERSION}, which keeps whole fp32 master "
                                      "weights (store_param_remainders arrived in TE 2.1)")
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in SUPPORTED_STATE_DTYPES:
                raise NotImplementedError(f"the FusedAdam double keeps {name} in fp32 or bf16, not {dtype}")
        if master_weight_dtype != torch.float32:
            raise NotImplementedError(f"the FusedAdam double keeps fp32 master weights, not {master_weight_dtype}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}

    # ---------------------------------------------------------------- state, as TE exposes it

    def initialize_state(self, param, store_param_remainders=False):
        """Zero moments in their configured dtypes, and an fp32 copy of the parameter when master_weights."""
        self.state[param]["exp_avg"] = torch.zeros_like(param, dtype=self.name_to_dtype_map["exp_avg"])
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param, dtype=self.name_to_dtype_map["exp_avg_sq"])
        if self.master_weights:
            self.state[param]["master_param"] = param.detach().clone().float()

    def get_unscaled_state(self, param, state_name):
        """The state as fp32: the stored tensor itself when it is fp32, an fp32 copy otherwise."""
        stored = self.state[param][state_name]
        assert stored.dtype == self.name_to_dtype_map[state_name], (state_name, stored.dtype)
        return stored if stored.dtype == torch.float32 else stored.float()

    def set_scaled_state(self, param, state_name, unscaled_state):
        """Store an fp32 tensor into the state in its configured dtype (bf16 needs no scale)."""
        assert unscaled_state.dtype == torch.float32, unscaled_state.dtype
        if state_name not in self.state[param]:
            dtype = self.name_to_dtype_map[state_name]
            self.state[param][state_name] = torch.empty_like(param, dtype=dtype)
        _local(self.state[param][state_name]).copy_(_local(unscaled_state))

    def load_state_dict(self, state_dict):
        """torch's loader casts every state tensor to its parameter's dtype; as TE's FusedAdam does, store each one
        again in the dtype configured for it (a resumed precision-aware or fp16 run otherwise finds, say, fp16 moments)."""
        super().load_state_dict(state_dict)
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for key, param in zip(saved, params):
            if key in state_dict["state"]:
                self.state[param] = {}
                for name, value in state_dict["state"][key].items():
                    if value is not None:
                        self.set_scaled_state(param, name, value.float())

    def zero_grad(self, set_to_none=True):
        """Clear `.decoupled_grad` when gradients are decoupled, else `.grad`."""
        if not self.use_decoupled_grad:
            return super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for param in group["params"]:
                param.decoupled_grad = None

    # ---------------------------------------------------------------- the update

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One Adam(W) step computed in fp32; moments and master weights are stored back in their dtypes."""
        if grad_scaler is not None:
            raise NotImplementedError("the FusedAdam double does not take a grad_scaler")
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            # As TE: every group with parameters counts the step, and every parameter gets its state, gradient or not
            # (megatron-core's load under Megatron-FSDP makes the state it loads into with a step whose gradients are
            # in `.grad`, not `decoupled_grad`).
            group["step"] = group.get("step", 0) + 1
            for param in group["params"]:
                if not self.state[param]:
                    self.initialize_state(param, self.store_param_remainders)
            params = [param for param in group["params"] if self._gradient(param) is not None]
            beta1, beta2 = group["betas"]
            if group["bias_correction"]:
                correction1, correction2 = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
            else:
                correction1 = correction2 = 1.0
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in params:
                # The fp32 weights the update applies to: the master copy, or the parameter itself.
                weights = _local(self.get_unscaled_state(param, "master_param") if self.master_weights
                                 else param.detach().float())
                grad = _local(self._gradient(param)).float()
                if not self.adam_w_mode:
                    grad = grad + decay * weights  # Adam with L2 regularisation folds the decay into the gradient
                exp_avg = _local(self.get_unscaled_state(param, "exp_avg"))
                exp_avg_sq = _local(self.get_unscaled_state(param, "exp_avg_sq"))
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (exp_avg / correction1) / ((exp_avg_sq / correction2).sqrt() + eps)
                if self.adam_w_mode:
                    update.add_(weights, alpha=decay)  # decoupled weight decay
                weights.add_(update, alpha=-lr)
                self.set_scaled_state(param, "exp_avg", exp_avg)
                self.set_scaled_state(param, "exp_avg_sq", exp_avg_sq)
                if self.master_weights:
                    self.set_scaled_state(param, "master_param", weights)
                # In place: the parameter is a view into megatron's buffer, which is all-gathered next.
                if _local(param).data_ptr() != weights.data_ptr():
                    _local(param).copy_(weights)
        return loss

    def _gradient(self, param):
        """Where megatron put this parameter's gradient."""
        return getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad


def _local(tensor):
    """A DTensor's shard on this rank (Megatron-FSDP's parameters, gradients and states); any other tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


# ---------------------------------------------------------------- wiring it into megatron-core

_MISSING = object()
_replaced: list = []  # (owner, name, original) in the order install() replaced them


def _double_is_te_min_version(version, check_equality=True) -> bool:
    """megatron-core's `is_te_min_version`, answered for the TE version the double models."""
    have, want = Version(DOUBLE_TE_VERSION), Version(version)
    return have >= want if check_equality else have > want


def _set(owner, name: str, value) -> None:
    """Replace an attribute of a module (or an entry of `sys.modules`), remembering the original for `uninstall()`."""
    if isinstance(owner, dict):
        _replaced.append((owner, name, owner.get(name, _MISSING)))
        owner[name] = value
    else:
        _replaced.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)


def install() -> None:
    """Make megatron-core use FusedAdamDouble wherever it would use TE's FusedAdam, and let our rules see TE.

    Every module that decides at import time whether TE is present (megatron-core's layers and
    optimizer modules, our `model.build`, which picks the layer spec) is imported first, so those
    decisions stay "no TE". No top-level `transformer_engine` module is created: only
    `transformer_engine.pytorch.optimizers` is registered, which `OptimizerConfig.__post_init__`
    imports lazily (Python finds a dotted name in `sys.modules` without importing its parents).
    """
    if _replaced:
        return
    if have_transformer_engine():
        raise RuntimeError("Transformer Engine is installed: use it, not the FusedAdam test double.")
    import megatron.core.models.gpt.gpt_model  # noqa: F401  (layers decide TE-or-not at import)
    import megatron.core.optimizer as megatron_optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer_config as optimizer_config

    import model.build  # noqa: F401  (decides the layer spec from have_transformer_engine() at import)
    from config import sections

    optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    optimizers.__doc__ = "Test double registered by scripts/fused_adam_double.py; holds only FusedAdam."
    optimizers.FusedAdam = FusedAdamDouble
    _set(sys.modules, optimizers.__name__, optimizers)
    # get_megatron_optimizer builds `Adam(..., adam_w_mode=...)` unless USING_PYTORCH_OPTIMIZER.
    _set(megatron_optimizer, "Adam", FusedAdamDouble)
    _set(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    # Both modules imported is_te_min_version by name; it gates store_param_remainders.
    _set(megatron_optimizer, "is_te_min_version", _double_is_te_min_version)
    _set(optimizer_config, "is_te_min_version", _double_is_te_min_version)
    # The distributed optimizer's state_dict reads TE's per-group "step" only when it believes TE is used.
    _set(distrib_optimizer, "Adam", FusedAdamDouble)
    _set(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    _set(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    # Start-up validation asks this (precision-aware needs TE's FusedAdam); model.build asked it at import.
    _set(sections, "have_transformer_engine", lambda: True)


def uninstall() -> None:
    """Undo `install()`: every replaced attribute and `sys.modules` entry gets its original back."""
    while _replaced:
        owner, name, original = _replaced.pop()
        if isinstance(owner, dict):
            if original is _MISSING:
                owner.pop(name, None)
            else:
                owner[name] = original
        else:
            setattr(owner, name, original)
