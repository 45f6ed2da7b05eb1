"""One decode step of grouped-query attention on a CPU (decode_attention.cpp), for batched data generation.

At one query token per row, PyTorch's CPU flash attention spends most of its time on query tiles that a decode
step leaves nearly empty (a key/value head serves 3 query heads on SmolLM2-135M): batch 128, 300 cached tokens,
bf16, 2-core AMD EPYC (Zen 5): 3.1 ms per layer against 1.1 ms here (`python scripts/bench_attention.py`). The
kernel reads each cached key and value row once per query head from L2, in fp32, and rounds once at the end:
the same attention up to the order of the fp32 sums (closer to an fp64 reference than SDPA's, in the tests).

Compiled with the system C++ compiler on first use (torch.utils.cpp_extension; ~20 s once, then cached in
torch's extension folder), for AVX-512 or AVX2 (heads/kernels/panel.py); without a compiler or either
`decode_attention` returns None and callers keep SDPA.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("decode_attention.cpp")
HEAD_DIMS = (64, 128)  # what the kernel is compiled for


@lru_cache(maxsize=1)
def kernel():
    """The compiled extension (built once per source version and torch build, then loaded from disk)."""
    from headway.heads.kernels.panel import build_extension

    return build_extension("headway_decode_attention", SOURCE)


@lru_cache(maxsize=1)
def available() -> bool:
    from headway.heads.kernels.panel import kernel_isa

    if kernel_isa() is None:
        return False
    try:
        kernel()
    except Exception:  # no compiler, no headers, a failed build: SDPA it is
        return False
    return True


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float) -> Tensor | None:
    """query [B, H, 1, D], key/value [B, Hkv, T, D] (H a multiple of Hkv), mask None or bool [B, 1, 1, >= T]
    (True: attend) -> [B, 1, H, D] (transformers' attention output), or None where the kernel does not apply
    (not a CPU decode step, another dtype or head size, a float mask, no kernel on this machine)."""
    B, H, Q, D = query.shape
    Hkv, T = key.shape[1], key.shape[2]
    if (Q != 1 or H % Hkv or D not in HEAD_DIMS or query.device.type != "cpu" or query.dtype not in
            (torch.bfloat16, torch.float32) or key.dtype != query.dtype or value.dtype != query.dtype
            or key.stride(-1) != 1 or key.stride(-2) != D or value.stride(-1) != 1 or value.stride(-2) != D
            or (mask is not None and (mask.dtype != torch.bool or mask.shape[0] != B or mask.shape[2] != 1))
            or not available()):
        return None
    grouped = query.reshape(B, Hkv, H // Hkv, D).contiguous()  # [B, Hkv, G, D]: a key head's queries together
    flat_mask = None if mask is None else mask[:, 0, 0, :T].contiguous()  # [B, T]
    out = kernel().decode_attention(grouped, key, value, flat_mask, float(scale))  # [B, Hkv, G, D]
    return out.reshape(B, 1, H, D)
