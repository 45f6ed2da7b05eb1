"""Where and how the target's Linear weights lie in memory for decoding on a CPU.

A decode step is one GEMV per Linear (M = 1 row of activations) and reads every weight once, so its speed
is the kernel's memory bandwidth; verifying a tree of N tokens is one GEMM per Linear with M = N rows,
which should cost about the same (the weights are read once either way) but with the stock kernels does
not: MKL's GEMM at small M runs far below both the memory and the compute limit. Measured on this
project's reference CPU (2 cores, AVX-512, fp32; every Linear of SmolLM2-135M in sequence, best of 5):

    rows M                       1      2      4      8     16
    stock (row-major W)       22.3   24.6   39.4   49.8   51.3 ms
    wide-column               21.0   29.6   38.5   52.5   65.1
    packed (MKL packed GEMM)  24.4   25.5   26.4   34.9   42.9
    oneDNN packed             35.9   31.1   33.0   38.3   48.2
    inductor max-autotune     22.2      -      -   40.3      -    (torch.compile, freezing, C++ GEMM
                                                                   template; ~1 min compile per shape)
    panel (heads/kernels/panel.py)    20.8   22.1   24.3   27.7   35.9
    blocks (heads/kernels/blocks.py)  11.7   12.0   12.4   14.5   22.1    (a GGUF target's codes; the real weights,
                                                                   scripts/bench_layouts.py)
    blocks, another day       14.8   15.1   15.9   17.5   25.7    (the same run as the next row)
    tiles (heads/kernels/tiles.py)    14.3   14.4   14.4   16.1   19.6    (the codes multiplied with AMX)

The panel and blocks kernels are also built for AVX2 with FMA on CPUs without AVX-512 (heads/kernels/simd.h); on
a 2-core AMD EPYC of the Zen 3 generation (AVX2, 6 December 2026, scripts/bench_layouts.py --rows 1 2 4 8 16):
stock 40.7 70.6 72.8 75.8 88.5, panel 27.2 27.0 28.0 34.9 53.1, blocks 11.3 11.8 16.8 22.8 37.0 ms.

The layouts (same values, same modules, same transformers code; only how F.linear reaches the weights):
  stock        as loaded (row-major [out, in])
  wide-column  Linear weights with out_features > in_features stored column-major (W^T contiguous):
               a contiguous-B GEMM, faster GEMV on some machines
  packed       every Linear keeps its stock weight for M <= 2 rows and, for 3..64 rows, multiplies by a
               copy packed for MKL's GEMM (torch.ops.mkl._mkl_linear), made once per row bucket (4, 8,
               16, 32, 64; rows are zero-padded up to the bucket) the first time the bucket is used:
               each bucket used costs one more copy of the weights in memory and ~0.1-1 s to pack
  panel        every Linear runs 2..32 rows through a small AVX-512 or AVX2 kernel over a copy of its weight
               laid out as 48-column panels, streamed once per call whatever the row count, and one
               row through the kernel or the stock GEMV, whichever this machine runs faster (measured once)
               (heads/kernels/panel.py; compiled on first use, one more copy of the weights in memory)
  blocks       a target loaded from a block-quantized GGUF file: every Linear whose fp32 weight is exactly
               one of the file's Q4_1/Q8_0 tensors runs 1..32 rows through a kernel that reads the codes
               (1.25 bytes per weight) and rebuilds the same fp32 values in registers (heads/kernels/blocks.py);
               the other Linears as in panel
  tiles        the same Linears on a CPU with AMX (Intel Sapphire Rapids or later): 1..128 rows through a kernel
               that multiplies the codes themselves with AMX tile products, x split into three bf16 parts that
               add up to it exactly, so every product is exact and only fp32 sums round (heads/kernels/tiles.py);
               16 rows cost ~1.4 rows' time instead of ~1.7; the other Linears as in panel
               panel, blocks and tiles also run masked grouped-query attention without per-head copies
               (heads/kernels/attention.py); the other layouts keep the model's own attention; the rows their kernels
               do not take go through the machine's faster many-row GEMM, MKL or oneDNN (heads/kernels/gemm.py)
  auto         on a CPU, the layout with the least T(1) + T(8) + T(16) (a decode step, a typical and a large tree),
               measured once per target, threads and dtype while the machine is quiet (heads.kernels.quiet), and
               cached beside the T(N) curve; stock elsewhere (cuBLAS reads every layout at full speed)

    layout = apply_layout(model, "auto")     # what the engine does
    with stock_layout(model):                # what a transformers user runs (the HF generate() baseline)
        model.generate(...)

Outputs equal the stock forward within fp32 rounding (a different summation order), as any change of
kernel does; the engine's greedy speculative output equals its plain decoding under the same layout.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from headway.heads.files import write_json_atomic
from headway.heads.kernels import blocks as blocks_kernel
from headway.heads.kernels.attention import use_grouped_attention
from headway.heads.kernels import panel as panel_kernel
from headway.heads.kernels import tiles as tiles_kernel
from headway.heads.kernels.measurements import measurement_path
from headway.heads.kernels.quiet import measure_until_quiet, watch

LAYOUTS = ("auto", "stock", "wide-column", "packed", "panel", "blocks", "tiles")
MIN_GAIN = 1.03  # auto leaves the stock layout only for a score at least 3% better (timings are noisy)
PACK_BUCKETS = (4, 8, 16, 32, 64)  # row counts with a packed copy; fewer rows than 3 run the stock GEMV
MIN_PACKED_ROWS = 3
SCORE_ROWS = (1, 8, 16)  # auto's score: T(1) + T(8) + T(16), a decode step, a typical and a large tree
SCORE = " + ".join(f"T({m})" for m in SCORE_ROWS)
# these also run masked grouped-query attention without copies (heads.kernels.attention)
SMALL_M_KERNELS = ("panel", "blocks", "tiles")
CHOICE_VERSION = 6  # cached choices from before the tiles layout existed are measured again


def candidates(model: nn.Module) -> tuple[str, ...]:
    """The layouts this model can run here (packed needs MKL, panel AVX-512 or AVX2 and a C++ compiler, blocks those
    and a model loaded from a block-quantized GGUF file; all fp32 weights on a CPU)."""
    param = next(model.parameters())
    fp32_cpu = param.device.type == "cpu" and param.dtype == torch.float32
    packed = ("packed",) if fp32_cpu and torch.backends.mkl.is_available() else ()
    panel = ("panel",) if fp32_cpu and panel_kernel.unavailable_reason() is None else ()
    blocks = ("blocks",) if panel and blocks_kernel.unavailable_reason(model) is None and _blocks(model) else ()
    tiles = ("tiles",) if blocks and tiles_kernel.unavailable_reason(model) is None else ()
    return ("stock", "wide-column") + packed + panel + blocks + tiles


def wide_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers with more outputs than inputs (tied weights appear once)."""
    return [linear for linear in _linears(model) if linear.out_features > linear.in_features]


def apply_layout(model: nn.Module, layout: str = "auto", target=None) -> str:
    """Put the model's Linear layers in `layout` (in place; values unchanged); return the layout used.
    `target` (a heads.target.Target; default: the model) names the cached choice of "auto"."""
    check_layout(layout)
    if layout == "auto":
        layout = choose_layout(target if target is not None else model)
    if layout == "packed" and layout not in candidates(model):
        raise ValueError("weight_layout=packed needs fp32 weights on a CPU with MKL; use stock or wide-column")
    if layout == "panel" and layout not in candidates(model):
        why = panel_kernel.unavailable_reason() or "the model is not fp32 on a CPU"
        raise ValueError(f"weight_layout=panel needs fp32 weights on a CPU with AVX-512 or AVX2 and a C++ compiler "
                         f"({why}); use stock or packed")
    if layout == "blocks" and layout not in candidates(model):
        why = (panel_kernel.unavailable_reason() or blocks_kernel.unavailable_reason(model)
               or "no Linear weight equals a Q4_1/Q8_0 tensor of its GGUF file, or the model is not fp32 on a CPU")
        raise ValueError(f"weight_layout=blocks needs a target loaded from a block-quantized GGUF file, fp32 "
                         f"on a CPU with AVX-512 or AVX2 and a C++ compiler ({why}); use panel or stock")
    if layout == "tiles" and layout not in candidates(model):
        why = (panel_kernel.unavailable_reason() or tiles_kernel.unavailable_reason(model)
               or "no Linear weight equals a Q4_1/Q8_0 tensor of its GGUF file, or the model is not fp32 on a CPU")
        raise ValueError(f"weight_layout=tiles needs a target loaded from a block-quantized GGUF file, fp32 on a "
                         f"CPU with AMX and a C++ compiler ({why}); use blocks, panel or stock")
    for linear in _linears(model):
        _unpack(linear)
    for linear in wide_linears(model):
        weight = linear.weight.data  # [out, in]
        linear.weight.data = weight.t().contiguous().t() if layout == "wide-column" else weight.contiguous()
    if layout in ("packed",) + SMALL_M_KERNELS:
        _route(model, layout)
    use_grouped_attention(model, layout in SMALL_M_KERNELS)
    return layout


def _route(model: nn.Module, layout: str) -> None:
    """Every Linear's forward through `layout`'s kernel (blocks, tiles: the Linears without GGUF blocks use panels)."""
    blocks = _blocks(model) if layout in ("blocks", "tiles") else {}
    for linear in _linears(model):
        if layout == "packed":
            _pack(linear)
        elif linear in blocks and layout == "tiles":
            tiles_kernel.use_tiles(linear, blocks[linear])
        elif linear in blocks:
            blocks_kernel.use_blocks(linear, blocks[linear])
        else:
            panel_kernel.use_panels(linear)


def _blocks(model: nn.Module) -> dict:
    return blocks_kernel.model_blocks(model, _linears(model))


def measured_name(layout: str) -> str:
    """The name a layout's timings are cached under; panel's and blocks' name their kernel versions (and the
    attention they run), so the timings of an older kernel are measured again."""
    if layout == "blocks":  # "gqa": with heads.kernels.attention's grouped-query attention
        return f"blocks-{blocks_kernel.source_tag()}-{panel_kernel.source_tag()}-gqa"
    if layout == "tiles":
        return f"tiles-{tiles_kernel.source_tag()}-{panel_kernel.source_tag()}-gqa"
    return f"panel-{panel_kernel.source_tag()}-gqa" if layout == "panel" else layout


def layout_path(target) -> Path:
    """Where the layout "auto" chose for this target on this machine is cached."""
    return measurement_path(target, "layout")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"weight_layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def choose_layout(target, force: bool = False) -> str:
    """What "auto" means: stock off the CPU; on a CPU the layout with the least T(1) + T(8) + T(16), measured once
    per target, thread count and dtype, then read from the cache. A measurement disturbed by other
    processes is taken again (twice at most) and, if still disturbed, used for this run but not cached
    unless `force`."""
    model = getattr(target, "model", target)
    if next(model.parameters()).device.type != "cpu" or not _linears(model):
        return "stock"
    path = layout_path(target)
    cached = None if force else cached_choice(path, model)
    if cached is not None:
        return cached
    samples, quality = measure_until_quiet(lambda: measure_layouts(model),
                                           lambda result: (s for per in result.values() for s in per.values()), watch)
    times = {layout: {m: min(s) for m, s in per.items()} for layout, per in samples.items()}
    layout = pick(times)
    if force or not quality.noisy:
        write_json_atomic(path, {"version": CHOICE_VERSION, "layout": layout, "score": SCORE,
                                 "forward_s": {k: {str(m): t for m, t in v.items()} for k, v in times.items()},
                                 "quality": quality.as_dict()})
    else:
        print(f"warning: weight layout {layout} chosen from a disturbed measurement ({quality.describe()}); "
              f"not cached, measured again next time")
    return layout


def cached_choice(path: Path, model: nn.Module) -> str | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # missing or damaged: measure
    if not isinstance(record, dict) or record.get("version") != CHOICE_VERSION:
        return None
    layout = record.get("layout")
    return layout if layout in candidates(model) else None


def pick(times: dict[str, dict[int, float]]) -> str:
    """The layout with the least T(1) + T(8) + T(16); stock unless the best beats it by MIN_GAIN."""
    score = {layout: sum(per.values()) for layout, per in times.items()}
    best = min(score, key=score.get)
    return best if score["stock"] >= MIN_GAIN * score[best] else "stock"


@torch.inference_mode()
def measure_layouts(model: nn.Module, repeats: int = 5, rows=SCORE_ROWS) -> dict[str, dict[int, list[float]]]:
    """Seconds of one forward of each of `rows` tokens (no cache) under each candidate layout, `repeats`
    times; rounds interleave layouts so noise hits all alike. Leaves the model in the layout it found."""
    found = current_layout(model)
    linears, wide = _linears(model), wide_linears(model)
    stock = [linear.weight.data.contiguous() for linear in wide]
    column = [weight.t().contiguous().t() for weight in stock]
    device = next(model.parameters()).device
    ids = {m: torch.zeros(1, m, dtype=torch.long, device=device) for m in rows}
    times = {layout: {m: [] for m in rows} for layout in candidates(model)}

    def switch(layout):  # pointer swaps: no copy, and the packed copies stay valid
        for linear, weight in zip(wide, column if layout == "wide-column" else stock):
            linear.weight.data = weight
        for linear in linears:
            _unpack(linear)
        if layout in ("packed",) + SMALL_M_KERNELS:
            _route(model, layout)
        use_grouped_attention(model, layout in SMALL_M_KERNELS)

    try:
        for round_ in range(repeats + 1):  # the first round warms up (and packs the buckets used)
            for layout in times:
                switch(layout)
                for m in rows:
                    start = time.perf_counter()
                    model(input_ids=ids[m], use_cache=False)
                    if round_:
                        times[layout][m].append(time.perf_counter() - start)
    finally:
        switch("stock")
        apply_layout(model, found)
    return times


def current_layout(model: nn.Module) -> str:
    linears = _linears(model)
    if any(tiles_kernel.uses_tiles(linear) for linear in linears):
        return "tiles"
    if any(blocks_kernel.uses_blocks(linear) for linear in linears):
        return "blocks"
    if linears and all(_is_packed(linear) for linear in linears):
        return "packed"
    if linears and all(panel_kernel.uses_panels(linear) for linear in linears):
        return "panel"
    wide = wide_linears(model)
    if wide and all(_column_major(linear.weight) for linear in wide):
        return "wide-column"
    return "stock"


@contextmanager
def stock_layout(model: nn.Module):
    """Run a block with the weights as transformers loaded them; restore the previous layout after."""
    previous = current_layout(model)
    if previous != "stock":
        apply_layout(model, "stock")
    try:
        yield model
    finally:
        if previous != "stock":
            apply_layout(model, previous)


def packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through MKL's packed GEMM for 3..64 rows (zero rows pad up to the bucket; each
    output row depends on its own input row only). Autograd and other row counts take F.linear."""
    rows = x.numel() // self.in_features
    if rows < MIN_PACKED_ROWS or rows > PACK_BUCKETS[-1] or torch.is_grad_enabled() or x.dtype != self.weight.dtype:
        return F.linear(x, self.weight, self.bias)  # the decode step's GEMV: nothing more on its path
    bucket = _BUCKET_OF[rows]
    flat = x.reshape(rows, self.in_features)  # [M, in]
    if bucket > rows:
        flat = torch.cat([flat, flat.new_zeros(bucket - rows, self.in_features)])  # [bucket, in]
    packed = self.packed_weights.get(bucket)
    if packed is None:
        packed = self.packed_weights[bucket] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), bucket)
    out = torch.ops.mkl._mkl_linear(flat, packed, self.weight, self.bias, bucket)  # [bucket, out]
    return out[:rows].reshape(*x.shape[:-1], self.out_features)


_BUCKET_OF = [next((b for b in PACK_BUCKETS if b >= rows), 0) for rows in range(PACK_BUCKETS[-1] + 1)]


def pack_all(model: nn.Module, buckets=PACK_BUCKETS) -> float:
    """Pack every bucket of every Linear now (the packed layout otherwise packs a bucket on its first
    use); return the seconds it took."""
    start = time.perf_counter()
    for linear in _linears(model):
        _pack(linear)
        linear.packed_weights.clear()
        for bucket in buckets:
            linear.packed_weights[bucket] = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), bucket)
    return time.perf_counter() - start


class PackedForward:
    """linear.forward in the packed layout (a plain object, so that the model still deep-copies and
    pickles: the copy's forward is bound to the copy)."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return packed_forward(self.linear, x)


class Packs(dict):
    """bucket -> MKL-packed copy of one weight, made on first use. The copies are opaque MKL tensors: a
    deep copy of the model (or pickling it) starts with none and packs its own weights when used."""

    def __init__(self, weight_ptr: int):
        super().__init__()
        self.weight_ptr = weight_ptr  # the weight these copies were made from

    def __deepcopy__(self, memo):
        return Packs(-1)

    def __reduce__(self):
        return Packs, (-1,)


def _pack(linear: nn.Linear) -> None:
    """Route the layer through packed_forward. Packed copies outlive a switch to another layout (the HF
    baseline runs stock between engine steps) unless the weight itself was replaced."""
    if getattr(linear, "packed_weights", None) is None or linear.packed_weights.weight_ptr != linear.weight.data_ptr():
        linear.packed_weights = Packs(linear.weight.data_ptr())
    linear.forward = PackedForward(linear)


def _unpack(linear: nn.Linear) -> None:
    if "forward" in vars(linear):
        del linear.forward  # back to nn.Linear.forward


def _is_packed(linear: nn.Linear) -> bool:
    return isinstance(vars(linear).get("forward"), PackedForward)


def _linears(model: nn.Module) -> list[nn.Linear]:
    """Every Linear layer once (tied weights appear once)."""
    seen, out = set(), []
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out.append(module)
    return out


def _column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])
