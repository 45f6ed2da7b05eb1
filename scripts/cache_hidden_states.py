"""Build the offline hidden-state cache: run the frozen target once over the tokenised training data.

    python scripts/cache_hidden_states.py --out cache/eagle3 head=eagle3 data=default
    accelerate launch train/main.py head=eagle3 data=default data.hidden_states=offline data.hidden_cache=cache/eagle3
    accelerate launch --multi_gpu --num_processes 2 scripts/cache_hidden_states.py --out cache/eagle3 head=eagle3

Under `accelerate launch` (or torchrun) every process computes its share of the examples and rank 0 writes
one index at the end (gloo on CPU, NCCL on GPUs); only rank 0 validates and prints the report.

Everything after the options is a training override (same as train/main.py), so the cache holds exactly
the examples (data, train.max_length, seed) and hidden-state layers (the head's) that training will read,
and the target's logits as data.cache_logits says (none: recomputed from the last hidden state in the
step | topk: data.logits_topk per token | full); pass the same data.* overrides to training.
Killed? Run the same command again: finished shards are kept. At the end a sample of entries is
recomputed and compared, and bytes per token, write and read throughput are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from heads.base import HeadError  # noqa: E402
from heads.target import TargetError  # noqa: E402
from train.data.config import DataError  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="remaining arguments: training overrides, e.g. head=eagle3 data=default")
    p.add_argument("--out", help="cache directory (default: data.hidden_cache from the overrides)")
    p.add_argument("--layers", help="hidden-state indices to cache, comma-separated (default: the head's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="storage dtype (auto: the target's, so offline equals online)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--shard-tokens", type=int, default=1 << 18, help="tokens per shard file")
    p.add_argument("--validate", type=int, default=8, help="entries recomputed and compared at the end")
    p.add_argument("--device", default="auto")
    return p.parse_known_args(argv)


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    import train.config  # noqa: F401  (registers the training schema)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def head_layers(cfg, target) -> list[int]:
    from omegaconf import OmegaConf

    from heads.base import build_head

    options = OmegaConf.to_container(cfg.head.options, resolve=True) or {}
    return build_head(cfg.head.kind, target, **options).feature_layers()


def read_throughput(directory, target, layers, datasets, batch_size: int) -> float:
    """Tokens/s reading features back through the offline source (what a training step does)."""
    from train.data import collate_fn
    from train.data.hidden_cache import OfflineFeatureSource

    source = OfflineFeatureSource(directory, target, layers, validate_samples=0)
    collate = collate_fn(target.tokenizer.pad_token_id or 0)
    tokens, started = 0, time.perf_counter()
    for ds in datasets:
        for start in range(0, len(ds), batch_size):
            batch = collate([ds[i] for i in range(start, min(start + batch_size, len(ds)))])
            source(batch)
            tokens += int(batch["attention_mask"].sum())
    return tokens / (time.perf_counter() - started)


def distributed(device: str) -> tuple[int, int, object]:
    """(rank, world size, barrier) of this process; the process group is started when launched as several."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), world, dist.barrier


def main(argv=None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    from omegaconf import OmegaConf

    from heads.target import load_target, resolve_dtype
    from train.data import build_datasets
    from train.data.hidden_cache import HiddenStateCache, build_cache

    cfg = compose(overrides)
    out = args.out or cfg.data.hidden_cache
    if not out:
        raise DataError("say where the cache goes: --out DIR (or data.hidden_cache=DIR)")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if args.device == "auto" else args.device)
    rank, world, barrier = distributed(device)
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    target = load_target(OmegaConf.to_container(cfg.target, resolve=True), device=device)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else head_layers(cfg, target)
    data_cfg = dict(OmegaConf.to_container(cfg.data, resolve=True), hidden_states="online")  # the cache is built from the online target
    datasets = build_datasets(data_cfg, target.tokenizer, cfg.train.max_length, cfg.train.seed)
    dtype = None if args.dtype == "auto" else resolve_dtype(args.dtype)
    meta = {"data": {"name": cfg.data.name, "source": cfg.data.source}, "max_length": cfg.train.max_length,
            "seed": cfg.train.seed, "head": cfg.head.kind}
    report = build_cache(out, target, list(datasets), layers, dtype, args.batch_size, args.shard_tokens, meta,
                         progress=rank == 0, logits=cfg.data.cache_logits, topk=cfg.data.logits_topk, rank=rank,
                         world_size=world, barrier=barrier)
    if rank != 0:
        return 0
    cache = HiddenStateCache(out, target, layers)
    report["validated_entries"] = min(args.validate, len(cache))
    report["max_relative_error"] = cache.validate(target, args.validate) if args.validate else None
    report["read_tokens_per_s"] = round(read_throughput(out, target, layers, datasets, args.batch_size), 1)
    report.update(out=str(out), layers=cache.layers, dtype=cache.index["dtype"])
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        sys.exit(main())
    except (DataError, TargetError, HeadError, HydraException, OmegaConfBaseException) as exc:
        print(f"error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
