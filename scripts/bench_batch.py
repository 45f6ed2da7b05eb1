"""Speculative speedup vs batch size, with and without the batch-size throttle (large batches leave no flat
part of T(N) for trees to ride).

At batch B a tree of N nodes per row makes one target forward of B x N tokens. Small batches sit on the
flat, memory-bound part of T(N), so trees are nearly free; large batches are already near the ridge, so
full trees multiply the step's cost and speculation slows generation down. The engine's throttle sizes
the tree from the measured T(N) (infer.calibrate.TreeBudget); "unthrottled" keeps the full tree at every B.

    python scripts/bench_batch.py                             # prompt-lookup drafter, SmolLM2-135M, CPU
    python scripts/bench_batch.py --head runs/eagle/final     # a trained head instead
    python scripts/bench_batch.py --quick                     # tiny random target (smoke test)
"""

from __future__ import annotations

import argparse

import bench_common as bc
import torch

from headway.infer.calibrate import TreeBudget
from headway.infer.engine import Engine
from headway.heads.kernels.weight_layout import apply_layout


class FullTree(TreeBudget):
    """No throttle: every row drafts the full tree whatever the batch size."""

    def max_tokens(self, batch_size: int) -> int:
        return self.max_nodes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="a conf/target preset, or an HF model dir or hub name")
    p.add_argument("--head", default=None, help="a head folder; default: the prompt-lookup drafter")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--max-nodes", type=int, default=32, help="full tree size (nodes per row, root included)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quick", action="store_true", help="tiny random target, batches 1 and 4 (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.target, args.batches, args.max_new_tokens, args.max_nodes = "tiny-random", [1, 4], 8, 8
    bc.check_device(args.device)
    return args


def make_drafter(args, target):
    from headway.heads.base import load_head
    from headway.infer.drafters import build_drafter

    if args.head:  # a fixed-shape tree: the throttle, not the cost-planned policy, is what this measures
        head = load_head(args.head, target, device=args.device)
        return build_drafter("head", target, head=head, policy="dynamic"), "head"
    return build_drafter("prompt_lookup", target), "prompt_lookup"


def tokens_per_second(engine, prompts, args) -> tuple[float, float]:
    engine.generate(prompts[:1], max_new_tokens=4, temperature=args.temperature, seed=0)  # warm-up
    out = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    return out.stats.tokens_per_second, out.stats.tau


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    target = bc.load_bench_target(args.target, args.device, args.dtype)
    prompts = [ids for _, ids in bc.bench_prompts(target.tokenizer, ["chat", "humaneval"], None)]
    drafter, drafter_name = make_drafter(args, target)
    apply_layout(target.model, "auto", target)  # the engines' weight layout: T(N) is measured under it
    throttled = TreeBudget.for_target(target, max_nodes=args.max_nodes, measure=True)  # measured T(N), cached
    full = FullTree(max_nodes=args.max_nodes)
    engines = {"plain": Engine(target),
               "throttled": Engine(target, drafter, budget=throttled),
               "unthrottled": Engine(target, drafter, budget=full)}
    print(f"machine: {bc.machine()}; target {target.spec.name} on {args.device}, drafter {drafter_name}, "
          f"full tree {args.max_nodes} nodes, {args.max_new_tokens} new tokens, temperature {args.temperature:g}")
    rows = []
    for batch in args.batches:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        tps = {name: tokens_per_second(eng, batch_prompts, args) for name, eng in engines.items()}
        rows.append({"batch": batch, "tree (throttled)": throttled.max_tokens(batch),
                     "plain tok/s": tps["plain"][0],
                     "throttled tok/s": tps["throttled"][0], "tau thr": tps["throttled"][1],
                     "speedup thr": tps["throttled"][0] / tps["plain"][0],
                     "unthrottled tok/s": tps["unthrottled"][0], "tau full": tps["unthrottled"][1],
                     "speedup full": tps["unthrottled"][0] / tps["plain"][0]})
    bc.print_table(rows, "\n(speedup = speculative tokens/s / plain tokens/s at the same batch)")
    last = rows[-1]
    bc.headline(last["throttled tok/s"] / last["unthrottled tok/s"],
                f"throttled vs unthrottled speculative decoding at batch {last['batch']}")


if __name__ == "__main__":
    main()
