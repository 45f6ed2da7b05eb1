"""Where the target's Linear weights lie in memory for decoding on a CPU.

A decode step is one GEMV per Linear (M = 1 row of activations) and reads every weight once, so its speed
is the BLAS kernel's memory bandwidth. nn.Linear stores W as [out, in] row-major and computes x @ W^T;
MKL's kernel for that case streams wide matrices (out > in: the MLP's gate/up projections, the LM head) at
~9 GB/s on this machine, while the same product over W stored column-major (W^T contiguous, [in, out]) runs
at ~14-21 GB/s. Same shapes, same values, same modules, same transformers code: only the strides change,
so `F.linear(x, weight)` becomes a contiguous-B GEMM. Measured on SmolLM2-135M (2-core CPU, fp32): one
decode step 61 -> 49 ms on a loaded machine (a quiet re-run found the engine's plain decoding at 0.98x HF
generate(), i.e. no gain: measure on your machine, as `auto` does); a forward of 4-32 tokens (a tree)
5-10% slower, which the engine's measured T(N) curve (infer.calibrate) accounts for, since it is measured
under the layout the engine runs.

    layout = apply_layout(model, "auto")     # what the engine does
    with stock_layout(model):                # what a transformers user runs (the HF generate() baseline)
        model.generate(...)

Layouts:  stock        as loaded (row-major)
          wide-column  Linear weights with out_features > in_features stored column-major
          auto         on a CPU, whichever of the two runs a decode step faster on this machine (measured
                       once, ~1 s, and cached beside the T(N) curve; `python -m headway.infer.calibrate` prints
                       both times); stock elsewhere (cuBLAS reads both layouts at full speed)
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from headway.heads.files import write_json_atomic
from headway.infer.measurements import measurement_path

LAYOUTS = ("auto", "stock", "wide-column")
CANDIDATES = ("stock", "wide-column")
MIN_GAIN = 1.03  # auto moves the weights only for a decode step at least 3% faster (timings are noisy)


def wide_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers with more outputs than inputs (tied weights appear once)."""
    seen, out = set(), []
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features > module.in_features:
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                out.append(module)
    return out


def apply_layout(model: nn.Module, layout: str = "auto", target=None) -> str:
    """Store the model's wide Linear weights in `layout` (in place; values unchanged); return the layout
    used. `target` (a heads.target.Target; default: the model) names the cached choice of "auto"."""
    check_layout(layout)
    if layout == "auto":
        layout = choose_layout(target if target is not None else model)
    for linear in wide_linears(model):
        weight = linear.weight.data  # [out, in]
        linear.weight.data = weight.t().contiguous().t() if layout == "wide-column" else weight.contiguous()
    return layout


def layout_path(target) -> Path:
    """Where the layout "auto" chose for this target on this machine is cached."""
    return measurement_path(target, "layout")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"weight_layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def choose_layout(target) -> str:
    """What "auto" means: stock off the CPU; on a CPU the layout with the faster decode step, measured once
    per target, thread count and dtype, then read from the cache."""
    model = getattr(target, "model", target)
    if next(model.parameters()).device.type != "cpu" or not wide_linears(model):
        return "stock"
    path = layout_path(target)
    try:
        layout = json.loads(path.read_text())["layout"]
        if layout in CANDIDATES:
            return layout
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        pass  # missing or damaged: measure
    times = measure_layouts(model)
    layout = "wide-column" if times["stock"] >= MIN_GAIN * times["wide-column"] else "stock"
    write_json_atomic(path, {"layout": layout, "decode_step_s": times})
    return layout


@torch.inference_mode()
def measure_layouts(model: nn.Module, repeats: int = 5) -> dict[str, float]:
    """Seconds of one decode-like forward (one token: every Linear is an M = 1 GEMV) under each candidate
    layout, best of `repeats`, rounds interleaved so noise hits both alike. Leaves the layout it found."""
    wide = wide_linears(model)
    found = [linear.weight.data for linear in wide]
    stored = {"stock": [w.contiguous() for w in found], "wide-column": [w.t().contiguous().t() for w in found]}
    ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    times = {layout: float("inf") for layout in CANDIDATES}
    try:
        for _ in range(repeats + 1):  # the first round warms up
            for layout in CANDIDATES:
                for linear, weight in zip(wide, stored[layout]):
                    linear.weight.data = weight  # a pointer swap, no copy
                start = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                times[layout] = min(times[layout], time.perf_counter() - start)
    finally:
        for linear, weight in zip(wide, found):
            linear.weight.data = weight
    return times


def current_layout(model: nn.Module) -> str:
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


def _column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])
