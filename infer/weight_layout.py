"""Where the target's Linear weights lie in memory for decoding on a CPU.

A decode step is one GEMV per Linear (M = 1 row of activations) and reads every weight once, so its speed
is the BLAS kernel's memory bandwidth. nn.Linear stores W as [out, in] row-major and computes x @ W^T;
MKL's kernel for that case streams wide matrices (out > in: the MLP's gate/up projections, the LM head) at
~9 GB/s on this machine, while the same product over W stored column-major (W^T contiguous, [in, out]) runs
at ~16-21 GB/s. Same shapes, same values, same modules, same transformers code: only the strides change,
so `F.linear(x, weight)` becomes a contiguous-B GEMM. Measured on SmolLM2-135M (2-core CPU, fp32): one
decode step 61 -> 49 ms; a forward of 4-32 tokens (a tree) 5-10% slower, which the engine's measured
T(N) curve (infer.calibrate) accounts for, since it is measured under the layout the engine runs.

    layout = apply_layout(model, "auto")     # the engine does this: "wide-column" on CPU, else "stock"
    with stock_layout(model):                # what a transformers user runs (the HF generate() baseline)
        model.generate(...)

Layouts:  stock        as loaded (row-major)
          wide-column  Linear weights with out_features > in_features stored column-major
          auto         wide-column on a CPU, stock elsewhere (cuBLAS reads both layouts at full speed)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

LAYOUTS = ("auto", "stock", "wide-column")


def wide_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers with more outputs than inputs (tied weights appear once)."""
    seen, out = set(), []
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features > module.in_features:
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                out.append(module)
    return out


def resolve(layout: str, device: torch.device) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"weight_layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "auto":
        return "wide-column" if device.type == "cpu" else "stock"
    return layout


def apply_layout(model: nn.Module, layout: str = "auto") -> str:
    """Store the model's Linear weights in `layout` (in place; values unchanged); return the layout used."""
    layout = resolve(layout, next(model.parameters()).device)
    for linear in wide_linears(model):
        weight = linear.weight.data  # [out, in]
        linear.weight.data = weight.t().contiguous().t() if layout == "wide-column" else weight.contiguous()
    return layout


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
