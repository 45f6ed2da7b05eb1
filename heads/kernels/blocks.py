"""The "blocks" weight layout: Linears read their weights from the target's own block-quantized GGUF encoding.

A GGUF target (the embedded SmolLM2-135M is Q4_1 with a Q8_0 embedding) is dequantized by transformers to
fp32 on load, which quadruples the bytes every decode step streams from memory. Each of those fp32 weights
is exactly d * q + m for a per-32-element scale d, offset m (0 for Q8_0) and small integer code q, so the
same values can be read from ~1.25 bytes per weight instead of 4 and rebuilt in registers
(blocks_linear.cpp: the exact product d * q, then the sum rounded once, as the dequantizer computes it). The result is
the stock forward up to the order of the fp32 sums, as with any kernel: lossless, not a quantized model.

    blocks = model_blocks(model, linears)  # {linear: BlockWeights} for every Linear whose fp32 weight
                                           # is exactly a GGUF tensor of the file the model came from
    use_blocks(linear, blocks[linear])

Matching is by value, not by name: each GGUF tensor's dequantized rows are fingerprinted and every Linear
looks its rows up (transformers reorders the rows of q_proj/k_proj for its rotary convention); a Linear is
used only when all its rows equal a GGUF tensor's rows bit for bit. 1..MAX_ROWS rows (a decode step, a tree)
run through the kernel; prefill and decoding batches take the machine's faster many-row GEMM (heads/kernels/gemm.py),
autograd and a weight changed since the stock F.linear. Models not
loaded from a GGUF file, or without a compiler or AVX-512 or AVX2, simply do not offer the layout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from headway.heads.kernels.gemm import many_rows_linear
from headway.heads.kernels.panel import build_extension, from_panels, isa_problem, kernel_tag, to_panels

SOURCE = Path(__file__).with_name("blocks_linear.cpp")
BLOCK = 32  # weights per scale (GGUF's Q4_1 and Q8_0 block size)
MAX_ROWS = 32  # above this the stock GEMM (compute-bound prefill) wins
SOURCE_ATTR = "gguf_source"  # the model attribute naming the GGUF file it was loaded from (heads.target)
log = logging.getLogger(__name__)


@dataclass
class BlockWeights:
    """One Linear's weight as panels of codes: W[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]."""

    codes: torch.Tensor  # [P, K, 48] int8
    scales: torch.Tensor  # [P, K/32, 48] fp32
    offsets: torch.Tensor  # [P, K/32, 48] fp32
    stamp: tuple[int, int]  # (data_ptr, _version) of the fp32 weight they equal

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))


# ------------------------------------------------------------------------------------------- kernel

def unavailable_reason(model: nn.Module | None = None) -> str | None:
    """None when the layout can run here (for `model`: loaded from a GGUF file), else why not (one line)."""
    if problem := isa_problem():
        return problem
    if model is not None and gguf_source(model) is None:
        return "the target was not loaded from a GGUF file"
    try:
        kernel()
    except Exception as exc:  # no compiler, no headers, a failed build: the layout is just not offered
        return f"could not build its kernel ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


@lru_cache(maxsize=1)
def kernel():
    """The compiled extension (built once per source version and torch build, then loaded from disk)."""
    return build_extension("headway_blocks", SOURCE, ("-ffp-contract=off",))


@lru_cache(maxsize=1)
def source_tag() -> str:
    return kernel_tag(SOURCE)


# ------------------------------------------------------------------------------------ GGUF blocks

def gguf_source(model: nn.Module) -> Path | None:
    path = getattr(model, SOURCE_ATTR, None)
    return Path(path) if path and Path(path).is_file() else None


def decode_tensor(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(codes [N, K] int8, scales [N, K/32] fp32, offsets [N, K/32] fp32) of a Q4_1 or Q8_0 GGUF tensor
    (gguf.ReaderTensor), None for other types. Byte layouts as ggml stores them: Q4_1 blocks are
    (f16 d, f16 m, 16 bytes: code j in the low nibble of byte j, code j + 16 in its high nibble), Q8_0 blocks
    (f16 d, 32 int8 codes)."""
    kind = tensor.tensor_type.name
    if kind not in ("Q4_1", "Q8_0") or len(tensor.shape) != 2:
        return None
    rows = np.asarray(tensor.data)  # [N, bytes per row] uint8
    N = rows.shape[0]
    size = 20 if kind == "Q4_1" else 34
    blocks = rows.reshape(N, -1, size)  # [N, K/32, size]
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]  # [N, K/32, 16]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)  # [N, K/32, 32]
    else:
        offsets = np.zeros_like(scales)
        codes = blocks[..., 2:].copy().view(np.int8)
    return codes.reshape(N, -1), scales, offsets


def dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 as the GGUF dequantizer computes it: (d * q) + m in fp32."""
    return scales.repeat_interleave(BLOCK, dim=1) * codes.float() + offsets.repeat_interleave(BLOCK, dim=1)


def row_keys(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> [N] int64 fingerprints of the rows' bits (equal rows, equal keys)."""
    bits = weight.contiguous().view(torch.int32).long()  # [N, K]
    mix = torch.randint(-2**31, 2**31, (weight.shape[1],), generator=torch.Generator().manual_seed(0))
    return (bits * mix).sum(1)


def find_blocks(model: nn.Module, linears: list[nn.Linear]) -> dict[nn.Linear, BlockWeights]:
    """Every one of `linears` (the model's) whose fp32 weight equals (bit for bit, rows in any order) a Q4_1/Q8_0 tensor
    of the GGUF file it was loaded from, with that tensor's codes as panels."""
    path = gguf_source(model)
    if path is None:
        return {}
    from gguf import GGUFReader

    try:
        tensors = [t for t in GGUFReader(str(path)).tensors if t.tensor_type.name in ("Q4_1", "Q8_0")]
    except (OSError, ValueError) as exc:  # replaced or damaged since the model was loaded: no blocks, no crash
        log.warning("blocks layout unavailable: cannot read %s (%s)", path, str(exc).splitlines()[0] if str(exc) else exc)
        return {}
    owner: dict[int, int] = {}  # row key -> index of the GGUF tensor holding that row
    for i, tensor in enumerate(tensors):
        decoded = decode_tensor(tensor)
        if decoded is not None:
            for key in row_keys(dequantize(*map(torch.from_numpy, decoded))).tolist():
                owner.setdefault(key, i)
    found = {}
    for linear in linears:
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % BLOCK:
            continue
        keys = row_keys(weight)
        index = owner.get(int(keys[0]))
        if index is None:
            continue
        blocks = match(weight, keys, decode_tensor(tensors[index]))
        if blocks is not None:
            found[linear] = blocks
    return found


def match(weight: torch.Tensor, keys: torch.Tensor, decoded) -> BlockWeights | None:
    """The tensor's codes with rows reordered to the weight's, if every row is equal bit for bit."""
    codes, scales, offsets = (torch.from_numpy(a) for a in decoded)
    if codes.shape != weight.shape:
        return None
    theirs = row_keys(dequantize(codes, scales, offsets))  # [N]
    order = theirs.argsort()
    at = torch.searchsorted(theirs[order], keys).clamp(max=len(order) - 1)
    rows = order[at]  # [N] the GGUF row of each weight row
    codes, scales, offsets = codes[rows], scales[rows], offsets[rows]
    if not torch.equal(dequantize(codes, scales, offsets), weight):
        return None
    return BlockWeights(to_panels(codes), to_panels(scales), to_panels(offsets),
                        (weight.data_ptr(), weight._version))


# ------------------------------------------------------------------------------------------ forward

def blocks_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through the blocks kernel for 1..MAX_ROWS rows; many_rows_linear otherwise."""
    rows = x.numel() // linear.in_features
    blocks = linear.block_weights
    weight = linear.weight
    if (not 1 <= rows <= MAX_ROWS or torch.is_grad_enabled() or x.dtype != torch.float32
            or x.device.type != "cpu" or blocks.stamp != (weight.data_ptr(), weight._version)):
        # prefill or a decoding batch (the faster many-row GEMM), training, or a weight changed since it was matched
        return many_rows_linear(x, weight, linear.bias)
    flat = x.reshape(rows, linear.in_features).contiguous()  # [M, in]
    out = kernel().blocks_linear(flat, blocks.codes, blocks.scales, blocks.offsets, linear.out_features)
    if linear.bias is not None:
        out += linear.bias
    return out.reshape(*x.shape[:-1], linear.out_features)  # [..., out]


class BlocksForward:
    """linear.forward in the blocks layout (a plain object: the model still deep-copies and pickles)."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return blocks_forward(self.linear, x)

    def restricted(self, rows: torch.Tensor) -> "RowSubset":
        """The layer restricted to output rows `rows` [R] (a head's draft vocabulary of the read-out)."""
        return RowSubset(self.linear, rows)


class RowSubset:
    """x -> x @ W[rows].T through the blocks kernel on those rows' codes; F.linear on the fp32 rows where the
    kernel does not apply (more rows than MAX_ROWS, autograd, a changed weight), via many_rows_linear."""

    def __init__(self, linear: nn.Linear, rows: torch.Tensor):
        self.linear, self.rows = linear, rows
        blocks, N = linear.block_weights, linear.out_features
        codes, scales, offsets = (from_panels(t, N)[rows] for t in (blocks.codes, blocks.scales, blocks.offsets))
        self.blocks = BlockWeights(to_panels(codes), to_panels(scales), to_panels(offsets), blocks.stamp)
        self.weight = linear.weight.detach()[rows].contiguous()  # [R, in] the fallback

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., R]
        n = x.numel() // self.linear.in_features
        weight = self.linear.weight
        if (not 1 <= n <= MAX_ROWS or torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
                or self.blocks.stamp != (weight.data_ptr(), weight._version)):
            return many_rows_linear(x, self.weight, None)
        flat = x.reshape(n, self.linear.in_features).contiguous()
        out = kernel().blocks_linear(flat, self.blocks.codes, self.blocks.scales, self.blocks.offsets, len(self.rows))
        return out.reshape(*x.shape[:-1], len(self.rows))


def use_blocks(linear: nn.Linear, blocks: BlockWeights) -> None:
    linear.block_weights = blocks
    linear.forward = BlocksForward(linear)
    for copy in ("panels", "panel_stamp"):  # a panel layout's fp32 copy, if one was made: not needed now
        vars(linear).pop(copy, None)


def uses_blocks(linear: nn.Linear) -> bool:
    return isinstance(vars(linear).get("forward"), BlocksForward)


def model_blocks(model: nn.Module, linears: list[nn.Linear]) -> dict[nn.Linear, BlockWeights]:
    """find_blocks(model, linears), computed once per model (a few seconds: the GGUF file is read and matched) and
    kept on it; matches whose weight has since changed are dropped."""
    cached = getattr(model, "_block_weights", None)
    if cached is None:
        start = time.perf_counter()
        cached = find_blocks(model, linears)
        model._block_weights = cached  # a plain dict attribute: not a submodule or parameter
        model._block_seconds = time.perf_counter() - start
    return {linear: b for linear, b in cached.items() if still_equal(linear, b)}


def still_equal(linear: nn.Linear, blocks: BlockWeights) -> bool:
    """Whether the blocks still equal the layer's weight; a weight moved to new storage with the same values
    (another layout stored it column-major and back) is compared again and, if equal, stamped anew."""
    weight = linear.weight
    stamp = (weight.data_ptr(), weight._version)
    if blocks.stamp == stamp:
        return True
    N = linear.out_features
    rebuilt = dequantize(*(from_panels(t, N) for t in (blocks.codes, blocks.scales, blocks.offsets)))
    if not torch.equal(rebuilt, weight.detach()):
        return False
    blocks.stamp = stamp
    return True



