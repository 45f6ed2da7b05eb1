"""The decode-step attention kernel: the attention SDPA computes (closer to an fp64 reference than SDPA's own
bf16 result), left pads unattended, keys and values read through a cache's strided views (data generation runs
it: tests/data/test_decode.py)."""

import pytest
import torch
import torch.nn.functional as F

from headway.heads.kernels import decode_attention as kernel_module
from headway.heads.kernels.decode_attention import decode_attention

pytestmark = pytest.mark.skipif(not kernel_module.available(), reason="needs AVX-512 or AVX2 and a C++ compiler")


def case(dtype, B=5, Hkv=3, G=3, D=64, T=37, room=11, seed=0):
    """query [B, H, 1, D]; key/value [B, Hkv, T, D] as views into buffers with spare room (a growing cache);
    a bool mask [B, 1, 1, T] with left pads of different widths."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, Hkv * G, 1, D, generator=g).to(dtype)
    key = torch.randn(B, Hkv, T + room, D, generator=g).to(dtype)[:, :, :T]
    value = torch.randn(B, Hkv, T + room, D, generator=g).to(dtype)[:, :, :T]
    pads = torch.arange(B) * 3  # row b: its first 3b positions are padding
    mask = (torch.arange(T) >= pads[:, None])[:, None, None]  # [B, 1, 1, T]
    return query, key, value, mask


def reference(query, key, value, mask, scale):
    """fp64 SDPA, query heads grouped per key head -> [B, 1, H, D] as transformers' attention returns."""
    out = F.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("G,D", [(3, 64), (1, 64), (4, 128)])
@pytest.mark.parametrize("masked", [True, False])
def test_kernel_computes_attention_in_fp32(G, D, masked):
    query, key, value, mask = case(torch.float32, G=G, D=D)
    mask = mask if masked else None
    out = decode_attention(query, key, value, mask, 0.125)
    assert out.shape == (5, 1, 3 * G, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(query, key, value, mask, 0.125), rtol=1e-5, atol=1e-6)


def test_left_pads_are_not_attended():
    query, key, value, mask = case(torch.float32)
    out = decode_attention(query, key, value, mask, 0.125)
    row = 4  # its first 12 positions are pads: the same as the row without them
    alone = decode_attention(query[row:row + 1], key[row:row + 1, :, 12:], value[row:row + 1, :, 12:], None, 0.125)
    torch.testing.assert_close(out[row:row + 1], alone, rtol=1e-5, atol=1e-6)
    garbage = value.clone()
    garbage[row, :, :12] = 1e6  # what a pad holds does not matter
    torch.testing.assert_close(decode_attention(query, key, garbage, mask, 0.125)[row], out[row])


def test_bf16_is_at_least_as_close_to_fp64_as_sdpa():
    query, key, value, mask = case(torch.bfloat16, B=16, T=300)
    exact = reference(query, key, value, mask, 0.125)
    mine = (decode_attention(query, key, value, mask, 0.125).double() - exact).abs().max()
    sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.125, enable_gqa=True)
    theirs = (sdpa.transpose(1, 2).double() - exact).abs().max()
    assert mine <= theirs and mine < 0.02  # one bf16 rounding of values of magnitude ~0.1-1


@pytest.mark.parametrize("change", ["two_queries", "head_dim_32", "float_mask", "fp16"])
def test_what_the_kernel_does_not_take_is_left_to_sdpa(change):
    query, key, value, mask = case(torch.float32)
    if change == "two_queries":
        query = torch.cat([query, query], 2)
    elif change == "head_dim_32":
        query, key, value = query[..., :32], key[..., :32].contiguous(), value[..., :32].contiguous()
    elif change == "float_mask":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    else:
        query, key, value = query.half(), key.half(), value.half()
    assert decode_attention(query, key, value, mask, 0.125) is None
