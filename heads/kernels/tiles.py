"""The "tiles" weight layout: a GGUF target's Linears multiply a few rows with Intel AMX, reading the codes.

The `blocks` layout (heads/kernels/blocks.py) reads each Linear's Q4_1/Q8_0 codes and rebuilds the fp32 weights in AVX-512
registers: a decode step streams ~1.25 bytes per weight, but every row of a tree costs its own fp32 multiply-adds,
so 16 rows cost ~1.7-1.9x a decode step's Linear time. AMX (Sapphire Rapids and later) multiplies 16 rows by 16 columns
by 32 k in one instruction. tiles_linear.cpp feeds it the codes themselves (small integers, exact in bf16) and x
split into three bf16 parts (x = x0 + x1 + x2 exactly), so every product is exact and only the fp32 sums round,
as in any fp32 kernel; each GGUF block's scale and offset are applied in fp32 afterwards. The result is x . W up to
the order of the fp32 sums (within the same bound as F.linear, tests/infer/test_tiles.py), rows are independent of
each other, and one kernel serves every row count 1..MAX_ROWS (a decode step and a tree run the same arithmetic).

    use_tiles(linear, blocks)   # linear.forward through the kernel for 1..MAX_ROWS rows; the Linear's codes
                                # (blocks.BlockWeights) are rearranged into AMX's tile order once (tile_weights)

Needs AMX (the CPU's amx_bf16 and amx_tile, and a Linux kernel that grants the tile state), AVX-512 and a C++
compiler, and a target loaded from a block-quantized GGUF file; elsewhere the layout is not offered. Each Linear
keeps one more copy of its codes (~1.25 bytes per weight: SmolLM2-135M ~170 MB).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from headway.heads.kernels import blocks as blocks_kernel
from headway.heads.kernels.gemm import many_rows_linear
from headway.heads.kernels.panel import build_extension, from_panels, kernel_tag

SOURCE = Path(__file__).with_name("tiles_linear.cpp")
GROUP, BLOCK = 16, 32  # output columns per tile; k per tile product (one GGUF block)
MAX_ROWS = 128  # passes of 16 rows: a tree, a batch of trees, a decoding batch; above, the stock GEMM
FLAGS = ("-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-ffp-contract=off")


@dataclass
class TileWeights:
    """One Linear's GGUF codes in AMX tile order: W[n, k] = scales[n, k // 32] * codes[n, k] + offsets[n, k // 32]."""

    codes: torch.Tensor  # [G, K/32, 16, 16, 2] int8: group g's block b as a pair-interleaved B tile
    scales: torch.Tensor  # [G, K/32, 16] fp32
    offsets: torch.Tensor  # [G, K/32, 16] fp32
    small_codes: bool  # every code in 0..15 (Q4_1): read through a 16-entry table
    with_offsets: bool  # any offset non-zero (Q4_1; Q8_0 has none)
    stamp: tuple[int, int]  # (data_ptr, _version) of the fp32 weight they equal


def unavailable_reason(model: nn.Module | None = None) -> str | None:
    """None when the layout can run here (for `model`: loaded from a GGUF file), else why not (one line)."""
    if not torch.cpu._is_amx_tile_supported():
        return "needs a CPU with AMX tiles (Intel Sapphire Rapids or later)"
    why = blocks_kernel.unavailable_reason(model)
    if why is not None:
        return why
    try:
        ready = kernel().available()
    except Exception as exc:  # no compiler or an old one without AMX intrinsics: the layout is just not offered
        return f"could not build its kernel ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None if ready else "the operating system did not grant this process AMX tile state"


@lru_cache(maxsize=1)
def kernel():
    """The compiled extension (built once per source version and torch build, then loaded from disk)."""
    return build_extension("headway_tiles", SOURCE, FLAGS)


@lru_cache(maxsize=1)
def source_tag() -> str:
    return kernel_tag(SOURCE)


def to_tile_order(t: torch.Tensor, N: int) -> torch.Tensor:
    """[N, K] codes -> [G, K/32, 16, 16, 2] (B tiles: k pairs x columns x pair); [N, K/32] -> [G, K/32, 16]."""
    G = -(-N // GROUP)
    padded = t.new_zeros(G * GROUP, *t.shape[1:])
    padded[:N] = t
    if t.dtype == torch.int8:
        K = t.shape[1]
        return padded.view(G, GROUP, K // BLOCK, BLOCK // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
    return padded.view(G, GROUP, -1).permute(0, 2, 1).contiguous()


def tile_weights(blocks: blocks_kernel.BlockWeights, N: int) -> TileWeights:
    """The blocks layout's panels of one Linear (N outputs) rearranged for the AMX kernel."""
    codes, scales, offsets = (from_panels(t, N) for t in (blocks.codes, blocks.scales, blocks.offsets))
    return TileWeights(to_tile_order(codes, N), to_tile_order(scales, N), to_tile_order(offsets, N),
                       small_codes=bool(codes.min() >= 0 and codes.max() < 16), with_offsets=bool(offsets.any()),
                       stamp=blocks.stamp)


def tiles_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through the AMX kernel for 1..MAX_ROWS rows; many_rows_linear otherwise."""
    rows = x.numel() // linear.in_features
    tiles, weight = linear.tile_weights, linear.weight
    if (not 1 <= rows <= MAX_ROWS or torch.is_grad_enabled() or x.dtype != torch.float32
            or x.device.type != "cpu" or tiles.stamp != (weight.data_ptr(), weight._version)):
        # prefill (the faster many-row GEMM), training, or a weight changed since it was matched
        return many_rows_linear(x, weight, linear.bias)
    ext = kernel()
    parts, sums = ext.split_rows(x.reshape(rows, linear.in_features).contiguous())  # x's bf16 parts
    out = ext.tiles_linear(parts, sums, tiles.codes, tiles.scales, tiles.offsets, linear.out_features,
                           tiles.small_codes, tiles.with_offsets)  # [M, out]
    if linear.bias is not None:
        out += linear.bias
    return out.reshape(*x.shape[:-1], linear.out_features)


class TilesForward(blocks_kernel.BlocksForward):
    """linear.forward in the tiles layout; a head's draft read-out (`restricted`) still runs the blocks kernel."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return tiles_forward(self.linear, x)


def use_tiles(linear: nn.Linear, blocks: blocks_kernel.BlockWeights) -> None:
    """Route the layer through the AMX kernel (its tile-order codes made once, kept with its blocks)."""
    tiles = getattr(blocks, "tiles", None)
    if tiles is None:
        tiles = blocks.tiles = tile_weights(blocks, linear.out_features)
    tiles.stamp = blocks.stamp  # the blocks were just checked equal to the weight (blocks.model_blocks)
    blocks_kernel.use_blocks(linear, blocks)  # keeps the blocks for a head's draft read-out (blocks.RowSubset)
    linear.tile_weights = tiles
    linear.forward = TilesForward(linear)


def uses_tiles(linear: nn.Linear) -> bool:
    return isinstance(vars(linear).get("forward"), TilesForward)
