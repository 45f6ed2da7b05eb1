"""Benchmark verify_tree against a per-row, per-node Python loop of the same rules.

    python scripts/bench_verify.py              # CPU, and CUDA when available
    python scripts/bench_verify.py --repeats 3  # quicker

Three implementations of each rule (top-k children, sampled children, greedy): verify_tree; "loop",
the rule as written (settle every node of every row, then walk); "walk", a loop that settles only
the nodes the walk visits (the cheapest Python loop, shown so the headline cannot hide behind it).
Trees are dynamic-tree-like (EAGLE-2): depth 7 where N allows, random parents one layer up, each
node's children are its drafter's top candidates (distinct sibling tokens), p close to q so paths
go deep. Times are medians over repeats of both implementations in the same run.
"""

import argparse
import functools
import statistics
import time

import bench_common as bc
import torch

from headway.heads.sampling import sample
from headway.infer.verify import verify_tree

RULES = ("topk", "sampled", "greedy")


def loop_verify_tree(draft_tokens, parents, target_probs, draft_probs=None, *, greedy=False, generator=None,
                     every_node=True):
    """The straightforward reference, one row and one node at a time (same contract as verify_tree).

    every_node=True follows the rule as written: settle every node (y ~ p, or its siblings' accept
    tests) and then walk from the root. every_node=False settles only the nodes the walk visits.
    """
    B, N = draft_tokens.shape
    parents = parents.expand(B, N).tolist()
    tokens = draft_tokens.tolist()
    rows = []
    for b in range(B):
        kids = [[] for _ in range(N)]
        for j in range(1, N):
            if tokens[b][j] >= 0:
                kids[parents[b][j]].append(j)

        def settle(i):  # -> (accepted child or None, the token drawn at i when no child is)
            if greedy:
                return _greedy_step(target_probs[b, i], kids[i], tokens[b])
            if draft_probs is None:
                return _deterministic_step(target_probs[b, i], kids[i], tokens[b], generator)
            return _sampled_step(target_probs[b, i], draft_probs[b, i], kids[i], tokens[b], generator)

        settled = [settle(i) for i in range(N)] if every_node else None
        path = [0]
        while True:
            child, y = settled[path[-1]] if every_node else settle(path[-1])
            if child is None:
                break
            path.append(child)
        rows.append(([tokens[b][j] for j in path[1:]] + [y], path))
    return _pad(rows, draft_tokens.device)


def _greedy_step(p, kids, tokens):
    y = int(p.argmax())
    return next((j for j in kids if tokens[j] == y), None), y


def _deterministic_step(p, kids, tokens, generator):
    y = int(sample(p, generator))
    return next((j for j in kids if tokens[j] == y), None), y


def _sampled_step(p, q, kids, tokens, generator):
    r, q = p.double(), q.double()
    for j in kids:
        u = torch.rand((), dtype=torch.float64, device=p.device, generator=generator)
        if u * q[tokens[j]] < r[tokens[j]]:
            return j, None
        residual = (r - q).clamp(min=0)
        mass = residual.sum()
        if mass > 0:  # no mass left means r == q: the rejection had probability 0, keep r
            r = residual / mass
    return None, int(sample(r, generator))


def _pad(rows, device):
    width = max(len(path) for _, path in rows)
    tokens = torch.full((len(rows), width), -1, dtype=torch.long)
    path = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, (toks, nodes) in enumerate(rows):
        tokens[b, : len(toks)] = torch.tensor(toks)
        path[b, : len(nodes)] = torch.tensor(nodes)
    return tokens.to(device), (path >= 0).sum(-1).to(device), path.to(device)


def random_tree_case(B, N, V, *, depth=7, n_favourites=16, device="cpu", seed=0):
    """Per-row dynamic-tree-like trees with their target/draft distributions, fp32."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.stack([_random_parents(N, depth, gen) for _ in range(B)])  # [B, N]
    # drafter: a few favourite tokens far above a noise floor; the target agrees up to noise
    favourites = torch.rand(B, N, V, generator=gen).topk(n_favourites, dim=-1).indices  # [B, N, F]
    boost = 14.0 - 0.5 * torch.arange(n_favourites, dtype=torch.float32)
    q = torch.empty(B, N, V)
    p = torch.empty(B, N, V)
    for b in range(B):  # one row at a time keeps the temporaries small at V = 49152
        logits = torch.randn(N, V, generator=gen).scatter_add_(1, favourites[b], boost.expand(N, -1))
        q[b] = logits.softmax(-1)
        p[b] = (logits + 0.5 * torch.randn(N, V, generator=gen)).softmax(-1)
    # each node's children take its favourites in order: distinct sibling tokens
    sibling_rank = _sibling_rank(parents)  # [B, N]
    parent = parents.clamp(min=0)
    tokens = favourites[torch.arange(B)[:, None], parent, sibling_rank.clamp(max=n_favourites - 1)]
    tokens[:, 0] = 0
    return tokens.to(device), parents.to(device), p.to(device), q.to(device)


def _random_parents(N, depth, gen):
    """Layers 1..depth of about equal width, each node's parent drawn from the layer above."""
    depth = min(depth, N - 1)
    widths = [len(chunk) for chunk in torch.arange(N - 1).chunk(depth)]
    parents, layer = [-1], [0]
    for width in widths:
        first = len(parents)
        picks = torch.randint(len(layer), (width,), generator=gen).sort().values
        parents += [layer[i] for i in picks.tolist()]
        layer = list(range(first, first + width))
    return torch.tensor(parents)


def _sibling_rank(parents):
    same_parent = parents[:, :, None] == parents[:, None, :]  # [B, N, N]
    earlier = torch.ones_like(same_parent[0]).tril(-1)
    return (same_parent & earlier).sum(-1)


def median_ms(fn, repeats, device):
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def bench(device, batches, nodes, vocab, repeats):
    rows = []
    for N in nodes:
        for B in batches:
            tokens, parents, p, q = random_tree_case(B, N, vocab, device=device)
            for rule in RULES:
                kwargs = {"draft_probs": q if rule == "sampled" else None, "greedy": rule == "greedy"}
                gen = torch.Generator(device=device).manual_seed(0)
                timed = {name: median_ms(lambda: fn(tokens, parents, p, generator=gen, **kwargs), repeats, device)
                         for name, fn in IMPLEMENTATIONS.items()}
                rows.append({"B": B, "N": N, "rule": rule, "loop ms": timed["loop"],
                             "vectorized ms": timed["vectorized"], "ratio": timed["loop"] / timed["vectorized"],
                             "walk-loop ms": timed["walk"], "ratio vs walk": timed["walk"] / timed["vectorized"]})
            del tokens, parents, p, q
    bc.print_table(rows, title=f"\n{bc.machine()}  device={device.type}  V={vocab}  fp32  "
                               f"median of {repeats} repeats")
    return rows


IMPLEMENTATIONS = {
    "loop": loop_verify_tree,
    "walk": functools.partial(loop_verify_tree, every_node=False),
    "vectorized": verify_tree,
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 60])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.nodes, args.vocab, args.repeats = [1, 4], [8, 16], 1000, 1
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        rows = bench(device, args.batches, args.nodes, args.vocab, args.repeats)
    B, N = max(args.batches), max(args.nodes)
    top = next(r for r in rows if (r["B"], r["N"], r["rule"]) == (B, N, "topk"))
    print(f"top-k rule at B={B}, N={N}: {top['ratio vs walk']:.1f}x faster than a loop over visited nodes only")
    bc.headline(top["ratio"], f"headline: verify_tree vs the per-node loop at B={B}, N={N} "
                              f"(top-k children rule, {devices[-1].type})")


if __name__ == "__main__":
    main()
