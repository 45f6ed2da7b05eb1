"""Grouped-query attention with a mask, without copying the keys and values per query head (CPU).

transformers' "sdpa" attention hands grouped-query attention (fewer key/value heads than query heads, as in
Llama 3, Qwen 2 and SmolLM2) to SDPA's own GQA mode only when there is no mask; with one (every tree the
engine verifies has one) it first copies each key/value head once per query head it serves (`repeat_kv`),
the whole cached context, in every layer of every forward. SDPA's GQA mode takes the mask as it is. Same
values, same softmax; only the copy goes. Measured on SmolLM2-135M (9 query heads over 3 key/value heads,
256 cached tokens, 2-core CPU): the copies cost 1.8 ms of a 44 ms forward of 16 tokens.

    use_grouped_attention(model, True)    # what the CPU kernels' weight layouts do (heads.kernels.weight_layout)
    use_grouped_attention(model, False)   # back to the model's own attention (the HF baseline runs this)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "headway_sdpa_gqa"


def grouped_sdpa_forward(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-function contract: query [B, H, Q, D], key/value [B, H_kv, L, D], a float or
    bool mask [B or 1, 1, Q, >= L] -> ([B, Q, H, D], None). Anything but masked or single-token grouped
    attention on a CPU goes to transformers' own sdpa function unchanged."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    masked_or_one = attention_mask is not None or query.shape[2] == 1
    if (not grouped or not masked_or_one or query.device.type != "cpu" or dropout
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :key.shape[2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=True)  # [B, H, Q, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks transformers builds for "sdpa"


def use_grouped_attention(model: nn.Module, on: bool) -> None:
    """Switch a model whose attention is transformers' "sdpa" to grouped_sdpa_forward (on) or back (off);
    models with any other attention are left alone."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if on and current == "sdpa":
        config._attn_implementation = NAME
    elif not on and current == NAME:
        config._attn_implementation = "sdpa"
