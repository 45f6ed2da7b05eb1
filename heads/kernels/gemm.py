"""Many-row fp32 Linear on a CPU: MKL's GEMM or oneDNN's, whichever this machine runs faster.

PyTorch hands an fp32 F.linear to MKL. MKL picks its code path by CPU vendor, and on AMD CPUs it leaves
AVX-512 unused: on a 2-core AMD EPYC (Zen 5), 2 threads, every Linear of SmolLM2-135M at 128-512 rows ran at
153-172 GFLOP/s under MKL and 324-357 under oneDNN (scripts/bench_gemm.py; docs/inference.md). oneDNN
chooses by instruction set, not vendor. On the Intel CPUs measured, MKL is
as fast or faster. So the CPU weight layouts (panel, blocks, tiles) send the rows their own kernels do not
take (a prefill, a decoding batch of data generation, the hidden-state cache pass) through
`many_rows_linear`, which uses oneDNN's fp32 GEMM (`torch.ops.mkldnn._linear_pointwise`, the op inductor's
CPU backend calls) where a one-off measurement found it at least MIN_GAIN faster, and F.linear (MKL)
elsewhere. Both compute x . W^T in fp32; results differ by the order of the sums only.

The choice is measured once per machine and thread count (~1-2 s) while the machine is quiet
(heads.kernels.quiet) and cached under $HEADWAY_CACHE/calibration/gemm-cpu<threads>.json with the CPU's name;
another CPU measures again.

    many_rows_linear(x, weight, bias)     # x [..., in] -> [..., out], fp32, no autograd
    choose_backend(force=False)           # "onednn" | "mkl"
    with forced_backend("mkl"): ...       # benchmarks and tests: this backend, whatever was measured
    with many_rows(model): model(...)     # a pass of many rows only (the hidden-state cache): every stock Linear
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from headway.heads.kernels.machine_choice import interleaved_times, measured_choice
from headway.heads.target import cache_root

BACKENDS = ("mkl", "onednn")
MIN_GAIN = 1.1  # oneDNN only where it is clearly faster: the stock path is what every PyTorch user runs
VERSION = 2  # records name the choice "choice" (version 1: "backend")
SHAPES = ((128, 576, 1536), (128, 1536, 576), (128, 576, 8192), (512, 1024, 1024))  # rows, in, out
REPEATS = 5


_forced: list[str] = []  # forced_backend's stack


@contextmanager
def forced_backend(backend: str):
    """Use `backend` for many-row Linears inside the block, whatever this machine's measured choice is."""
    if backend not in BACKENDS:
        raise ValueError(f"GEMM backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "onednn" and not onednn_available():
        raise ValueError("GEMM backend onednn needs a torch build with oneDNN (mkldnn); use mkl")
    _forced.append(backend)
    try:
        yield
    finally:
        _forced.pop()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ weight [out, in]^T (+ bias) through oneDNN's fp32 GEMM -> [M, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def many_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for the rows a layout's kernel does not take: through oneDNN where it is this machine's faster
    GEMM (fp32 on a CPU, no autograd, a row-major weight), else F.linear itself."""
    if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
            or not weight.is_contiguous() or (_forced[-1] if _forced else choose_backend()) != "onednn"):
        return F.linear(x, weight, bias)
    rows = x.numel() // weight.shape[1]
    out = onednn_linear(x.reshape(rows, weight.shape[1]).contiguous(), weight, bias)  # [M, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def choice_path() -> Path:
    return cache_root() / "calibration" / f"gemm-cpu{torch.get_num_threads()}.json"


@lru_cache(maxsize=None)
def _chosen(threads: int) -> str:
    return _choose(force=False)


def choose_backend(force: bool = False) -> str:
    """This machine's faster many-row fp32 GEMM: read from the cache, else measured (and cached when quiet)."""
    if force:
        _chosen.cache_clear()
        return _choose(force=True)
    return _chosen(torch.get_num_threads())


def _choose(force: bool) -> str:
    if not onednn_available():
        return "mkl"
    return measured_choice(choice_path(), VERSION, BACKENDS, measure,
                           lambda seconds: "onednn" if seconds["mkl"] >= MIN_GAIN * seconds["onednn"] else "mkl",
                           force, describe={"shapes": [list(s) for s in SHAPES]})


@torch.inference_mode()
def measure(shapes=SHAPES, repeats: int = REPEATS) -> dict[str, list[list[float]]]:
    """Seconds per GEMM of each shape under each backend, `repeats` times, backends interleaved (the first
    round warms up)."""
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)) for m, k, n in shapes]
    run = {"mkl": lambda x, w: F.linear(x, w), "onednn": lambda x, w: onednn_linear(x, w, None)}
    return interleaved_times(run, cases, repeats)


class ManyRowsForward:
    """linear.forward through many_rows_linear (a plain object: the model still deep-copies and pickles)."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return many_rows_linear(x, self.linear.weight, self.linear.bias)


@contextmanager
def many_rows(model: nn.Module):
    """Inside the block, every Linear of `model` that runs nn.Linear's own forward (the stock layout) goes
    through many_rows_linear; Linears a weight layout routes keep their kernel. For passes that only ever
    feed many rows at once, such as the target's teacher-forced forward over whole training sequences."""
    routed = [m for m in model.modules() if isinstance(m, nn.Linear) and "forward" not in vars(m)]
    for linear in routed:
        linear.forward = ManyRowsForward(linear)
    try:
        yield model
    finally:
        for linear in routed:
            vars(linear).pop("forward", None)
