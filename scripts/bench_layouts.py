"""Every Linear of the target in sequence, under each weight layout this machine offers, for a few row counts.

    python scripts/bench_layouts.py                       # the default target (SmolLM2-135M, its GGUF)
    python scripts/bench_layouts.py --rows 1 8 --repeats 9

What a decode step (1 row) and a tree verification (N rows) spend in the Linear layers alone: no attention,
norms or Python around them (infer.calibrate times whole forwards). The Linears run one after the other as in
a forward, so each reads its weights from wherever the previous ones left the caches. Each cell is the best
of `--repeats` passes, one layout after the other (best-of filters out a busy moment). The last line is the stock
layout's time over the fastest layout's at one row (a decode step).
"""

import argparse

import bench_common as bc
import torch

from headway.heads.kernels.weight_layout import _linears, apply_layout, candidates


def pass_time(linears, inputs) -> float:
    """Seconds to run every Linear once on its input."""
    return bc.best_time(lambda: [linear(inputs[linear.in_features]) for linear in linears], repeats=1)


@torch.inference_mode()
def measure(model, rows: list[int], repeats: int) -> dict[str, dict[int, float]]:
    linears = _linears(model)
    layouts = list(candidates(model))
    inputs = {m: {k: torch.randn(m, k) for k in {l.in_features for l in linears}} for m in rows}
    best = {layout: {m: float("inf") for m in rows} for layout in layouts}
    for layout in layouts:  # one layout at a time: switching stores some weights anew (packs made again)
        apply_layout(model, layout)
        for _ in range(repeats + 1):  # the first pass warms up (panel copies, packs, kernels)
            for m in rows:
                best[layout][m] = min(best[layout][m], pass_time(linears, inputs[m]))
    apply_layout(model, "stock")
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="a conf/target preset, or an HF model dir")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.repeats < 1:
        parser.error("--rows and --repeats must be >= 1")
    target = bc.load_bench_target(args.target, "cpu", "auto")
    best = measure(target.model, args.rows, args.repeats)
    print(f"machine: {bc.machine()}; target {args.target}, {len(_linears(target.model))} Linears, fp32")
    bc.print_table([{"layout": layout, **{f"{m} rows ms": t * 1e3 for m, t in per.items()},
                     **{f"{m} rows vs stock": best["stock"][m] / t for m, t in per.items()}}
                    for layout, per in best.items()])
    one = min(args.rows)
    fastest = min(best, key=lambda layout: best[layout][one])
    bc.headline(best["stock"][one] / best[fastest][one], f"Linears at {one} row(s): stock / {fastest}")


if __name__ == "__main__":
    main()
