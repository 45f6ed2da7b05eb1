"""The training-time test's attention as one [T, T] product and a few per-query dot products (CPU).

Step j of the unrolled training-time test (heads.layers.UnrollKV) attends over j blocks of T keys: query t sees
the true-feature keys of block 1 at positions <= t - (j - 1), and from each later block i exactly one key, its
ancestor at t - (j - i) (block j: itself). Written as a dense [T, j*T] mask, SDPA computes all j*T scores of every
query and its CPU kernels skip none of the masked ones; here block 1 is one [T, T] product and every later block
a per-query dot product, softmaxed together. Same attention, less work: the EAGLE head's step (two unrolled steps)
1.09x and EAGLE-3's (three) 1.15x as fast on a 2-core CPU (`python scripts/bench_train.py --attention`,
docs/benchmarks.md).

Scores and their softmax are computed in fp32 (as SDPA's CPU kernels keep them under bf16 autocast), the
weighted sum of the values in their dtype; in fp32 the result equals SDPA with the dense mask within rounding
(tests/heads/test_chain_attention.py). On other devices the dense mask goes to SDPA as before: GPU kernels
handle it without the [T, T] scores in memory.

    layer(x, attention_mask=ChainMask(steps=j, length=T), cache=JoinKV(prefix))   # a head layer's config
    names NAME as its attention (heads.layers.head_layer_config); tensor masks take transformers' SDPA path
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "headway_chain"
_dense_only = False  # dense_chain_masks(): every ChainMask as its dense mask through SDPA (the path before)


@dataclass(frozen=True)
class ChainMask:
    """Which keys step `steps` of a training-time-test unroll over `length` positions sees (module docstring)."""

    steps: int
    length: int

    def dense(self, device) -> Tensor:
        """The same visibility as a bool mask [1, 1, T, steps*T]."""
        t = torch.arange(self.length, device=device)
        blocks = [t[None, :] <= t[:, None] - (self.steps - 1)]  # true-feature context
        blocks += [t[None, :] == t[:, None] - (self.steps - i) for i in range(2, self.steps + 1)]  # ancestors
        return torch.cat(blocks, -1)[None, None]


def chain_attention(query: Tensor, key: Tensor, value: Tensor, steps: int, scale: float) -> Tensor:
    """query [B, H, T, D], key/value [B, Hkv, steps*T, D] (grouped: H = g * Hkv) -> [B, H, T, D] in value's dtype.
    Scores and softmax in at least fp32 (as SDPA's kernels keep them), the weighted sum of values in value's dtype."""
    with torch.autocast(query.device.type, enabled=False):  # bf16 scores would round them; the products stay small
        return _chain_attention(query, key, value, steps, scale)


def _chain_attention(query: Tensor, key: Tensor, value: Tensor, steps: int, scale: float) -> Tensor:
    B, H, T, D = query.shape
    Hkv = key.shape[1]
    g = H // Hkv
    exact = torch.promote_types(query.dtype, torch.float32)
    q = (query.to(exact) * scale).reshape(B, Hkv, g * T, D)  # query head h reads key/value head h // g
    key = key.to(exact)
    t = torch.arange(T, device=query.device)
    context = (q @ key[:, :, :T].transpose(-1, -2)).view(B, Hkv, g, T, T)
    context = context.masked_fill(t[None, :] > t[:, None] - (steps - 1), float("-inf"))  # [B, Hkv, g, T, T]
    if steps == 1:
        weights = context.softmax(-1).to(value.dtype)
        return (weights.view(B, Hkv, g * T, T) @ value[:, :, :T]).view(B, H, T, D)
    ancestor_k, ancestor_v = ancestors(key, T, steps), ancestors(value, T, steps)  # [B, Hkv, T, steps-1, D]
    chain = torch.einsum("bhgtd,bhtjd->bhgtj", q.view(B, Hkv, g, T, D), ancestor_k)  # [B, Hkv, g, T, steps-1]
    lags = torch.arange(steps - 2, -1, -1, device=query.device)  # block i = 2..steps sits t - lag back
    chain = chain.masked_fill(t[:, None] < lags[None, :], float("-inf"))  # no ancestor before position 0
    weights = torch.cat([context, chain], -1).softmax(-1).to(value.dtype)  # [B, Hkv, g, T, T + steps - 1]
    out = (weights[..., :T].reshape(B, Hkv, g * T, T) @ value[:, :, :T]).view(B, Hkv, g, T, D)
    out = out + torch.einsum("bhgtj,bhtjd->bhgtd", weights[..., T:], ancestor_v)
    return out.reshape(B, H, T, D)


def ancestors(x: Tensor, T: int, steps: int) -> Tensor:
    """Blocks 2..steps of x [B, Hkv, steps*T, D], block i shifted right by steps - i so that row t holds the entry
    query t sees (zeros before position 0) -> [B, Hkv, T, steps - 1, D]."""
    shifted = [F.pad(x[:, :, (i - 1) * T: i * T], (0, 0, steps - i, 0))[:, :, :T] for i in range(2, steps + 1)]
    return torch.stack(shifted, -2)


def chain_or_sdpa_forward(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-function contract (-> ([B, T, H, D], None)): a ChainMask on a CPU through
    chain_attention; a ChainMask elsewhere as its dense mask, and every tensor mask, through transformers' SDPA."""
    if isinstance(attention_mask, ChainMask):
        if query.device.type == "cpu" and not (dropout or kwargs.get("softcap") or _dense_only):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = chain_attention(query, key, value, attention_mask.steps, scale)
            return out.transpose(1, 2).contiguous(), None
        attention_mask = attention_mask.dense(query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


@contextmanager
def dense_chain_masks():
    """Within: ChainMasks go to SDPA as dense masks on every device (what training ran before; benchmarks and tests
    compare the two)."""
    global _dense_only
    before, _dense_only = _dense_only, True
    try:
        yield
    finally:
        _dense_only = before


AttentionInterface.register(NAME, chain_or_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # a model built from a head layer's config masks as for "sdpa"
