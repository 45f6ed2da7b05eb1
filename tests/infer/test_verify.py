"""verify_tree is lossless.

- the first emitted token follows p: V = 16, Dirichlet(0.3 / 1 / 3) target and draft, a chain of 3,
  a star of 4 and a two-level tree, 10^6 verifications batched; chi-square p-value > 1e-4, TV < 0.004
- adversarial p and q (zeros, disjoint support, p == q, one-hots, repeated siblings, T = 0.05)
- end to end: a toy target and drafter over 3 tokens of a 5-token vocabulary, the full speculative
  loop, the 125-outcome joint law against the exact one; a verifier reading its parent's
  probabilities fails the same statistic (negative control)
- greedy equals sequential argmax; same seed, same output; a batch equals its rows one by one and
  the per-node loop of scripts/bench_verify.py
"""

from pathlib import Path

import pytest
import torch
from test_sampling import law_pvalue, total_variation

from headway.heads.sampling import sample, warp_probs
from headway.infer.verify import verify_tree

torch.set_num_threads(1)

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
V = 16
SAMPLES = 1_000_000
CHUNK = 100_000  # rows per verify_tree call
TREES = {
    "chain3": [-1, 0, 1, 2],
    "star4": [-1, 0, 0, 0, 0],
    "two_levels": [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3],
}


@pytest.fixture(scope="module")
def loop_verify_tree():
    """The per-row, per-node reference of the benchmark, as an oracle."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(SCRIPTS))
        from bench_verify import loop_verify_tree

        return loop_verify_tree


def dirichlet(alpha: float, shape: tuple, seed: int, size: int = V) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.distributions.Dirichlet(torch.full((size,), float(alpha))).sample(shape).float()


def sibling_rank(parents: torch.Tensor) -> torch.Tensor:
    """[..., N] -> how many earlier nodes share each node's parent."""
    same = parents[..., :, None] == parents[..., None, :]
    return (same & torch.ones_like(same).tril(-1)).sum(-1)


def ranked(q: torch.Tensor) -> torch.Tensor:
    """Tokens by decreasing draft probability [..., V]: a top-k drafter's children, in order."""
    return q.argsort(dim=-1, descending=True, stable=True)


def draft(parents: torch.Tensor, q: torch.Tensor, rows: int, sampled: bool, gen) -> torch.Tensor:
    """Draft tokens [rows, N] for one tree with per-node draft laws q [N, V]: the children of node i
    are i.i.d. draws from q[i] (sampled) or q[i]'s top tokens in order (distinct siblings)."""
    if sampled:
        kids = sample(q[parents[1:]].expand(rows, -1, -1), gen)  # [rows, N-1]
    else:
        kids = ranked(q)[parents[1:], sibling_rank(parents)[1:]].expand(rows, -1)
    return torch.cat([torch.zeros(rows, 1, dtype=torch.long), kids], 1)


def verify_many(parents, p, q, *, sampled, n=SAMPLES, seed=0, tokens=None, judge_q=None):
    """First emitted token and num_tokens of n verifications (a multiple of CHUNK, or fewer) of one
    tree with per-node p, q [N, V].

    tokens: fixed draft tokens [N] instead of drafting; judge_q: the draft_probs the verifier is
    told (default: q when sampled, else None)."""
    parents = torch.as_tensor(parents)
    gen = torch.Generator().manual_seed(seed)
    judge_q = (q if sampled else None) if judge_q is None else judge_q
    rows = min(CHUNK, n)
    # the same laws for every row, laid out as the engine's contiguous [B, N, V]
    p, judge_q = (None if x is None else x.expand(rows, -1, -1).contiguous() for x in (p, judge_q))
    first, num = [], []
    for _ in range(n // rows):
        drafts = draft(parents, q, rows, sampled, gen) if tokens is None else tokens.expand(rows, -1)
        out, n_tok, _ = verify_tree(drafts, parents, p, judge_q, generator=gen)
        first.append(out[:, 0])
        num.append(n_tok)
    return torch.cat(first), torch.cat(num)


def assert_follows(samples: torch.Tensor, probs: torch.Tensor) -> None:
    pvalue, tv = law_pvalue(samples, probs), total_variation(samples, probs)
    assert pvalue > 1e-4 and tv < 0.004, f"p-value {pvalue:.2e}, TV {tv:.4f}"


# ------------------------------------------------------------------------ first token ~ p, both rules

MAIN = [("topk", "chain3", 0.3), ("topk", "star4", 1.0), ("topk", "two_levels", 3.0),
        ("sampled", "chain3", 3.0), ("sampled", "star4", 0.3), ("sampled", "two_levels", 1.0)]
CROSS = [(rule, tree, alpha) for rule in ("topk", "sampled") for tree in TREES for alpha in (0.3, 1.0, 3.0)]


@pytest.mark.parametrize("rule, tree, alpha", MAIN + [
    pytest.param(*case, marks=pytest.mark.slow) for case in CROSS if case not in MAIN])
def test_first_token_follows_p(rule, tree, alpha):
    N = len(TREES[tree])
    p, q = dirichlet(alpha, (N,), seed=1), dirichlet(alpha, (N,), seed=2)
    first, num = verify_many(TREES[tree], p, q, sampled=rule == "sampled")
    assert_follows(first, p[0])
    assert (num > 1).any()  # drafts were accepted: the test exercised acceptance, not just residuals


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_chain_acceptance_rate_is_exact(rule):
    # one draft: accepted with prob. p(c) for a fixed child, sum min(p, q) for a child drawn from q
    p, q = dirichlet(1.0, (4,), seed=3), dirichlet(1.0, (4,), seed=4)
    _, num = verify_many(TREES["chain3"], p, q, sampled=rule == "sampled", n=3 * CHUNK)
    expected = p[0, q[0].argmax()] if rule == "topk" else torch.minimum(p[0], q[0]).sum()
    rate = (num > 1).double().mean()
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / num.numel()) ** 0.5


# ------------------------------------------------------------------------ adversarial p and q


def warped(seed: int, N: int, **warp) -> torch.Tensor:
    logits = torch.randn(N, V, generator=torch.Generator().manual_seed(seed)) * 2
    return warp_probs(logits, **warp)


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_zeros_in_p_from_top_k_and_top_p(rule):
    N = len(TREES["two_levels"])
    p = torch.cat([warped(5, 4, temperature=1.0, top_k=3), warped(6, N - 4, temperature=1.0, top_p=0.6)])
    q = dirichlet(1.0, (N,), seed=7)  # proposes tokens p rules out
    first, _ = verify_many(TREES["two_levels"], p, q, sampled=rule == "sampled")
    assert_follows(first, p[0])


def test_draft_without_support_where_p_has_mass():
    q = torch.zeros(5, V)
    q[:, :4] = dirichlet(1.0, (5,), seed=8, size=4)  # q = 0 on 12 of the 16 tokens
    p = dirichlet(1.0, (5,), seed=9)
    first, _ = verify_many(TREES["star4"], p, q, sampled=True)
    assert_follows(first, p[0])


def test_draft_equal_to_target_always_accepts_the_first_sibling():
    p = dirichlet(0.3, (5,), seed=10)
    first, num = verify_many(TREES["star4"], p, p, sampled=True)
    assert (num == 2).all()  # u * q(c) < p(c) for every u < 1
    assert_follows(first, p[0])


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_one_hot_target(rule):
    p = dirichlet(1.0, (5,), seed=11)
    q = dirichlet(1.0, (5,), seed=12)
    token = ranked(q[0])[1]  # the root's second child under top-k
    p[0] = 0
    p[0, token] = 1
    first, _ = verify_many(TREES["star4"], p, q, sampled=rule == "sampled", n=CHUNK)  # no chance left
    assert (first == token).all()


def test_one_hot_draft_repeats_every_sibling():
    q = torch.zeros(5, V)
    q[:, 7] = 1  # every sibling is token 7
    p = dirichlet(1.0, (5,), seed=13)
    first, num = verify_many(TREES["star4"], p, q, sampled=True)
    assert_follows(first, p[0])
    assert abs((num > 1).double().mean() - p[0, 7]) < 0.005  # one chance only: min(p, q)(7)


def test_repeated_sibling_tokens():
    # sampled: a peaked q makes repeats common; top-k: repeats are outside the contract but harmless
    p, peaked = dirichlet(1.0, (5,), seed=14), dirichlet(0.1, (5,), seed=15)
    first, _ = verify_many(TREES["star4"], p, peaked, sampled=True)
    assert_follows(first, p[0])
    first, _ = verify_many(TREES["star4"], p, peaked, sampled=False, tokens=torch.tensor([0, 3, 3, 9, 3]))
    assert_follows(first, p[0])


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_low_temperature(rule):
    N = len(TREES["two_levels"])
    p, q = warped(16, N, temperature=0.05), warped(17, N, temperature=0.05)
    p[0] = warp_probs(torch.tensor([3.0, 2.99, 2.98] + [0.0] * (V - 3)), 0.05)  # no token reaches 1
    first, _ = verify_many(TREES["two_levels"], p, q, sampled=rule == "sampled")
    assert_follows(first, p[0])


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_per_row_trees_with_padding(rule):
    # rows mix a star, a chain and a star whose last two children are padding (-1)
    shapes = torch.tensor([[-1, 0, 0, 0, 0], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0]])
    p, q = dirichlet(1.0, (5,), seed=18), dirichlet(1.0, (5,), seed=19)
    gen = torch.Generator().manual_seed(20)
    first = []
    for _ in range(SAMPLES // CHUNK):
        kind = torch.randint(3, (CHUNK,), generator=gen)
        parents = shapes[kind]  # [B, N]
        tokens = torch.cat([draft(shapes[k], q, CHUNK, rule == "sampled", gen)[:, None] for k in range(2)], 1)
        tokens = tokens[torch.arange(CHUNK), (kind == 1).long()]  # drafted for the row's own tree
        tokens[kind == 2, 3:] = -1
        out, num, path = verify_tree(tokens, parents, p.expand(CHUNK, -1, -1),
                                     q.expand(CHUNK, -1, -1) if rule == "sampled" else None, generator=gen)
        assert not ((kind == 2)[:, None] & (path >= 3)).any()  # padding is never accepted
        first.append(out[:, 0])
    assert_follows(torch.cat(first), p[0])


def test_a_lossy_verifier_fails_the_first_token_statistic():
    # negative control: the p/q test applied to deterministic top-k children (lossy: a child that is always proposed is accepted too often)
    p, q = dirichlet(1.0, (5,), seed=21), dirichlet(1.0, (5,), seed=22)
    first, _ = verify_many(TREES["star4"], p, q, sampled=False, judge_q=q, n=3 * CHUNK)
    assert law_pvalue(first, p[0]) < 1e-4 and total_variation(first, p[0]) > 0.004


# ------------------------------------------------------------------------ end to end: the joint law


class ToyLM:
    """p(. | prefix) and q(. | prefix) tables for every prefix of up to 3 tokens of a 5-token vocabulary.

    Prefix ids: length by length, base 5 within a length (1 + 5 + 25 + 125 = 156 ids). child[id, t]
    extends a prefix; a full (length-3) prefix is its own child, so extra committed tokens are ignored.
    """

    V, LENGTH = 5, 3

    def __init__(self, seed: int):
        V, L = self.V, self.LENGTH
        self.full = sum(V**k for k in range(L))  # id of the first length-3 prefix: 31
        n = self.full + V**L
        self.child = torch.arange(n)[:, None].repeat(1, V)
        start = 0
        for k in range(L):
            ids = torch.arange(start, start + V**k)
            self.child[ids] = start + V**k + (ids - start)[:, None] * V + torch.arange(V)
            start += V**k
        self.p = dirichlet(0.5, (n,), seed, size=V)  # the target depends strongly on the prefix
        self.q = 0.6 * self.p + 0.4 * dirichlet(1.0, (n,), seed + 1, size=V)  # a decent drafter
        self.p[0] = torch.tensor([0.1, 0.35, 0.1, 0.35, 0.1])  # a tie for greedy: argmax 1, not 3
        self.q[0] = torch.tensor([0.05, 0.3, 0.05, 0.55, 0.05])  # the drafter prefers 3

    def joint(self) -> torch.Tensor:
        """The exact law [125] of the 3 generated tokens, indexed t1 * 25 + t2 * 5 + t3."""
        t = torch.cartesian_prod(*[torch.arange(self.V)] * self.LENGTH)  # [125, 3]
        prob, prefix = torch.ones(len(t), dtype=torch.float64), torch.zeros(len(t), dtype=torch.long)
        for k in range(self.LENGTH):
            prob *= self.p[prefix, t[:, k]].double()
            prefix = self.child[prefix, t[:, k]]
        return prob

    def greedy(self) -> int:
        prefix = 0
        for _ in range(self.LENGTH):
            prefix = self.child[prefix, self.p[prefix].argmax()]
        return prefix - self.full

    def draft_tree(self, roots, parents, sampled, gen):
        """(prefix ids [R, N], tokens [R, N]) of a draft tree from each root prefix."""
        ids = roots[:, None].repeat(1, len(parents))
        tokens = torch.zeros_like(ids)
        rank = sibling_rank(parents)
        for j in range(1, len(parents)):  # parents come first, so their prefixes are known
            q = self.q[ids[:, parents[j]]]  # [R, V]
            tokens[:, j] = sample(q, gen) if sampled else ranked(q)[:, rank[j]]
            ids[:, j] = self.child[ids[:, parents[j]], tokens[:, j]]
        return ids, tokens

    def generate(self, rows, parents, *, rule, seed=0, verify=verify_tree):
        """Speculative decoding of `rows` sequences of 3 tokens -> outcome index [rows]."""
        parents, gen = torch.tensor(parents), torch.Generator().manual_seed(seed)
        prefix = torch.zeros(rows, dtype=torch.long)
        while (todo := (prefix < self.full).nonzero()[:, 0]).numel():
            ids, tokens = self.draft_tree(prefix[todo], parents, rule != "topk", gen)
            out, num, _ = verify(tokens, parents, self.p[ids], self.q[ids] if rule == "sampled" else None,
                                 greedy=rule == "greedy", generator=gen)
            grown = prefix[todo]
            for k in range(out.shape[1]):  # commit the emitted tokens
                grown = torch.where(k < num, self.child[grown, out[:, k].clamp(min=0)], grown)
            prefix[todo] = grown
        return prefix - self.full


E2E_TREE = [-1, 0, 0, 1, 2, 3]  # two branches, one of them three deep: bonus tokens past the end too


def reads_parents_probs(tokens, parents, target_probs, draft_probs=None, **kwargs):
    """A broken verifier: judges node j with its parent's distribution (an off-by-one node index)."""
    return verify_tree(tokens, parents, target_probs[:, parents.clamp(min=0)], draft_probs, **kwargs)


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_speculative_loop_reproduces_the_joint_law(rule):
    lm = ToyLM(seed=30)
    outcomes = lm.generate(200_000, E2E_TREE, rule=rule)
    assert law_pvalue(outcomes, lm.joint()) > 1e-4


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_a_verifier_reading_the_wrong_node_fails_the_joint_law(rule):
    lm = ToyLM(seed=30)
    outcomes = lm.generate(200_000, E2E_TREE, rule=rule, verify=reads_parents_probs)
    assert law_pvalue(outcomes, lm.joint()) < 1e-4


def test_greedy_speculative_loop_equals_sequential_argmax():
    lm = ToyLM(seed=31)
    outcomes = lm.generate(20_000, E2E_TREE, rule="greedy")
    assert (outcomes == lm.greedy()).all()


# ------------------------------------------------------------------------ exact equalities


def random_trees(B, N, vocab, seed, *, one_hot=False, ties=False):
    """Per-row random trees [B, N] (some -1 padding), tokens that often match the target's argmax."""
    gen = torch.Generator().manual_seed(seed)
    parents = (torch.rand(B, N, generator=gen) * torch.arange(N)).long()  # parents[i] < i
    parents[:, 0] = -1
    if ties:  # few distinct values: many tied maxima, broken towards the lowest index
        scores = torch.randint(0, 4, (B, N, vocab), generator=gen).float()
    else:
        scores = torch.randn(B, N, vocab, generator=gen)
    target = scores.softmax(-1) if not one_hot else warp_probs(scores, 0.0)
    best = scores.argmax(-1).gather(1, parents.clamp(min=0))  # the parent's argmax
    tokens = torch.where(torch.rand(B, N, generator=gen) < 0.6, best, torch.randint(vocab, (B, N), generator=gen))
    tokens[torch.rand(B, N, generator=gen) < 0.1] = -1
    tokens[:, 0] = 0
    draft_probs = torch.rand(B, N, vocab, generator=gen).softmax(-1)
    return tokens, parents, target, draft_probs


def rows_of(tokens, num, path):
    return [(t[:n].tolist(), p[:n].tolist()) for t, n, p in zip(tokens, num, path)]


@pytest.mark.parametrize("rule", ["greedy", "topk", "sampled"])
def test_batch_equals_rows_one_by_one_and_the_loop(rule, loop_verify_tree):
    # greedy, or a one-hot target, leaves no randomness in the outcome
    tokens, parents, target, q = random_trees(48, 12, 40, seed=40, one_hot=rule != "greedy", ties=True)
    kwargs = {"greedy": rule == "greedy", "draft_probs": q if rule == "sampled" else None}
    batch = rows_of(*verify_tree(tokens, parents, target, **kwargs))

    def alone(b):
        one = {k: v[b:b + 1] if torch.is_tensor(v) else v for k, v in kwargs.items()}
        return rows_of(*verify_tree(tokens[b:b + 1], parents[b:b + 1], target[b:b + 1], **one))[0]

    one_by_one = [alone(b) for b in range(len(tokens))]
    assert batch == one_by_one == rows_of(*loop_verify_tree(tokens, parents, target, **kwargs))
    assert max(len(path) for _, path in batch) > 3  # deep paths were exercised


def test_greedy_is_bit_exact_against_sequential_argmax_on_logits_or_probs():
    tokens, parents, _, _ = random_trees(64, 16, 1000, seed=41)
    logits = torch.randn(64, 16, 1000, generator=torch.Generator().manual_seed(42))
    logits[:, :, 500] = logits.amax(-1)  # every node has a tie between its argmax and token 500
    best = logits.argmax(-1)
    tokens = torch.where(tokens >= 0, best.gather(1, parents.clamp(min=0)), -1)  # drafts = argmax
    tokens[::3, 1:] = torch.where(tokens[::3, 1:] >= 0, 500, -1)  # the tied later token: rejected
    out, num, path = verify_tree(tokens, parents, logits, greedy=True)
    for b in range(64):  # sequential argmax along the accepted path
        assert out[b, : num[b]].tolist() == best[b, path[b, : num[b]]].tolist()
    for probs in (logits.softmax(-1), warp_probs(logits, 0.0)):
        assert all(torch.equal(x, y) for x, y in zip(verify_tree(tokens, parents, probs, greedy=True),
                                                      (out, num, path)))


@pytest.mark.parametrize("rule", ["topk", "sampled"])
def test_same_seed_same_output(rule):
    tokens, parents, target, q = random_trees(256, 10, 30, seed=43)
    q = q if rule == "sampled" else None
    def run(seed):
        return verify_tree(tokens, parents, target, q, generator=torch.Generator().manual_seed(seed))

    first, again, other = run(0), run(0), run(1)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_output_layout():
    tokens, parents, target, q = random_trees(200, 14, 30, seed=44)
    out, num, path = verify_tree(tokens, parents, target, q, generator=torch.Generator().manual_seed(0))
    depth = torch.zeros_like(parents)
    for i in range(1, 14):
        depth[:, i] = depth.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0] + 1
    assert out.shape == path.shape == (200, int(depth.max()) + 1)
    assert (num >= 1).all() and (path[:, 0] == 0).all()
    for b in range(200):
        n, nodes = int(num[b]), path[b]
        assert (out[b, n:] == -1).all() and (nodes[n:] == -1).all() and out[b, n - 1] >= 0
        assert (parents[b, nodes[1:n]] == nodes[: n - 1]).all()  # a path down the tree
        assert out[b, : n - 1].tolist() == tokens[b, nodes[1:n]].tolist()  # the accepted drafts


@pytest.mark.parametrize("rule", ["greedy", "topk", "sampled"])
def test_a_root_without_drafts_is_plain_sampling(rule):
    p = dirichlet(1.0, (1,), seed=45).expand(50_000, 1, V).contiguous()
    out, num, path = verify_tree(torch.zeros(50_000, 1, dtype=torch.long), torch.tensor([-1]), p,
                                 p if rule == "sampled" else None, greedy=rule == "greedy",
                                 generator=torch.Generator().manual_seed(0))
    assert out.shape == path.shape == (50_000, 1) and (num == 1).all() and (path == 0).all()
    if rule == "greedy":
        assert (out[:, 0] == p[0, 0].argmax()).all()
    else:
        assert law_pvalue(out[:, 0], p[0, 0]) > 1e-4


@pytest.mark.parametrize("parents, message", [
    (torch.tensor([0, 0, 1]), "parents\\[0\\] = -1"),
    (torch.tensor([-1, 0, 2]), "parents\\[i\\] < i"),
    (torch.tensor([-1, 0]), "parents must be \\[N\\] or \\[B, N\\]"),
])
def test_bad_trees_raise(parents, message):
    with pytest.raises(ValueError, match=message):
        verify_tree(torch.zeros(2, 3, dtype=torch.long), parents, torch.full((2, 3, 4), 0.25))


def test_bad_probs_shape_raises():
    with pytest.raises(ValueError, match="target_probs must be \\[B, N, V\\]"):
        verify_tree(torch.zeros(2, 3, dtype=torch.long), torch.tensor([-1, 0, 1]), torch.full((2, 4, 4), 0.25))
