"""Muon whose Newton-Schulz orthogonalisation runs in a dtype the hardware multiplies fast.

torch.optim.Muon orthogonalises every update in bf16. GPUs and CPUs with AMX or AVX512-BF16 multiply bf16 in
hardware; other CPUs (AVX2, or AVX-512 without BF16) emulate it, and there EAGLE-3's training step took 12x as long
as with the same iterations in fp32 (docs/benchmarks.md, `python scripts/bench_train.py --muon`). On those CPUs this
optimizer runs the iterations in fp32, which is also closer to the exact orthogonal factor; elsewhere it is
torch.optim.Muon unchanged.
"""

from __future__ import annotations

import math

import torch

from headway.heads.kernels.machine_choice import cpu_multiplies_bf16


def orthogonalisation_dtype(device: torch.device) -> torch.dtype:
    """bf16 where it is multiplied in hardware (torch.optim.Muon's choice), fp32 where it would be emulated."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if device.type != "cpu" or cpu_multiplies_bf16() else torch.float32


def orthogonalise(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon (Jordan et al. 2024) in `dtype`: maps the
    [A, B] update to roughly U V^T of its SVD. Works on the wide side (rows <= columns), whose Gram matrix
    X X^T is the smaller one."""
    a, b, c = coefficients
    x = update.to(dtype)  # [A, B]
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T  # [r, s], r <= s
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T  # [r, r]
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's lr per matrix: "match_rms_adamw" scales the update to AdamW's RMS (0.2 sqrt(max(A, B)))
    so AdamW's lr and weight decay carry over; "original" (or None) is Keller Jordan's sqrt(max(1, A / B))."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Muon):
    """torch.optim.Muon with the orthogonalisation in `orthogonalise_in` (None, the default: what the parameters'
    device multiplies fast, decided at the first step, as the job moves the head to its device after building this).
    State and param groups are torch.optim.Muon's, so checkpoints load into either."""

    def __init__(self, params, *, orthogonalise_in: torch.dtype | None = None, **kwargs):
        super().__init__(params, **kwargs)
        # an attribute, not a group key: a resumed run's param groups are replaced by the checkpoint's
        self.orthogonalise_in = orthogonalise_in

    def iteration_dtype(self) -> torch.dtype:
        if self.orthogonalise_in is None:  # once: the parameters stay on their device from the first step on
            self.orthogonalise_in = orthogonalisation_dtype(self.param_groups[0]["params"][0].device)
        return self.orthogonalise_in

    @torch.no_grad()
    def step(self, closure=None):
        dtype = self.iteration_dtype()
        if dtype == torch.bfloat16:
            return super().step(closure)  # exactly torch.optim.Muon
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                self._update(p, group, dtype)
        return loss

    def _update(self, p: torch.Tensor, group: dict, dtype: torch.dtype) -> None:
        """One parameter's step, as torch.optim.Muon takes it: Nesterov momentum, orthogonalise, decoupled weight
        decay, the lr adjusted to the matrix's shape."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)
        update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
        update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
        lr = float(group["lr"])
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
