"""What every benchmark script shares: timing, the table and the headline line.

Benchmarks compare against a baseline measured in the same run (these machines are noisy: ratios, not
absolute times), print one table, and end with one line stating the headline ratio as `<number>x`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def best_time(fn, repeats: int = 3) -> float:
    """Fastest of `repeats` runs (seconds): the run least disturbed by other processes."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def print_table(rows: list[dict], title: str | None = None, out=print) -> None:
    """A plain fixed-width table; floats get 4 significant digits."""
    if title:
        out(title)
    if not rows:
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    out("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        out("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return "-" if v is None else str(v)


def machine() -> str:
    """One line naming the hardware the numbers come from."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return f"CPU x{os.cpu_count()} ({torch.get_num_threads()} torch threads), torch {torch.__version__}"


def headline(ratio: float, what: str) -> None:
    """The last line of every benchmark: the headline ratio as `<number>x`."""
    print(f"{what}: {ratio:.2f}x")


def bad_input(message: str) -> None:
    """One `error:` line on stderr and exit 2: how every benchmark refuses bad arguments."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_device(name: str) -> None:
    """A --device this machine has, else one `error:` line and exit 2 (not torch's traceback)."""
    from headway.heads.target import device_problem

    problem = device_problem(name)
    if problem:
        bad_input(f"--device {name} {problem}: use --device cpu, or a device this machine has")


def load_bench_target(name: str, device: str = "cpu", dtype: str | None = "auto"):
    """A preset of conf/target/ (smollm2-135m, tiny-random, smollm2-random, ...) or an HF path/hub name,
    frozen, on `device`. A target that cannot be loaded ends the benchmark with one `error:` line, exit 2."""
    from headway.heads.target import TargetError, load_target, target_spec

    try:
        spec = target_spec(name)
        spec.dtype = dtype or spec.dtype  # None: the preset's
        return load_target(spec, device=device)
    except TargetError as exc:
        bad_input(str(exc))


def bench_prompts(tokenizer, sets: list[str], per_set: int | None) -> list[tuple[str, list[int]]]:
    """(set name, chat-templated token ids) for the first `per_set` prompts of each held-out set."""
    from headway.infer.engine import encode_prompts
    from headway.infer.prompt_sets import load_prompt_set

    out = []
    for name in sets:
        rows = load_prompt_set(name)[:per_set]
        out += [(name, ids) for ids in encode_prompts(tokenizer, [r["prompt"] for r in rows])]
    return out
