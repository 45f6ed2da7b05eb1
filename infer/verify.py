"""Lossless verification of a draft tree against the target's distributions.

Lossless: the emitted tokens follow the target's distribution exactly, whatever the drafter proposes
(speculative sampling, Leviathan et al. 2023 and Chen et al. 2023; tree verification, SpecInfer, Miao
et al. 2024).

One call verifies a whole batch of trees in one pass over their depth. Three rules:

- deterministic children (draft_probs=None; the drafter's top-k, as EAGLE-2/3 and Medusa trees):
  y ~ p at the current node, descend into the child whose token equals y, emit the accepted path
  plus the y of the last node. A child is matched with prob. p[child], so instead of drawing y over
  the whole vocabulary at every node, y is drawn "children first": one uniform picks a child in
  O(#children), and only the node where the walk stops draws from p with its children removed.
  The law of y is exactly p either way.
- sampled children (draft_probs given; SpecInfer, children drawn i.i.d. with replacement from
  q = draft_probs[:, parent]): siblings in index order, fresh uniform per sibling, accept c when
  u * q[c] < r[c], else r = normalize(max(r - q, 0)); the stopping node emits y ~ r.
- greedy: descend while a child is its parent's argmax; emit the argmax of the last node.

Randomness: float64 uniforms from `generator`, drawn per depth for the whole batch, so a row's
outcome depends on the batch it was verified in (same seed and same batch -> same output).
"""

import math

import torch

from headway.heads.sampling import argmax, sample


def verify_tree(
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify B draft trees of N nodes; returns (tokens [B, D+1], num_tokens [B], path [B, D+1]).

    draft_tokens: [B, N] node 0 is the root (the last committed token), 1..N-1 are drafts. A node
        with token -1 is never accepted: pad rows with smaller trees with -1 nodes.
    parents: [N] (one tree for the batch) or [B, N] (a tree per row); parents[0] = -1,
        parents[i] < i. A chain is parents = [-1, 0, 1, 2, ...].
    target_probs: [B, N, V] the target's warped next-token distribution after each node's path;
        rows are taken as normalised (the output of `warp_probs`).
    draft_probs: None -> deterministic children (siblings should carry distinct tokens; a repeated
        sibling token is never accepted). [B, N, V] -> the children of node i were sampled i.i.d.
        from draft_probs[:, i] (SpecInfer rule, repeated sibling tokens allowed).
    greedy: accept while a child equals its parent's argmax (ties: lowest index, as torch.argmax);
        no randomness, and target_probs may as well be logits.

    D is the tree's maximum depth. tokens[b, :num_tokens[b]] are the accepted drafts then one token
    drawn from the last node's residual (the bonus token after a full path), padded with -1.
    path[b, :num_tokens[b]] are the accepted node indices starting with the root 0, so tokens[b, k]
    was drawn from target_probs[b, path[b, k]]; padded with -1. num_tokens >= 1.

    Invalid input raises one ValueError naming the problem: shapes, an empty batch, non-integer tokens
    or parents, token ids outside [0, V) (other than -1), draft and target vocabularies that differ,
    and probabilities the rule reads that are NaN, infinite or negative at a drafted child (for a
    sampled child also a draft probability of 0: it cannot have been drawn), or NaN / infinite in a row
    it samples from. Greedy refuses a NaN row (it has no argmax).
    """
    tree = _Tree(draft_tokens, parents)
    _check_probs(tree, target_probs, "target_probs")
    if greedy:
        rule = _Greedy(tree, target_probs)
    elif draft_probs is None:
        rule = _DeterministicChildren(tree, target_probs, generator)
    else:
        _check_probs(tree, draft_probs, "draft_probs")
        if draft_probs.shape != target_probs.shape:
            raise ValueError(f"draft_probs {tuple(draft_probs.shape)} and target_probs {tuple(target_probs.shape)} "
                             f"must have the same shape: draft and target must share one vocabulary")
        rule = _SampledChildren(tree, target_probs, draft_probs, generator)
    return _walk(tree, rule)


class _Tree:
    """Batched parent-array trees: tokens, parents [B, N], and the maximum depth D."""

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor):
        if tokens.dim() != 2:
            raise ValueError(f"draft_tokens must be [B, N], got shape {tuple(tokens.shape)}")
        B, N = tokens.shape
        if B == 0 or N == 0:
            raise ValueError(f"draft_tokens is empty ({B} rows of {N} nodes): pass at least one row with its root")
        _require_integers(tokens, "draft_tokens")
        _require_integers(parents, "parents")
        if parents.shape not in ((N,), (B, N)):
            raise ValueError(f"parents must be [N] or [B, N] = [{B}, {N}], got {tuple(parents.shape)}")
        parents = parents.to(device=tokens.device, dtype=torch.long).expand(B, N)
        node = torch.arange(N, device=tokens.device)
        bad = (parents[:, 0] != -1).any() | (parents[:, 1:] < 0).any() | (parents[:, 1:] >= node[1:]).any()
        if bool(bad):
            raise ValueError("parents must have parents[0] = -1 and 0 <= parents[i] < i for i >= 1")
        self.tokens, self.parents = tokens, parents
        self.batch, self.nodes = B, N
        self.rows = torch.arange(B, device=tokens.device)
        self.real = tokens >= 0  # [B, N] padding nodes (-1) are never accepted
        self.max_depth = int(_depths(parents).max())

    def children_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """[B] node per row -> [B, N] mask of that node's real children."""
        return (self.parents == nodes[:, None]) & self.real

    def at(self, probs: torch.Tensor, nodes: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """probs [B, N, V] at each row's node -> [R, V] (all rows, or the given rows)."""
        rows = self.rows if rows is None else rows
        if probs.is_contiguous():  # index_select on a flat view is ~10x faster than probs[rows, nodes]
            return probs.view(-1, probs.shape[-1]).index_select(0, rows * self.nodes + nodes)
        return probs[rows, nodes]

    def prob_under_parent(self, probs: torch.Tensor) -> torch.Tensor:
        """[B, N, V] -> [B, N] float64: probs[b, parent(j), token(j)], the chance node j's token had."""
        parent = self.parents.clamp(min=0)
        return probs[self.rows[:, None], parent, self.tokens.clamp(min=0)].double()


def _depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] depth of every node by pointer jumping: log2(N) gathers instead of a loop over nodes."""
    depth = (parents >= 0).long()  # distance to the node `up` points at
    up = parents.clamp(min=0)  # the root points at itself with distance 0
    for _ in range(math.ceil(math.log2(max(parents.shape[-1], 2)))):
        depth = depth + depth.gather(1, up)
        up = up.gather(1, up)
    return depth


# ------------------------------------------------------------------------------- input checks
# Cheap by design: shapes, dtypes and token ids are O(B * N); probability values are checked where a
# rule reads them one by one (a node's children: O(B * N)); a row the walk samples from is judged by
# the sums the sampler computes anyway (NaN or infinity anywhere makes them non-finite), so no extra
# pass over [B, N, V] or even [B, V] is made.

def _require_integers(x: torch.Tensor, name: str) -> None:
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers (a long tensor), got {x.dtype}")


def _check_probs(tree: _Tree, probs: torch.Tensor, name: str) -> None:
    if probs.dim() != 3 or probs.shape[:2] != (tree.batch, tree.nodes):
        raise ValueError(f"{name} must be [B, N, V] with B, N = {tree.batch}, {tree.nodes}, "
                         f"got {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {probs.dtype}")
    low, high = tree.tokens.aminmax()
    if int(low) < -1 or int(high) >= probs.shape[-1]:
        raise ValueError(f"draft_tokens must be token ids in [0, V) = [0, {probs.shape[-1]}) or -1 (padding), "
                         f"found {int(low) if int(low) < -1 else int(high)}")


def _check_at_children(tree: _Tree, values: torch.Tensor, name: str, positive: bool = False) -> None:
    """values [B, N] float64 = probs[b, parent(j), token(j)]: finite and >= 0 (> 0) at every real child."""
    ok = torch.isfinite(values) & ((values > 0) if positive else (values >= 0))
    bad = tree.real & ~ok
    bad[:, 0] = False  # the root is no child
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        wanted = "finite and > 0 (a child is drawn from it)" if positive else "finite and >= 0"
        raise ValueError(f"{name} at the token of node {j} (row {b}) is {float(values[b, j])}: probabilities "
                         f"must be {wanted}; pass warp_probs of finite logits")


def _sample_row(rows: torch.Tensor, generator, name: str = "target_probs") -> torch.Tensor:
    """sample() of the rows the walk stopped at, its mass check worded for the verifier's caller."""
    try:
        return sample(rows, generator)
    except ValueError:
        raise ValueError(f"{name} holds NaN or infinite values (or no mass) in a row the verifier samples "
                         f"from: pass warp_probs of finite logits") from None


def _walk(tree: _Tree, rule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Descend from the root one depth at a time; rule.pick chooses each row's child or stops it."""
    B, D = tree.batch, tree.max_depth
    cur = torch.zeros(B, dtype=torch.long, device=tree.tokens.device)  # the node each row stands on
    alive = torch.ones(B, dtype=torch.bool, device=cur.device)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=cur.device)  # [B, D+1]
    path[:, 0] = 0
    for depth in range(1, D + 1):
        kids = tree.children_of(cur) & alive[:, None]  # [B, N]
        child = rule.pick(cur, kids)  # [B] node index, -1 where the row stops
        alive = child >= 0
        cur = torch.where(alive, child, cur)
        path[:, depth] = child
    final = rule.final(cur)  # [B] the token drawn at the last node
    num_tokens = (path >= 0).sum(-1)  # accepted drafts + 1
    accepted = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), -1)  # [B, D+1]
    tokens = torch.cat([accepted[:, 1:], torch.full_like(accepted[:, :1], -1)], dim=1)  # drop the root
    tokens.scatter_(1, (num_tokens - 1)[:, None], final[:, None])
    return tokens, num_tokens, path


class _DeterministicChildren:
    """y ~ p at each node, descend into the child whose token is y (q_i = one-hot(c_i))."""

    def __init__(self, tree: _Tree, target_probs: torch.Tensor, generator: torch.Generator | None):
        self.tree, self.p, self.generator = tree, target_probs, generator
        # a repeated sibling token is matched by its first occurrence only: the later ones get no mass
        same_token = tree.tokens[:, :, None] == tree.tokens[:, None, :]  # [B, N, N]
        siblings = tree.parents[:, :, None] == tree.parents[:, None, :]
        repeated = (same_token & siblings).tril(-1).any(-1)  # [B, N] an earlier sibling has my token
        p_kid = tree.prob_under_parent(target_probs)  # [B, N] float64
        _check_at_children(tree, p_kid, "target_probs")
        self.kid_prob = p_kid.masked_fill(repeated, 0.0)

    def pick(self, cur: torch.Tensor, kids: torch.Tensor) -> torch.Tensor:
        # inverse CDF of y ~ p with the children laid out first: y is child j with prob. p[c_j],
        # and none of them with the remaining mass (only then is the vocabulary needed: final)
        cdf = torch.where(kids, self.kid_prob, 0.0).cumsum(-1)  # [B, N]
        u = torch.rand(cur.shape[0], 1, dtype=torch.float64, device=cur.device, generator=self.generator)
        first_past = (cdf <= u).sum(-1)  # [B] the first child whose cdf passes u; N if y is no child
        return torch.where(first_past < self.tree.nodes, first_past, -1)

    def final(self, cur: torch.Tensor) -> torch.Tensor:
        # no child was y: y ~ p restricted to the non-children
        kid_mass = torch.where(self.tree.children_of(cur), self.kid_prob, 0.0).to(self.p.dtype)  # [B, N]
        token = self.tree.tokens.clamp(min=0)
        rest = self.tree.at(self.p, cur).scatter_add_(1, token, -kid_mass)  # [B, V]; p[c] - p[c] = 0
        # children holding all of p leave "no child" to rounding error; y ~ p is exact there too
        no_rest = rest.sum(-1, keepdim=True) == 0
        rest.scatter_add_(1, token, kid_mass * no_rest)
        return _sample_row(rest, self.generator)


class _SampledChildren:
    """SpecInfer: siblings drawn i.i.d. from q; accept c if u * q[c] < r[c], else r <- (r - q)+.

    The residual after k rejections is r_k = (p - a_k q)+ / S_k with a_0 = 0, S_0 = 1 and
    a_{k+1} = a_k + S_k, S_k = sum (p - a_k q)+, so one float64 scalar per row carries it and the
    acceptance test needs only p[c], q[c]: u * q[c] * S_k < (p[c] - a_k q[c])+ in float64. The
    vocabulary-wide residual is computed in p's dtype, like p itself.
    """

    def __init__(self, tree: _Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator):
        self.tree, self.p, self.q, self.generator = tree, target_probs, draft_probs, generator
        self.p_kid = tree.prob_under_parent(target_probs)  # [B, N] float64
        self.q_kid = tree.prob_under_parent(draft_probs)
        _check_at_children(tree, self.p_kid, "target_probs")
        _check_at_children(tree, self.q_kid, "draft_probs", positive=True)
        self.a = torch.zeros(tree.batch, dtype=torch.float64, device=target_probs.device)  # at the stop

    def pick(self, cur: torch.Tensor, kids: torch.Tensor) -> torch.Tensor:
        B = self.tree.batch
        rank = kids.cumsum(-1)  # [B, N] 1-based sibling rank at kids
        n_kids = rank[:, -1]
        a = torch.zeros_like(self.a)  # residual r = p at a fresh node
        S = torch.ones_like(self.a)
        child = torch.full((B,), -1, dtype=torch.long, device=cur.device)
        searching = n_kids > 0
        for k in range(int(n_kids.max())):
            sibling = (kids & (rank == k + 1)).long().argmax(-1)  # [B] node of the k-th sibling
            pc, qc = self.p_kid.gather(1, sibling[:, None])[:, 0], self.q_kid.gather(1, sibling[:, None])[:, 0]
            u = torch.rand(B, dtype=torch.float64, device=cur.device, generator=self.generator)
            accept = searching & (u * qc * S < (pc - a * qc).clamp(min=0))
            child = torch.where(accept, sibling, child)
            rejected = searching & ~accept
            a, S = self._next_residual(cur, rejected, a, S)
            searching = rejected & (n_kids > k + 1)
        # only a row that rejected every sibling stops with a residual other than p (a = 0)
        self.a = torch.where(kids.any(-1) & (child < 0), a, self.a)
        return child

    def _next_residual(self, cur, rejected, a, S):
        """r <- normalize(max(r - q, 0)) on the rejected rows: the only O(V) work of the rule."""
        rows = rejected.nonzero().squeeze(1)
        if rows.numel() == 0:
            return a, S
        a_next = a[rows] + S[rows]
        S_next = self._residual(cur[rows], rows, a_next).sum(-1).double()
        if not bool(torch.isfinite(S_next).all()):  # NaN or +inf in p or q at the node: no residual law
            raise ValueError("target_probs or draft_probs hold NaN or infinite values in a row the verifier "
                             "samples from: pass warp_probs of finite logits")
        # S_next == 0 means r == q: that rejection had probability 0 (float rounding), so the
        # conditional law is still r; keep it rather than divide by zero or restart from p
        keep = S_next > 0
        a, S = a.clone(), S.clone()
        a[rows] = torch.where(keep, a_next, a[rows])
        S[rows] = torch.where(keep, S_next, S[rows])
        return a, S

    def _residual(self, nodes, rows, a):
        """(p - a q)+ [R, V] at the rows' nodes, unnormalised; in place on the gathered copies."""
        p, q = self.tree.at(self.p, nodes, rows), self.tree.at(self.q, nodes, rows)
        return p.sub_(q.mul_(a[:, None].to(q.dtype))).clamp_(min=0)

    def final(self, cur: torch.Tensor) -> torch.Tensor:
        residual = self.tree.at(self.p, cur)  # [B, V] residual p (a = 0) unless a sibling was rejected
        rows = (self.a > 0).nonzero().squeeze(1)
        residual[rows] = self._residual(cur[rows], rows, self.a[rows])
        return _sample_row(residual, self.generator)


class _Greedy:
    """Descend while a child's token is the argmax of its parent's p; emit the last argmax."""

    def __init__(self, tree: _Tree, target_probs: torch.Tensor):
        self.tree, self.p = tree, target_probs
        self.best = torch.full((tree.batch,), -1, dtype=torch.long, device=target_probs.device)

    def pick(self, cur: torch.Tensor, kids: torch.Tensor) -> torch.Tensor:
        self._argmax_at(cur, kids.any(-1))  # only where there is a child to compare
        match = kids & (self.tree.tokens == self.best[:, None])  # [B, N]
        child = torch.where(match.any(-1), match.long().argmax(-1), -1)
        self.best = torch.where(child >= 0, -1, self.best)  # the argmax of a new node is unknown
        return child

    def final(self, cur: torch.Tensor) -> torch.Tensor:
        self._argmax_at(cur, self.best < 0)
        return self.best

    def _argmax_at(self, cur: torch.Tensor, need: torch.Tensor) -> None:
        rows = need.nonzero().squeeze(1)
        if rows.numel():
            scores = self.tree.at(self.p, cur[rows], rows)  # [R, V]
            best = argmax(scores)  # ties: lowest index; a NaN wins, so one gather finds any NaN in the row
            if bool(torch.isnan(scores.gather(1, best[:, None])).any()):
                raise ValueError("target_probs holds NaN in a row greedy verification reads: there is no argmax; "
                                 "pass finite logits or probabilities")
            self.best[rows] = best
