"""Data generation cost by batch size: one decoding step of train/data/decode.py at batch 16, 32, 64, 128
(with and without capturing hidden states), prefill and a teacher-forced forward (the cache pass), in one run.

    python scripts/bench_datagen.py                                   # SmolLM2-135M, 1 thread
    python scripts/bench_datagen.py --threads 2 --batch-sizes 16,64,128 --context 200

Costs are measured in this process's CPU time, which a loaded machine disturbs far less than the wall
clock (on an idle machine wall = CPU time / threads, roughly): tokens per CPU-second. The batch starts from
one real prefill of 16 rows of --context tokens, copied to the larger batch sizes (what a step costs does
not depend on the cached values). The last line: decoding tokens/CPU-s at the best batch size against
batch 16, as `<n>x`.
"""

from __future__ import annotations

import argparse
import time

import bench_common as bc


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="a conf/target preset, or an HF model dir")
    p.add_argument("--batch-sizes", default="16,32,64,128", help="multiples of 16 (the prefilled rows are copied)")
    p.add_argument("--context", type=int, default=150, help="tokens per row already in the KV cache")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    sizes = args.batch_sizes.split(",")
    if not all(b.isdigit() and int(b) > 0 and int(b) % 16 == 0 for b in sizes) or min(args.context, args.steps) < 1:
        p.exit(2, f"error: --batch-sizes must be multiples of 16 (got {args.batch_sizes}), "
                  "--context and --steps >= 1\n")
    return args


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main(argv=None) -> None:
    import torch

    from headway.heads.base import compute_features
    from headway.train.data.decode import Tap, _Decoder

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target = bc.load_bench_target(args.target, "cpu", None)
    model, last = target.model, target.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, target.config.vocab_size - 100, (16, args.context), generator=g).tolist()
    rows = []
    with torch.no_grad():
        ids = torch.tensor(prompts)
        cpu = cpu_seconds(lambda: compute_features(model, ids, torch.ones_like(ids), [last]))
        rows.append({"what": "teacher-forced forward (cache pass)", "batch": 16, "tok/cpu-s": ids.numel() / cpu})
        base = _Decoder(model, prompts, 10 ** 6, [], 0, 0.0, 1.0, None, None)
        cpu = cpu_seconds(base.prefill)
        rows.append({"what": "prefill", "batch": 16, "tok/cpu-s": ids.numel() / cpu})
        for capture in (False, True):
            for b in map(int, args.batch_sizes.split(",")):
                rows.append({"what": "decode step" + (" + capture" if capture else ""), "batch": b,
                             "tok/cpu-s": b * args.steps / _steps(base, b, args.steps, capture, last, Tap)})
                print(rows[-1], flush=True)
    bc.print_table(rows, f"{args.target}, {args.context} tokens of context, {args.threads} thread(s), CPU time")
    decode = [r for r in rows if r["what"] == "decode step"]
    best = max(decode, key=lambda r: r["tok/cpu-s"])
    print(f"decoding tokens per CPU-second, batch {best['batch']} over batch {decode[0]['batch']}: "
          f"{best['tok/cpu-s'] / decode[0]['tok/cpu-s']:.2f}x")


def _steps(base, batch: int, steps: int, capture: bool, last: int, Tap) -> float:
    """CPU seconds of `steps` decoding steps at `batch` rows, from a copy of base's prefilled cache."""
    import copy

    import torch

    d = copy.copy(base)
    repeat = batch // len(base.prompts)
    d.cache = copy.deepcopy(base.cache)
    d.cache.batch_repeat_interleave(repeat)
    d.prompts = base.prompts * repeat
    d.alive = torch.arange(batch)
    d.fed = base.fed.repeat(repeat)
    d.mask = base.mask.repeat_interleave(repeat, 0)
    d.stopped = torch.zeros(batch, dtype=torch.bool)
    d.done = torch.zeros(batch, dtype=torch.bool)
    d.tail, d.tail_fed = base.tail.repeat(repeat, 1), base.tail_fed.repeat(repeat)
    d.tap = Tap([last], None, None) if capture else None
    if capture:
        d.hidden = {last: torch.zeros(batch, int(d.fed.max()) + steps + 1, base.model.config.hidden_size)}
    new = torch.zeros(batch, dtype=torch.long)
    return cpu_seconds(lambda: [d.step(new) for _ in range(steps)])


if __name__ == "__main__":
    main()
