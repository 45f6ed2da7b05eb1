"""Many-row fp32 GEMM: MKL (PyTorch's F.linear) against oneDNN, every Linear of the target in sequence.

    python scripts/bench_gemm.py                          # SmolLM2-135M, 32, 128 and 512 rows
    python scripts/bench_gemm.py --rows 128 --repeats 9

The rows a weight layout's own kernel does not take (a prefill, a decoding batch of data generation, the
hidden-state cache pass) go through heads/kernels/gemm.py's many_rows_linear, which picks the faster of the two
libraries on this machine; this script shows by how much. Each cell is the best of `--repeats` passes, the two
libraries alternating (`--bf16` adds bf16 inputs and weights, the GEMM bf16 autocast runs, for comparison).
Prints the milliseconds and GFLOP/s per row count, the machine's cached choice, and last
the MKL time over the oneDNN time at the largest row count.
"""

import argparse
import sys

import bench_common as bc
import torch
import torch.nn.functional as F

from headway.heads.kernels.gemm import choose_backend, onednn_available, onednn_linear
from headway.heads.kernels.weight_layout import _linears

LIBRARIES = {"mkl": lambda x, w: F.linear(x, w), "onednn": lambda x, w: onednn_linear(x, w, None),
             "bf16": lambda x, w: F.linear(x, w)}  # bf16 inputs and weights: what autocast runs (oneDNN)


@torch.inference_mode()
def measure(weights: list[torch.Tensor], rows: list[int], repeats: int,
            libraries=tuple(LIBRARIES)) -> dict[str, dict[int, float]]:
    inputs = {m: {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}} for m in rows}
    as_bf16 = {m: {k: x.bfloat16() for k, x in per.items()} for m, per in inputs.items()}
    weights_bf16 = [w.bfloat16() for w in weights]
    best = {name: {m: float("inf") for m in rows} for name in libraries}
    for _ in range(repeats + 1):  # the first pass warms up
        for name in libraries:
            linear = LIBRARIES[name]
            xs, ws = (as_bf16, weights_bf16) if name == "bf16" else (inputs, weights)
            for m in rows:
                passed = bc.best_time(lambda: [linear(xs[m][w.shape[1]], w) for w in ws], repeats=1)
                best[name][m] = min(best[name][m], passed)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="a conf/target preset, or an HF model dir")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="also time bf16 inputs and weights (autocast's GEMM)")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.repeats < 1:
        parser.error("--rows and --repeats must be >= 1")
    if not onednn_available():
        print("error: this torch build has no oneDNN (mkldnn): there is nothing to compare", file=sys.stderr)
        raise SystemExit(2)
    target = bc.load_bench_target(args.target, "cpu", "auto")
    weights = [linear.weight.detach().contiguous() for linear in _linears(target.model)]
    best = measure(weights, args.rows, args.repeats, ("mkl", "onednn", "bf16") if args.bf16 else ("mkl", "onednn"))
    flops = {m: 2 * m * sum(w.numel() for w in weights) for m in args.rows}
    print(f"machine: {bc.machine()}; target {args.target}, {len(weights)} Linears, fp32, "
          f"{torch.get_num_threads()} threads; this machine's choice: {choose_backend()}")
    bc.print_table([{"library": name, **{f"{m} rows ms": t * 1e3 for m, t in per.items()},
                     **{f"{m} rows GFLOP/s": flops[m] / t / 1e9 for m, t in per.items()}}
                    for name, per in best.items()])
    top = max(args.rows)
    bc.headline(best["mkl"][top] / best["onednn"][top], f"Linears at {top} rows: MKL / oneDNN")


if __name__ == "__main__":
    main()
