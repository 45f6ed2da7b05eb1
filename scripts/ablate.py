"""Recipe ablations: train one head per variant (each a set of overrides of the same job), evaluate every
head on held-out prompts with one fixed tree, and print a table of validation simulated tau, held-out tau
and acceptance by depth, each variant's held-out tau minus the first variant's with its 95% interval (paired
over the same prompts, infer.intervals; an interval that holds zero is no evidence either way), and CPU
minutes per variant.

    python scripts/ablate.py --head eagle3 --out runs/ablate-eagle3 \
        --variant base= --variant lr1e-3=optim.lr=1e-3 --variant muon=optim=muon,optim.lr=1e-3
    python scripts/ablate.py --head eagle --out runs/ablate-eagle --common train.max_steps=400 \
        --variant noise0=head.options.noise=0 --variant ttt2=head.options.ttt_steps=2

A variant is `name=override[,override...]` (an empty list is the job as configured). `--seeds N` trains
every variant with the training seeds 0..N-1 on one data split (`train.seed=K +data.split_seed=0`, runs
NAME-seedK): a training seed alone moves held-out tau by ~0.03 on 48 prompts, as much as many recipe changes;
the table then gives the seeds' mean tau, each seed's, and the difference paired over the prompts with each
prompt's counts summed over the seeds. Runs that already
have a final/ head or an eval.json are reused, so a killed ablation continues where it stopped. The fixed
tree is the 8-node dynamic tree (depth 3, top-3) with a static budget, so acceptance does not depend on
this machine's speed; the chat prompts are taken round-robin over categories. With `cpu_threads=N` in
--common (ablations sharing a machine, one thread each) the evaluations run on N threads as well.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from headway.infer.intervals import IntervalError, compare_results, per_prompt

REPO = Path(__file__).resolve().parents[1]
FIXED_TREE = ["budget=static", "+draft.policy=dynamic", "+draft.total_tokens=8", "+draft.depth=3",
              "+draft.top_k=3", "baselines=[]", "plot=false"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--variant", action="append", required=True, help="name=override[,override...]")
    p.add_argument("--common", default="", help="overrides every variant shares, comma-separated")
    p.add_argument("--prompts", nargs="+", default=["chat:16", "humaneval:8"],
                   help="prompt sets to evaluate on, as name:count")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seeds", type=int, default=1, help="training seeds per variant (default 1: the job's own)")
    p.add_argument("--plot", metavar="KEY", help="a numeric override every variant sets (e.g. "
                   "data.max_conversations): plot tau against it into OUT/<KEY>.png")
    return p.parse_args(argv)


def overrides(text: str) -> list[str]:
    """Split `a=1,b=[0.9,0.999]` at the commas outside brackets: a list value stays one override."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [o for o in parts if o]


def cpu_minutes_of(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run a command (output to `log`), fail loudly, and return the CPU minutes it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed (exit {done.returncode}); see {log}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / 60


def train(args, name: str, extra: list[str]) -> tuple[Path, float | None]:
    run = (args.out / name).resolve()
    if (run / "final" / "config.json").is_file():
        return run, None
    cmd = [sys.executable, "train/main.py", f"head={args.head}", f"hydra.run.dir={run}", "resume=latest",
           *overrides(args.common), *extra]
    run.mkdir(parents=True, exist_ok=True)
    return run, cpu_minutes_of(cmd, run / "train.log")


def eval_env(common: str) -> dict | None:
    """Evaluate on as many threads as training was given (`cpu_threads=N` in --common): ablations that share
    the machine run one thread each, and a 2-thread evaluation next to a busy core keeps waiting on it
    (OpenMP)."""
    threads = [o.split("=", 1)[1] for o in overrides(common) if o.startswith("cpu_threads=")]
    if not threads or not threads[-1].isdigit():
        return None
    return {**os.environ, "OMP_NUM_THREADS": threads[-1]}


def evaluate(args, run: Path, prompts: str, count: int) -> dict:
    out = run / "eval" / f"{prompts}-{count}"
    if not (out / "eval.json").is_file():
        cmd = [sys.executable, "-m", "headway.infer.evaluate", f"checkpoint={run / 'final'}", f"prompts={prompts}",
               f"max_prompts={count}", f"max_new_tokens={args.max_new_tokens}", f"output={out}", *FIXED_TREE]
        out.mkdir(parents=True, exist_ok=True)
        cpu_minutes_of(cmd, out.parent / f"{prompts}-{count}.log", eval_env(args.common))
    return json.loads((out / "eval.json").read_text())


def seed_runs(name: str, text: str, seeds: int) -> list[tuple[str, list[str]]]:
    """(run name, overrides) per training seed: one seed keeps the job's own seed and split, several train
    seeds 0..N-1 on the split of seed 0."""
    if seeds == 1:
        return [(name, overrides(text))]
    return [(f"{name}-seed{k}", [*overrides(text), f"train.seed={k}", "+data.split_seed=0"]) for k in range(seeds)]


def over_seeds(results: list[dict]) -> dict:
    """Several seeds' eval.json on the same prompts as one: the mean tau and acceptance, each prompt's counts
    summed over the seeds (none if an evaluation has no per-prompt counts)."""
    if len(results) == 1:
        return results[0]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    depths = min(len(r.get("acceptance_by_depth") or []) for r in results)
    merged = {"tau": mean([r["tau"] for r in results]), "seeds_tau": [r["tau"] for r in results],
              "temperature": results[0].get("temperature"), "max_new_tokens": results[0].get("max_new_tokens"),
              "acceptance_by_depth": [mean([r["acceptance_by_depth"][d] for r in results]) for d in range(depths)]}
    try:
        counts = [per_prompt(r) for r in results]
    except IntervalError:
        return merged
    merged["per_prompt"] = [{"prompt": key, "emitted": sum(c[key][0] for c in counts),
                             "steps": sum(c[key][1] for c in counts)} for key in counts[0] if all(key in c for c in counts)]
    return merged


def last_validation(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().split("\n") if line.strip()]
    val = [r for r in rows if r.get("split") == "val"]
    return val[-1] if val else {}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.seeds < 1:
        sys.exit(f"error: --seeds {args.seeds}: give at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    sets = [(s.split(":")[0], int(s.split(":")[1])) for s in args.prompts]
    table, first = [], {}  # first: the first variant's eval.json per prompt set
    for spec in args.variant:
        name, _, text = spec.partition("=")
        trained = [train(args, run_name, extra) for run_name, extra in seed_runs(name, text, args.seeds)]
        runs, minutes = [run for run, _ in trained], [m for _, m in trained if m is not None]
        val = [v for v in (last_validation(run).get("sim_tau") for run in runs) if v is not None]
        row = {"variant": name, "overrides": text or "-", "val sim tau": sum(val) / len(val) if val else None}
        for prompts, count in sets:
            result = over_seeds([evaluate(args, run, prompts, count) for run in runs])
            first.setdefault(prompts, result)
            row[f"{prompts} tau"] = result.get("tau")
            if args.seeds > 1:
                row[f"{prompts} tau by seed"] = ", ".join(f"{t:.3f}" for t in result["seeds_tau"])
            row[f"{prompts} minus first (95%)"] = paired(first[prompts], result) if table else "-"
            row[f"{prompts} acceptance"] = ", ".join(f"{a:.2f}" for a in result.get("acceptance_by_depth", [])[:3])
        row["train CPU min"] = sum(minutes) if minutes else None
        table.append(row)
        (args.out / "ablation.json").write_text(json.dumps(table, indent=1) + "\n")
        print_table(table)
    if args.plot:
        print(f"plot: {plot_curve(table, args.plot, [p for p, _ in sets], args.out)}")


def paired(base: dict, other: dict) -> str:
    """other's tau minus base's on the same prompts, with its paired 95% interval: '+0.031 [-0.012, +0.075]'."""
    try:
        d = compare_results(base, other)
    except IntervalError:  # an evaluation reused from before per-prompt counts were recorded
        return "-"
    return f"{d.delta:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"


def plot_curve(table: list[dict], key: str, prompt_sets: list[str], out: Path) -> Path:
    """Held-out tau per prompt set and validation simulated tau against the value `key` takes per variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def value(row):
        text = "" if row["overrides"] == "-" else row["overrides"]
        found = [o.split("=", 1)[1] for o in overrides(text) if o.split("=")[0] == key]
        if not found:
            sys.exit(f"error: --plot {key}: variant {row['variant']} does not set {key}=<number>")
        return float(found[0])

    rows = sorted(table, key=value)
    xs = [value(r) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in [f"{p} tau" for p in prompt_sets] + ["val sim tau"]:
        ax.plot(xs, [r[name] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(key)
    ax.set_ylabel("acceptance length tau (8-node tree)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / f"{key}.png"
    fig.savefig(path, dpi=120)
    return path


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    fmt = lambda v: "reused" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(k)) for k in keys) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
