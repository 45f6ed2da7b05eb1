"""The "panel" weight layout: every Linear multiplies a few rows (2 <= M <= 32) through a small AVX-512 or AVX2
kernel (panel_linear.cpp) that reads the weights once whatever M is, so verifying a tree of 8 tokens costs
little more than a decode step. One row (the decode step) takes whichever of MKL's matrix-vector product
(F.linear) and this kernel is faster on this machine, measured once and cached (`one_row_path`): on the
Intel CPUs measured MKL was ~7% faster inside the model, on AMD CPUs, where MKL leaves AVX-512 unused, the
kernel is ~3x faster. Autograd takes the stock F.linear on the stock weight, larger M (prefill) this
machine's faster many-row GEMM (heads/kernels/gemm.py).

Each Linear keeps its stock weight and gains a copy laid out as panels [P, in, 48] (48 output features
per panel, zero-padded), i.e. the layout doubles the Linear weights in memory. The kernel is compiled
with the system C++ compiler on first use (torch.utils.cpp_extension; ~20-40 s once, then cached in
torch's extension folder, $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions), for AVX-512 where PyTorch
runs its own kernels in AVX-512, else for AVX2 with FMA; without a compiler or either the layout is simply
unavailable.
"""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from headway.heads.kernels.gemm import many_rows_linear
from headway.heads.kernels.machine_choice import interleaved_times, measured_choice
from headway.heads.target import cache_root


SOURCE = Path(__file__).with_name("panel_linear.cpp")
# what this kernel and the blocks kernel share, and the vector operations of every kernel
SHARED_HEADERS = (Path(__file__).with_name("panel_rows.h"), Path(__file__).with_name("simd.h"))
COLS = 48  # output features per panel (3 AVX-512 vectors, 6 AVX2 ones)
MIN_ROWS, MAX_ROWS = 2, 32  # one row: see one_row_path; above 32 the stock GEMM wins (compute-bound prefill)
ONE_ROW_PATHS = ("mkl", "kernel")
ONE_ROW_VERSION = 1
ONE_ROW_GAIN = 1.1  # the kernel takes one row only where it is clearly faster than MKL's GEMV
# a decoder layer of a small model (SmolLM2-135M: q/o, k/v, gate/up, down; ~15 MB, in the last-level cache
# like a draft head's weights) and a wider one: out, in
ONE_ROW_SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (2048, 2048), (5632, 2048))


# the compiler flags of each instruction set the panel kernels are built for (panel_rows.h), by the name
# torch.backends.cpu.get_cpu_capability() gives the CPU
ISA_FLAGS = {"AVX512": ("-mavx512f", "-mfma"), "AVX2": ("-mavx2", "-mfma")}


def kernel_isa() -> str | None:
    """The instruction set the panel kernels are built for on this CPU (what PyTorch's own kernels use: it
    checks the CPU, and the OS's support for the registers), None where neither AVX-512 nor AVX2 is there."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in ISA_FLAGS else None


def other_isas() -> list[str]:
    """The instruction sets this CPU also runs besides kernel_isa() (AVX2 on an AVX-512 CPU): the tests build
    the kernels for them too, so that one CPU checks every build it can run."""
    order = list(ISA_FLAGS)[::-1]  # AVX2, then AVX512: each CPU runs a prefix of it
    native = kernel_isa()
    return order[:order.index(native)] if native else []


def isa_problem() -> str | None:
    if kernel_isa() is None:
        return f"needs AVX-512 or AVX2 (this CPU: {torch.backends.cpu.get_cpu_capability()})"
    return None


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not (one line)."""
    if problem := isa_problem():
        return problem
    try:
        kernel()
    except Exception as exc:  # no compiler, no headers, a failed build: the layout is just not offered
        return f"could not build its kernel ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


READY_SECONDS: dict[str, float] = {}  # how long this process waited for the kernel (a build, or a load)


@lru_cache(maxsize=1)
def kernel():
    """The compiled extension (built once per source version and torch build, then loaded from disk)."""
    start = time.perf_counter()
    module = build_extension("headway_panel", SOURCE)
    READY_SECONDS["kernel"] = time.perf_counter() - start
    return module


@lru_cache(maxsize=1)
def source_tag() -> str:
    return kernel_tag(SOURCE)


def kernel_tag(source: Path) -> str:
    """Names a version of a panel kernel (its source, the shared header and the torch build): a new kernel is
    built again, and timings measured with an older one are not reused."""
    code = source.read_bytes() + b"".join(header.read_bytes() for header in SHARED_HEADERS)
    return hashlib.sha256(code + torch.__version__.encode()).hexdigest()[:12]


def build_extension(prefix: str, source: Path, extra_cflags: tuple[str, ...] = (), isa: str | None = None):
    """A panel kernel compiled with torch's extension builder for this CPU's instruction set (or `isa`) into
    $TORCH_EXTENSIONS_DIR (once per version and instruction set, then loaded from there)."""
    from torch.utils.cpp_extension import load

    isa = isa or kernel_isa()
    if isa is None:
        raise RuntimeError(isa_problem())
    os.environ.setdefault("MAX_JOBS", "2")
    return load(name=f"{prefix}_{isa.lower()}_{kernel_tag(source)}", sources=[str(source)],
                extra_cflags=["-O3", *ISA_FLAGS[isa], "-fopenmp", *extra_cflags], verbose=False)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/48), K, 48], zero rows past N."""
    N, K = weight.shape
    P = -(-N // COLS)
    padded = weight.new_zeros(P * COLS, K)
    padded[:N] = weight
    return padded.view(P, COLS, K).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor, N: int) -> torch.Tensor:
    """to_panels undone: [P, K, 48] -> [N, K]."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:N]


def panel_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through the panel kernel for MIN_ROWS..MAX_ROWS rows; F.linear otherwise."""
    rows = x.numel() // linear.in_features
    if rows > MAX_ROWS:
        return many_rows_linear(x, linear.weight, linear.bias)  # a prefill or a decoding batch
    if ((rows < MIN_ROWS and one_row_path() == "mkl") or torch.is_grad_enabled() or x.dtype != torch.float32
            or x.device.type != "cpu"):
        return F.linear(x, linear.weight, linear.bias)
    flat = x.reshape(rows, linear.in_features).contiguous()  # [M, in]
    out = kernel().panel_linear(flat, panels_of(linear), linear.out_features)  # [M, out]
    if linear.bias is not None:
        out += linear.bias
    return out.reshape(*x.shape[:-1], linear.out_features)


def panels_of(linear: nn.Linear) -> torch.Tensor:
    """The layer's panel copy, made again if its weight was replaced or changed in place since."""
    weight = linear.weight
    stamp = (weight.data_ptr(), weight._version)
    if getattr(linear, "panel_stamp", None) != stamp:
        linear.panels = to_panels(weight.detach())
        linear.panel_stamp = stamp
    return linear.panels


class PanelForward:
    """linear.forward in the panel layout (a plain object: the model still deep-copies and pickles)."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return panel_forward(self.linear, x)


def use_panels(linear: nn.Linear) -> None:
    panels_of(linear)  # made now, not in the first timed step
    one_row_path()  # chosen now too (measured once per machine)
    linear.forward = PanelForward(linear)


# ------------------------------------------------------------------------------ one row: MKL or the kernel

_forced: list[str] = []  # forced_one_row_path's stack


@contextmanager
def forced_one_row_path(path: str):
    """One-row Linears inside the block go through `path` ("mkl" or "kernel"), whatever was measured."""
    if path not in ONE_ROW_PATHS:
        raise ValueError(f"one-row path must be one of {', '.join(ONE_ROW_PATHS)}, got {path!r}")
    _forced.append(path)
    try:
        yield
    finally:
        _forced.pop()


def one_row_path(force: bool = False) -> str:
    """"kernel" where the panel kernel multiplies one row clearly faster than MKL's GEMV on this machine,
    else "mkl": read from $HEADWAY_CACHE/calibration/gemv-cpu<threads>.json, else measured (~1 s)."""
    if _forced:
        return _forced[-1]
    if force:
        _one_row_path.cache_clear()
        return _choose_one_row(force=True)
    return _one_row_path(torch.get_num_threads())


@lru_cache(maxsize=None)
def _one_row_path(threads: int) -> str:
    return _choose_one_row(force=False)


def _choose_one_row(force: bool) -> str:
    path = cache_root() / "calibration" / f"gemv-cpu{torch.get_num_threads()}.json"
    return measured_choice(path, ONE_ROW_VERSION, ONE_ROW_PATHS, measure_one_row,
                           lambda s: "kernel" if s["mkl"] >= ONE_ROW_GAIN * s["kernel"] else "mkl",
                           force, describe={"shapes": [list(s) for s in ONE_ROW_SHAPES]})


@torch.inference_mode()
def measure_one_row(shapes=ONE_ROW_SHAPES, repeats: int = 5, calls: int = 20) -> dict[str, list[list[float]]]:
    """Seconds for `calls` one-row products of each shape, both paths, `repeats` times, interleaved (the
    first round warms up)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for out, inp in shapes:
        weight = torch.randn(out, inp, generator=gen)
        cases.append((torch.randn(1, inp, generator=gen), weight, to_panels(weight)))
    run = {"mkl": lambda x, w, p: F.linear(x, w), "kernel": lambda x, w, p: kernel().panel_linear(x, p, w.shape[0])}
    return interleaved_times(run, cases, repeats, calls)


def uses_panels(linear: nn.Linear) -> bool:
    return isinstance(vars(linear).get("forward"), PanelForward)
