"""The hidden-state cache pass in fp32 and in bf16 (`data.cache_precision`): tokens/s of the target's forward
over the rows into a cache, and how far the bf16 states are from the fp32 ones.

Training offline runs the target once over the rows that data generation did not capture (all of them for
data the user brings; on `experiment=cpu_long` after the default job, the answers it copied from the default
build) and stores the hidden states the head reads. This benchmark builds that cache for random token rows (or the conversations of --data) with
`train.data.hidden_cache.build_cache`, as the training job does, with the target as it is (fp32) and with a
bf16 copy, alternating, best of --repeats; then compares the two caches entry by entry (relative L2 error of
each cached hidden-state index, the worst entry). The last line is bf16's tokens/s over fp32's.

    python scripts/bench_cache_pass.py                     # SmolLM2-135M, EAGLE-3's hidden states, 32 x 256 tokens
    python scripts/bench_cache_pass.py --head eagle --rows 64
    python scripts/bench_cache_pass.py --rows 48 --data $HEADWAY_CACHE/data/default-smollm2-135m-<key>.jsonl
    python scripts/bench_cache_pass.py --quick             # tiny random target (smoke test)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import bench_common as bc
import torch
from bench_train import head_options

from headway.heads.base import build_head
from headway.train.data.decode import resolve_precision
from headway.train.data.hidden_cache import HiddenStateCache, build_cache

PRECISIONS = ("fp32", "bf16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="a conf/target preset, or an HF model dir or hub name")
    p.add_argument("--head", default="eagle3", choices=["medusa", "eagle", "eagle3", "mtp"],
                   help="whose hidden states are cached")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--data", help="a conversations JSONL (messages format, e.g. the default dataset under "
                                  "$HEADWAY_CACHE/data/): its first --rows conversations instead of random tokens")
    p.add_argument("--length", type=int, default=256, help="tokens per row")
    p.add_argument("--repeats", type=int, default=2, help="builds per precision (alternating); the best is kept")
    p.add_argument("--quick", action="store_true", help="tiny random target, 8 rows of 32 tokens, one build each")
    args = p.parse_args(argv)
    if args.quick:
        args.target, args.rows, args.length, args.repeats = "tiny-random", 8, 32, 1
    if min(args.rows, args.length, args.repeats) < 1:
        bc.bad_input("--rows, --length and --repeats must be at least 1")
    return args


def rows_to_cache(target, args):
    """The first --rows conversations of --data (chat template, up to 512 tokens), else random token rows."""
    if args.data:
        from headway.train.data import DataConfig, DataError, build_datasets

        cfg = DataConfig(name="bench", source=args.data, format="messages", max_conversations=args.rows, val_size=0)
        try:
            return build_datasets(cfg, target.tokenizer, 512, seed=0)[0]
        except DataError as exc:
            bc.bad_input(f"--data {args.data}: {exc}")
    return random_rows(target, args)


def random_rows(target, args):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(target.config.vocab_size, (args.rows, args.length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": torch.ones_like(ids).bool().tolist()})


def worst_errors(a: Path, b: Path, target, layers: list[int]) -> dict[int, float]:
    """Hidden-state index -> the largest relative L2 error of cache `b`'s entries against cache `a`'s."""
    ref, other = HiddenStateCache(a, target, layers), HiddenStateCache(b, target, layers)
    worst = {}
    for key in ref.keys():
        _, want = ref.entry(key)
        _, got = other.entry(key)
        for i in want:
            err = float((got[i].float() - want[i].float()).norm() / want[i].float().norm().clamp_min(1e-12))
            worst[i] = max(worst.get(i, 0.0), err)
    return worst


def main(argv=None) -> None:
    args = parse_args(argv)
    target = bc.load_bench_target(args.target)
    layers = build_head(args.head, target, **head_options(args.head)).feature_layers()
    rows = rows_to_cache(target, args)
    if resolve_precision("auto", "cpu") != "bf16":
        print("note: this CPU has no bf16 multiply instructions (AMX, AVX512-BF16): bf16 is emulated here and "
              "data.cache_precision=auto takes fp32")
    best = {p: 0.0 for p in PRECISIONS}
    with tempfile.TemporaryDirectory(prefix="bench-cache-pass-") as tmp:
        dirs = {p: Path(tmp) / p for p in PRECISIONS}
        for r in range(args.repeats):
            for precision in PRECISIONS:
                directory = dirs[precision] if r == 0 else Path(tmp) / f"{precision}-{r}"
                report = build_cache(directory, target, [rows], layers, progress=False, precision=precision)
                best[precision] = max(best[precision], report["tokens_per_s"])
        errors = worst_errors(dirs["fp32"], dirs["bf16"], target, layers)
    what = f"{len(rows)} conversations of {args.data}" if args.data else f"{args.rows} x {args.length} random tokens"
    print(f"{bc.machine()}; cache pass of {what}, hidden-state indices "
          f"{sorted(errors)} ({args.head}), best of {args.repeats} alternating builds")
    bc.print_table([{"precision": p, "tok/s": best[p]} for p in PRECISIONS])
    print("bf16 against fp32, worst entry's relative L2 error by hidden-state index: "
          + ", ".join(f"{i}: {e:.4f}" for i, e in sorted(errors.items())))
    bc.headline(best["bf16"] / best["fp32"], "cache pass, bf16 vs fp32 (tokens/s)")


if __name__ == "__main__":
    main()
