"""Masked grouped-query attention through SDPA's GQA mode equals transformers' sdpa attention (which copies
keys/values per head), and only the CPU kernels' layouts switch to it: the HF baseline keeps the model's own."""

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headway.heads.target import load_target
from headway.heads.kernels import panel
from headway.heads.kernels.attention import NAME, grouped_sdpa_forward, use_grouped_attention
from headway.heads.kernels.weight_layout import apply_layout, stock_layout


class Attention(nn.Module):
    num_key_value_groups = 3
    is_causal = True


def tree_mask(q_len: int, kv_len: int, boolean: bool) -> torch.Tensor:
    """[1, 1, Q, L]: every query sees the cached prefix and a random subset of the new tokens."""
    g = torch.Generator().manual_seed(q_len)
    sees = torch.ones(q_len, kv_len, dtype=torch.bool)
    sees[:, kv_len - q_len:] = (torch.rand(q_len, q_len, generator=g) < 0.5) | torch.eye(q_len, dtype=torch.bool)
    if boolean:
        return sees[None, None]
    return torch.zeros(q_len, kv_len).masked_fill(~sees, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("q_len", [1, 5, 16])
@pytest.mark.parametrize("boolean", [False, True])
def test_grouped_attention_equals_transformers_sdpa(q_len, boolean):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 9, q_len, 32, generator=g)  # [B, H, Q, D]
    key, value = torch.randn(2, 2, 3, 40, 32, generator=g).unbind(1)  # [B, H_kv, L, D] each
    mask = tree_mask(q_len, 40, boolean)
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.2)
    out, _ = grouped_sdpa_forward(Attention(), query, key, value, mask, scaling=0.2)
    assert out.shape == (2, q_len, 9, 32) and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_switching_touches_only_the_sdpa_attention():
    model = load_target({"path": "tiny-random", "name": "tiny-random"}).model
    assert model.config._attn_implementation == "sdpa"
    use_grouped_attention(model, True)
    assert model.config._attn_implementation == NAME
    use_grouped_attention(model, False)
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    use_grouped_attention(model, True)
    assert model.config._attn_implementation == "eager"


@pytest.mark.skipif(panel.unavailable_reason() is not None, reason="panel layout unavailable here")
def test_the_cpu_kernels_layouts_use_it_and_the_hf_baseline_does_not():
    model = load_target({"path": "tiny-random", "name": "tiny-random"}).model
    apply_layout(model, "panel")
    assert model.config._attn_implementation == NAME
    with stock_layout(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == NAME
    apply_layout(model, "wide-column")
    assert model.config._attn_implementation == "sdpa"
