"""One decode step's attention at a data-generation batch: PyTorch's SDPA against heads/kernels/decode_attention.

    python scripts/bench_attention.py                              # SmolLM2-135M's heads, batch 128, bf16
    python scripts/bench_attention.py --dtype fp32 --lengths 128 512

Shapes are a decoding batch of data generation (train/data/decode.py): `--batch` rows, the target's query heads
grouped per key/value head (SmolLM2-135M: 9 over 3, 64 wide), keys and values as views into a cache with spare
room, left pads masked. Each cell is the best of `--repeats` calls, the two alternating. Prints milliseconds per
layer per cached length, and last the SDPA time over the kernel's at the longest length.
"""

import argparse

import bench_common as bc
import torch

from headway.heads.kernels.decode_attention import available, decode_attention
from headway.train.data.decode import grouped_decode_sdpa  # what data generation runs where the kernel does not apply


def inputs(batch: int, heads: int, kv_heads: int, dim: int, length: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(length)
    query = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)  # [B, H, 1, D]
    key = torch.randn(batch, kv_heads, length + 64, dim, generator=g).to(dtype)[:, :, :length]  # [B, Hkv, T, D]
    value = torch.randn(batch, kv_heads, length + 64, dim, generator=g).to(dtype)[:, :, :length]
    pads = torch.randint(0, max(1, length // 8), (batch,), generator=g)
    mask = (torch.arange(length) >= pads[:, None])[:, None, None]  # [B, 1, 1, T]
    return query, key, value, mask


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 200, 300, 450])
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if min(args.batch, args.heads, args.kv_heads, args.repeats, *args.lengths) < 1:
        bc.bad_input("--batch, --heads, --kv-heads, --lengths and --repeats must be >= 1")
    if args.heads % args.kv_heads:
        bc.bad_input(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if not available():
        bc.bad_input("the decode-attention kernel needs AVX-512 and a C++ compiler, which this machine lacks")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    scale = args.head_dim ** -0.5
    rows = []
    for length in args.lengths:
        case = inputs(args.batch, args.heads, args.kv_heads, args.head_dim, length, dtype)
        ways = {"sdpa": lambda: grouped_decode_sdpa(*case, scale), "kernel": lambda: decode_attention(*case, scale)}
        for way in ways.values():  # warm-up, not timed
            way()
        best = {name: float("inf") for name in ways}
        for _ in range(args.repeats):  # the two alternating
            for name, way in ways.items():
                best[name] = min(best[name], bc.best_time(way, repeats=1))
        rows.append({"cached tokens": length, "sdpa ms": best["sdpa"] * 1e3, "kernel ms": best["kernel"] * 1e3,
                     "sdpa / kernel": best["sdpa"] / best["kernel"]})
    bc.print_table(rows, f"decode-step attention per layer: batch {args.batch}, {args.heads} query heads over "
                         f"{args.kv_heads} key/value heads, {args.head_dim} wide, {args.dtype}; {bc.machine()}")
    bc.headline(rows[-1]["sdpa / kernel"], f"SDPA / kernel at {args.lengths[-1]} cached tokens")


if __name__ == "__main__":
    main()
