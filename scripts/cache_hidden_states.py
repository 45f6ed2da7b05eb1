"""Build the offline hidden-state cache: run the frozen target once over the tokenised training data.

    python scripts/cache_hidden_states.py head=eagle3 data=default data.hidden_cache=cache/eagle3
    accelerate launch train/main.py head=eagle3 data=default data.hidden_states=offline data.hidden_cache=cache/eagle3
    accelerate launch --multi_gpu --num_processes 2 scripts/cache_hidden_states.py --out cache/eagle3 head=eagle3

Under `accelerate launch` (or torchrun) every process computes its share of the examples and rank 0 writes
one index at the end (gloo on CPU, NCCL on GPUs); only rank 0 validates and prints the report.

The config is the training job's (conf/cache_hidden_states.yaml composes conf/train.yaml), so with the same
overrides the cache holds exactly the examples (data, train.max_length, train.seed) and hidden-state layers
(the head's) that training will read, and the target's logits as data.cache_logits says (none: recomputed
from the last hidden state in the step | topk: data.logits_topk per token | full); it is written to
data.hidden_cache on `device`. The cache's own keys: cache.layers (hidden-state indices, default: the
head's), cache.dtype (auto: the target's, so offline equals online), cache.batch_size, cache.shard_tokens
(tokens per shard file), cache.validate (entries recomputed and compared at the end).
Killed? Run the same command again: finished shards are kept. At the end a sample of entries is
recomputed and compared, and bytes per token, write and read throughput are printed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]

from hydra.core.config_store import ConfigStore

from headway.heads.base import HeadError
from headway.heads.cli import run_command
from headway.heads.target import TargetError
from headway.train.config import TrainConfig  # registers the training schema
from headway.train.data.config import DataError
from headway.train.config import ConfigError


@dataclass
class CacheOptions:
    layers: Optional[List[int]] = None  # hidden-state indices to cache (null: the head's)
    dtype: str = "auto"  # storage dtype: auto (the target's, so offline equals online) | float32 | bfloat16 | float16
    batch_size: int = 8  # sequences per target forward
    shard_tokens: int = 1 << 18  # tokens per shard file
    validate: int = 8  # entries recomputed and compared at the end


@dataclass
class CacheJobConfig(TrainConfig):
    cache: CacheOptions = field(default_factory=CacheOptions)


ConfigStore.instance().store(name="cache_hidden_states_schema", node=CacheJobConfig)
DTYPES = ("auto", "float32", "bfloat16", "float16")


def head_layers(cfg, target) -> list[int]:
    from omegaconf import OmegaConf

    from headway.heads.base import build_head

    options = OmegaConf.to_container(cfg.head.options, resolve=True) or {}
    return build_head(cfg.head.kind, target, **options).feature_layers()


def read_throughput(directory, target, layers, datasets, batch_size: int) -> float:
    """Tokens/s reading features back through the offline source (what a training step does)."""
    from headway.train.data import collate_fn
    from headway.train.data.hidden_cache import OfflineFeatureSource

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


def build(cfg) -> dict:
    """Build (or complete) the cache `cfg` describes, validate a sample, measure reading it back."""
    import torch
    from omegaconf import OmegaConf

    from headway.heads.target import load_target, resolve_dtype
    from headway.train.data import build_datasets
    from headway.train.config import check_fits_context
    from headway.train.data.hidden_cache import HiddenStateCache, build_cache

    opts, out = cfg.cache, cfg.data.hidden_cache
    if not out:
        raise DataError("say where the cache goes: data.hidden_cache=DIR")
    if opts.dtype not in DTYPES:
        raise DataError(f"cache.dtype must be one of {', '.join(DTYPES)}, got {opts.dtype!r}")
    if min(opts.batch_size, opts.shard_tokens) < 1 or opts.validate < 0:
        raise DataError("cache.batch_size and cache.shard_tokens must be >= 1, cache.validate >= 0")
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if cfg.device == "auto" else cfg.device)
    rank, world, barrier = distributed(device)
    if device == "cpu":  # accelerate launch would leave one thread per process
        from headway.train.threads import use_cpu_threads

        use_cpu_threads(cfg.cpu_threads)
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    target = load_target(OmegaConf.to_container(cfg.target, resolve=True), device=device)
    check_fits_context(cfg.train.max_length, target.config)
    layers = list(opts.layers) if opts.layers else head_layers(cfg, target)
    data_cfg = dict(OmegaConf.to_container(cfg.data, resolve=True), hidden_states="online")  # the cache is built from the online target
    datasets = build_datasets(data_cfg, target.tokenizer, cfg.train.max_length, cfg.train.seed)
    dtype = None if opts.dtype == "auto" else resolve_dtype(opts.dtype)
    meta = {"data": {"name": cfg.data.name, "source": cfg.data.source}, "max_length": cfg.train.max_length,
            "seed": cfg.train.seed, "head": cfg.head.kind}
    report = build_cache(out, target, list(datasets), layers, dtype, opts.batch_size, opts.shard_tokens, meta,
                         progress=rank == 0, logits=cfg.data.cache_logits, topk=cfg.data.logits_topk, rank=rank,
                         world_size=world, barrier=barrier, precision=cfg.data.cache_precision)
    if rank != 0:
        return report
    cache = HiddenStateCache(out, target, layers)
    report["validated_entries"] = min(opts.validate, len(cache))
    report["max_relative_error"] = cache.validate(target, opts.validate) if opts.validate else None
    report["read_tokens_per_s"] = round(read_throughput(out, target, layers, datasets, opts.batch_size), 1)
    report.update(out=str(out), layers=cache.layers, dtype=cache.index["dtype"])
    print(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    return run_command("cache_hidden_states", build, argv, errors=(DataError, TargetError, HeadError, ConfigError),
                       usage=__doc__)


if __name__ == "__main__":
    sys.exit(main())
