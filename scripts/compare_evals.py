"""Compare heads evaluated on the same prompts: each one's tau with its 95% interval over the prompts, and
each one against the first, paired (the same resampled prompts for both heads), so a difference can be told
from the luck of the prompt draw.

    python scripts/compare_evals.py RUNS/base/eval/chat-48 RUNS/lr2e-3/eval/chat-48
    python scripts/compare_evals.py A/eval.json B/eval.json C/eval.json --level 0.9

Each argument is an eval.json or the folder holding one (`python -m headway.infer.evaluate` writes them).
The last line is the last head against the first: the difference of tau, its interval, and the share of
resamples in which it is above zero. An interval that holds zero is no evidence of a difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from headway.infer.intervals import LEVEL, RESAMPLES, IntervalError, compare_results, per_prompt, tau_interval


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("evals", nargs="+", type=Path, help="eval.json files, or folders holding one; the first is the baseline")
    p.add_argument("--level", type=float, default=LEVEL, help="interval coverage (default 0.95)")
    p.add_argument("--resamples", type=int, default=RESAMPLES)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load(path: Path) -> dict:
    file = path / "eval.json" if path.is_dir() else path
    try:
        res = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IntervalError(f"{file} does not exist: give an eval.json or the folder evaluate wrote it to") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntervalError(f"{file} is not a readable eval.json ({exc}): evaluate the head again") from None
    if not isinstance(res, dict) or not isinstance(res.get("tau"), (int, float)):
        raise IntervalError(f"{file} is not an eval.json (no numeric \"tau\"): give evaluate's output")
    return res


def rows(paths: list[Path], level: float, resamples: int, seed: int) -> list[dict]:
    results = [load(p) for p in paths]
    names = [str(p) for p in paths]
    table = []
    for name, res in zip(names, results):
        counts = list(per_prompt(res, name).values())
        low, high = tau_interval(*zip(*counts), level=level, resamples=resamples, seed=seed)
        row = {"eval": name, "prompts": len(counts), "tau": res["tau"], "interval": (low, high)}
        if table:  # against the first, on the prompts both hold
            row["difference"] = compare_results(results[0], res, (names[0], name), level=level,
                                                resamples=resamples, seed=seed)
        table.append(row)
    return table


def print_table(table: list[dict], level: float) -> None:
    pct = f"{level:.0%}"
    print(f"| eval | prompts | tau | {pct} interval | minus the first (shared prompts) | {pct} interval, paired "
          "| resamples above 0 |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        d = r.get("difference")
        diff = (f"{d.delta:+.3f} ({d.shared}) | {d.low:+.3f} to {d.high:+.3f} | {d.above_zero:.1%}" if d
                else "- | - | -")
        print(f"| {r['eval']} | {r['prompts']} | {r['tau']:.3f} | {r['interval'][0]:.3f}-{r['interval'][1]:.3f} "
              f"| {diff} |")
    if len(table) > 1:
        d = table[-1]["difference"]
        verdict = "holds zero: no evidence of a difference" if d.low <= 0 <= d.high else \
            ("above zero" if d.low > 0 else "below zero")
        print(f"{table[-1]['eval']} minus {table[0]['eval']}: {d.delta:+.3f} tau on {d.shared} shared prompts, "
              f"{pct} interval {d.low:+.3f} to {d.high:+.3f} ({verdict})")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.resamples < 100:
            raise IntervalError(f"--resamples {args.resamples} is too few for an interval: give at least 100")
        table = rows(args.evals, args.level, args.resamples, args.seed)
    except IntervalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(table, args.level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
