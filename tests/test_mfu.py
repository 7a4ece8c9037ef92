"""SFT's `mfu` figure (`trainer.metrics`): the FLOPs a token does (`model_flops_per_token`), the card's peak
(`peak_flops`), and the row that divides them (`trainer.sft.step_row`). Plain pytest: no process group, no GPU."""

import pytest

from trainer.metrics import model_flops_per_token, peak_flops

# The embedded models' shapes (model/tiny.py) with a round vocabulary, and Qwen3-0.6B's (head_dim 128, not 1024 / 16).
TINY = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 352, "vocab_size": 1000}
TINY_MOE = {**TINY, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
            "decoder_sparse_step": 1, "mlp_only_layers": []}
QWEN3_0P6B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936}


@pytest.mark.parametrize("hf_config, frozen_base, expected", [
    # 6 x (4 x (q,k,v,o 128x32x(8+4) = 49,152 + gate,up,down 3x128x352 = 135,168) + output 128x1000) + 6x4x64x128 scores
    (TINY, False, 6 * (4 * (49_152 + 135_168) + 128_000) + 196_608),
    # LoRA: the frozen weights forward and pass gradients back (4x), no weight gradients; the scores' backward stays
    (TINY, True, 4 * (4 * (49_152 + 135_168) + 128_000) + 196_608),
    # MoE, per token: the router 128x8 and 2 of the 8 experts (3x128x96 each), not a dense MLP of intermediate_size
    (TINY_MOE, False, 6 * (4 * (49_152 + 1_024 + 2 * 36_864) + 128_000) + 196_608),
    # q and o are 1024 x (16 x 128), k and v 1024 x (8 x 128); scores over 16 x 128 = 2048 query dimensions
    (QWEN3_0P6B, False, 6 * (28 * (1024 * 128 * 48 + 3 * 1024 * 3072) + 1024 * 151_936) + 6 * 28 * 64 * 2048),
])
def test_model_flops_per_token_counts_the_work_a_token_does(hf_config, frozen_base, expected):
    """MFU's numerator (`trainer.metrics.model_flops_per_token`, at 64 positions). Before, a Mixture-of-Experts layer
    was counted as a dense MLP of `intermediate_size` (tiny-moe's 5.39e6 FLOPs a token for 3.94e6 done: MFU 37% high),
    LoRA's frozen weights as trained ones (6x: MFU 1.5x high), and a Qwen3 model's head_dim as hidden / heads
    (Qwen3-0.6B's attention projections and scores at half their size: 3.06e9 for 3.60e9, MFU 15% low)."""
    assert model_flops_per_token(hf_config, 64, frozen_base=frozen_base) == expected


@pytest.mark.parametrize("lora, factor, dtype", [(None, 6, "bf16"), ("adapters", 4, "bf16"), (None, 6, "fp16"),
                                                (None, None, "fp32")])
def test_sft_rows_mfu_counts_lora_frozen_weights_at_four(monkeypatch, lora, factor, dtype):
    """SFT's row on a GPU: mfu = tokens/s x FLOPs a token / (peak x processes), LoRA's frozen weights at 4x (the
    adapters' policy passes `frozen_base`). 64 positions a second on one H100 of 989 TFLOP/s. An fp32 run has none: the
    peaks are bf16's, and fp32 products (no TF32) run at under a tenth of them (H100: 67 of 989 TFLOP/s, NVIDIA's
    datasheet)."""
    import types

    import torch

    from trainer import metrics, sft

    monkeypatch.setattr(metrics, "peak_flops", lambda: 989e12)
    policy = types.SimpleNamespace(hf_config=TINY, lora=lora, global_tokens=lambda count: count,
                                   provider=types.SimpleNamespace(bf16=dtype == "bf16", fp16=dtype == "fp16"),
                                   loss_scale_figures=lambda skipped: {},
                                   routing_figures=types.SimpleNamespace(step_figures=lambda: {}))
    batch = {"tokens": torch.zeros(1, 64, dtype=torch.long), "padding_mask": torch.zeros(1, 64, dtype=torch.bool)}
    timer = types.SimpleNamespace(seconds=1.0, phases={})
    row = sft.step_row(1, policy, types.SimpleNamespace(world_size=1), 1.0, 1.0, 1.0, 1e-3, [batch], 64, timer, 0)
    if factor is None:
        assert "mfu" not in row
        return
    matmuls = 4 * (49_152 + 135_168) + 128_000  # TINY's weights a token multiplies (above)
    assert row["mfu"] == pytest.approx(64 * (factor * matmuls + 196_608) / 989e12, rel=1e-12)


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", None)])
def test_mfu_divides_by_the_peak_of_the_card_it_runs_on(monkeypatch, name, peak):
    """MFU's denominator by `torch.cuda.get_device_name()`: an H100 PCIe (756 TFLOP/s bf16 dense; NVIDIA lists 1,513
    with sparsity) and the NVL cards (835) were read as an H100 SXM (989): their MFU 15-24% low."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: name)
    assert peak_flops() == peak
