"""The FusedAdam test double itself: AdamW math, precision-aware state dtypes, and what install() changes."""

import importlib.util

import pytest
import torch

from scripts import fused_adam_double
from scripts.fused_adam_double import FusedAdamDouble


def test_matches_torch_adamw_in_fp32():
    torch.manual_seed(0)
    reference = torch.nn.Parameter(torch.randn(5, 7))
    doubled = torch.nn.Parameter(reference.detach().clone())
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW([reference], **settings)
    double = FusedAdamDouble([doubled], adam_w_mode=True, **settings)
    for _ in range(5):
        gradient = torch.randn(5, 7)
        reference.grad, doubled.grad = gradient.clone(), gradient.clone()
        torch_adamw.step()
        double.step()
    torch.testing.assert_close(doubled, reference, rtol=0, atol=1e-6)
    assert double.param_groups[0]["step"] == 5  # TE counts steps per group


def test_precision_aware_state_and_decoupled_gradient():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 3).bfloat16())
    double = FusedAdamDouble([param], lr=1e-2, master_weights=True, use_decoupled_grad=True,
                             exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    double.initialize_state(param)  # megatron's init_state_fn passes only the parameter
    master_before = double.get_unscaled_state(param, "master_param").clone()
    param.decoupled_grad = torch.randn(4, 3).bfloat16()
    storage = param.data_ptr()
    double.step()
    state = double.state[param]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype, state["master_param"].dtype) == (
        torch.bfloat16, torch.bfloat16, torch.float32)
    assert param.grad is None and param.data_ptr() == storage  # updated in place, from the decoupled gradient
    master = double.get_unscaled_state(param, "master_param")
    assert not torch.equal(master, master_before)
    assert torch.equal(param.detach(), master.bfloat16())
    unscaled = double.get_unscaled_state(param, "exp_avg")
    assert unscaled.dtype == torch.float32
    double.set_scaled_state(param, "exp_avg", unscaled * 2)
    assert torch.equal(state["exp_avg"], (unscaled * 2).bfloat16())


def test_refuses_what_it_does_not_model():
    param = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(NotImplementedError, match="store_param_remainders"):
        FusedAdamDouble([param], store_param_remainders=True)
    with pytest.raises(NotImplementedError, match="exp_avg_dtype"):
        FusedAdamDouble([param], exp_avg_dtype=torch.uint8)


def test_install_feeds_megatron_the_double_and_hides_nothing_else():
    import megatron.core.optimizer as megatron_optimizer
    from megatron.core.optimizer import OptimizerConfig

    from config import sections
    from model import providers

    precision_aware = dict(optimizer="adam", bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                           use_precision_aware_optimizer=True, main_grads_dtype=torch.bfloat16,
                           exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    fused_adam_double.install()
    try:
        config = OptimizerConfig(**precision_aware)  # imports transformer_engine.pytorch.optimizers.FusedAdam
        assert config.store_param_remainders is False  # the double reports TE 2.0
        assert megatron_optimizer.Adam is FusedAdamDouble and not megatron_optimizer.USING_PYTORCH_OPTIMIZER
        assert sections.have_transformer_engine()
        # The layer spec still sees no Transformer Engine.
        assert importlib.util.find_spec("transformer_engine") is None and not providers.HAVE_TRANSFORMER_ENGINE
    finally:
        fused_adam_double.uninstall()
    assert megatron_optimizer.Adam is torch.optim.AdamW and megatron_optimizer.USING_PYTORCH_OPTIMIZER
    assert not sections.have_transformer_engine()
    with pytest.raises(RuntimeError, match="FusedAdam"):
        OptimizerConfig(**precision_aware)


def test_a_step_without_gradients_makes_the_state_and_counts_it_as_te_does():
    """TE's FusedAdam gives every parameter its state and every group with parameters its step count, gradient or not.
    megatron-core's load under Megatron-FSDP makes the state it loads into with a zero-gradient step that writes `.grad`
    where the precision-aware optimizer reads `decoupled_grad`: the double left the state empty, the checkpoint's moments
    had nowhere to go, and a bf16 precision-aware resume left the straight run at the second step after it."""
    param = torch.nn.Parameter(torch.randn(4, 3).bfloat16())
    before = param.detach().clone()
    double = FusedAdamDouble([param], lr=1e-2, master_weights=True, use_decoupled_grad=True,
                             exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    param.grad = torch.zeros_like(param)  # `_init_optimizer_states_with_dummy_values`
    double.step()
    assert set(double.state[param]) == {"exp_avg", "exp_avg_sq", "master_param"}
    assert double.param_groups[0]["step"] == 1
    assert torch.equal(param.detach(), before)  # no gradient where it reads them: no update
