"""Paged KV cache vs transformers' DynamicCache (concatenation).

1. Time: a speculative generation of 1,024 tokens after a prompt. Each step appends gamma + 1 tokens to
   every layer (the last committed token plus gamma drafts), hands back the layer's keys/values for
   attention, then rolls back the rejected drafts. Both caches see the same acceptance sequence.
2. Memory: a batch of sequences whose final lengths are unknown when they start. Preallocating max_len
   per row vs what the paged cache holds at its peak (blocks in use), vs DynamicCache's batch padded to
   the longest row. Block accounting runs on the real cache; bytes are scaled to the target's KV size.

    python scripts/bench_kv_cache.py                      # SmolLM2-135M shapes, fp32, CPU
    python scripts/bench_kv_cache.py --device cuda --dtype bf16
    python scripts/bench_kv_cache.py --quick              # tiny sizes (smoke test)
"""

from __future__ import annotations

import argparse

import bench_common as bc
import torch
from transformers import DynamicCache

from headway.infer.kv_cache import PagedKVCache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024, help="tokens generated")
    p.add_argument("--gamma", type=int, default=5, help="drafts per step")
    p.add_argument("--alpha", type=float, default=0.7, help="per-draft acceptance rate")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=64, help="rows in the memory comparison")
    p.add_argument("--max-len", type=int, default=2048, help="the length a preallocating cache reserves")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.prompt, args.tokens, args.batch, args.max_len, args.repeats = 2, 16, 64, 4, 128, 1
    bc.check_device(args.device)
    return args


def accept_counts(args) -> list[int]:
    """Accepted drafts per step until `tokens` are generated: truncated geometric, fixed seed."""
    g = torch.Generator().manual_seed(0)
    counts, total = [], 0
    while total < args.tokens:
        hits = torch.rand(args.gamma, generator=g) < args.alpha
        a = int(hits.cumprod(0).sum())
        counts.append(a)
        total += a + 1
    return counts


def run_paged(args, counts, kv):
    cache = PagedKVCache(args.layers, args.kv_heads, args.head_dim, batch_size=1, block_size=args.block_size,
                         num_blocks=-(-(args.prompt + args.tokens + 2 * args.gamma + 2) // args.block_size),
                         dtype=kv[0].dtype, device=args.device)
    prompt = kv[1]
    cache.prepare(args.prompt)
    for layer in range(args.layers):
        cache.update(prompt, prompt, layer)
    for a in counts:
        cache.prepare(args.gamma + 1)
        for layer in range(args.layers):
            keys, values = cache.update(kv[0], kv[0], layer)  # [1, H, L, D] read back for attention
        cache.truncate(cache.lengths - (args.gamma - a))
    _sync(args)
    return int(cache.lengths[0])


def run_dynamic(args, counts, kv):
    cache = DynamicCache()
    prompt = kv[1]
    for layer in range(args.layers):
        cache.update(prompt, prompt, layer)
    for a in counts:
        for layer in range(args.layers):
            keys, values = cache.update(kv[0], kv[0], layer)  # concatenates: copies the whole row
        if a < args.gamma:
            cache.crop(-(args.gamma - a))
    _sync(args)
    return cache.get_seq_length()


def _sync(args):
    if str(args.device).startswith("cuda"):
        torch.cuda.synchronize()


def time_rows(args) -> tuple[list[dict], float]:
    counts = accept_counts(args)
    dtype = DTYPES[args.dtype]
    step = torch.randn(1, args.kv_heads, args.gamma + 1, args.head_dim, dtype=dtype, device=args.device)
    prompt = torch.randn(1, args.kv_heads, args.prompt, args.head_dim, dtype=dtype, device=args.device)
    kv = (step, prompt)
    lengths = {run_paged(args, counts, kv), run_dynamic(args, counts, kv)}
    assert len(lengths) == 1, f"the two caches disagree on the final length: {lengths}"
    t_paged = bc.best_time(lambda: run_paged(args, counts, kv), args.repeats)
    t_dyn = bc.best_time(lambda: run_dynamic(args, counts, kv), args.repeats)
    per_step = lambda t: 1e3 * t / len(counts)  # noqa: E731
    rows = [
        {"cache": "DynamicCache (cat)", "steps": len(counts), "total ms": 1e3 * t_dyn, "ms/step": per_step(t_dyn),
         "vs DynamicCache": 1.0},
        {"cache": "PagedKVCache", "steps": len(counts), "total ms": 1e3 * t_paged, "ms/step": per_step(t_paged),
         "vs DynamicCache": t_dyn / t_paged},
    ]
    return rows, t_dyn / t_paged


def memory_rows(args) -> tuple[list[dict], float]:
    """Rows grow 16 tokens at a time to lengths drawn uniformly from [max_len/16, max_len]; the paged
    cache's peak blocks in use is what it holds (bookkeeping-only pool: one element per token)."""
    g = torch.Generator().manual_seed(1)
    final = torch.randint(args.max_len // 16, args.max_len + 1, (args.batch,), generator=g)  # [B]
    cache = PagedKVCache(1, 1, 1, batch_size=args.batch, block_size=args.block_size, max_seq_len=args.max_len,
                         num_blocks=args.batch * -(-args.max_len // args.block_size))
    peak = 0
    while bool((cache.lengths < final).any()):
        cache.prepare((final - cache.lengths).clamp(max=16))
        peak = max(peak, cache.blocks_in_use())
    per_token = 2 * args.layers * args.kv_heads * args.head_dim * DTYPES[args.dtype].itemsize  # K and V
    mib = lambda tokens: tokens * per_token / 2**20  # noqa: E731
    prealloc = mib(args.batch * args.max_len)
    padded = mib(args.batch * int(final.max()))
    paged = mib(peak * args.block_size)
    used = mib(int(final.sum()))
    rows = [
        {"layout": f"preallocate max_len={args.max_len}", "MiB held": prealloc, "vs paged": prealloc / paged},
        {"layout": "DynamicCache, padded to longest", "MiB held": padded, "vs paged": padded / paged},
        {"layout": f"paged (block {args.block_size}), peak", "MiB held": paged, "vs paged": 1.0},
        {"layout": "tokens actually stored", "MiB held": used, "vs paged": used / paged},
    ]
    return rows, prealloc / paged


def main(argv=None) -> None:
    args = parse_args(argv)
    print(f"machine: {bc.machine()}; {args.dtype} on {args.device}")
    rows, speedup = time_rows(args)
    bc.print_table(rows, f"\n{args.tokens}-token speculative generation after a {args.prompt}-token prompt "
                         f"({args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}; gamma {args.gamma}, "
                         f"alpha {args.alpha}; append + read back + roll back; best of {args.repeats})")
    mem, saving = memory_rows(args)
    bc.print_table(mem, f"\nKV memory for {args.batch} sequences of unknown length (uniform in "
                        f"[{args.max_len // 16}, {args.max_len}] tokens)")
    print(f"\nmemory: preallocating max_len holds {saving:.2f}x what the paged cache holds")
    bc.headline(speedup, "paged cache vs DynamicCache, time for the generation")


if __name__ == "__main__":
    main()
