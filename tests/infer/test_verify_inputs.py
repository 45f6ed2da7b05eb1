"""verify_tree refuses what it cannot verify losslessly, with one ValueError naming the problem, instead of
accepting a draft, emitting token 0 or raising IndexError deep inside."""

import pytest
import torch

from headway.infer.verify import verify_tree

torch.set_num_threads(1)

V = 8
STAR = torch.tensor([-1, 0, 0, 0])  # a root and three children
TOKENS = torch.tensor([[5, 1, 2, 3]])  # [1, 4]


def probs(B: int = 1, N: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.rand(B, N, V, generator=torch.Generator().manual_seed(seed)).softmax(-1)


def run(rule: str, tokens=TOKENS, parents=STAR, p=None, q=None):
    p = probs() if p is None else p
    if rule == "sampled":
        q = probs(seed=1) if q is None else q
    return verify_tree(tokens, parents, p, q if rule == "sampled" else None, greedy=rule == "greedy",
                       generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rule", ["topk", "sampled"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.25])
def test_invalid_target_probability_at_a_drafted_child_is_refused(rule, bad):
    p = probs()
    p[0, 0, 2] = bad  # node 2 drafts token 2 under the root
    with pytest.raises(ValueError, match="target_probs at the token of node 2 \\(row 0\\)"):
        run(rule, p=p)


@pytest.mark.parametrize("rule", ["topk", "sampled"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_invalid_target_probability_where_the_walk_stops_is_refused(rule, bad):
    p = probs()
    p[0, 0] = 0.0
    p[0, 0, 7] = 1.0  # no child is token 7: the walk stops at the root and samples from this row
    p[0, 0, 6] = bad
    with pytest.raises(ValueError, match="target_probs.* NaN or infinite values .*in a row the verifier samples"):
        run(rule, p=p)


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")])
def test_invalid_probability_in_a_residual_row_is_refused(bad):
    """A rejected sampled child leaves the residual (p - q)+: NaN there used to keep the old law silently."""
    p, q = probs(), probs(seed=1)
    p[0, 0, 1:4] = 0.0  # every child is rejected (u * q < 0 never holds) ...
    q[0, 0, 6] = bad  # ... and the residual meets the bad draft value
    with pytest.raises(ValueError, match="draft_probs hold NaN or infinite values in a row the verifier samples"):
        run("sampled", p=p, q=q)


def test_zero_draft_mass_at_a_sampled_child_is_refused():
    """All-zero draft_probs used to accept the whole chain: a child drawn from q must have q > 0."""
    with pytest.raises(ValueError, match="draft_probs at the token of node 1 .* > 0"):
        run("sampled", q=torch.zeros(1, 4, V))


def test_nan_draft_probabilities_are_refused():
    q = probs(seed=1)
    q[0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="draft_probs at the token of node 3"):
        run("sampled", q=q)


def test_greedy_over_a_nan_row_is_refused_not_token_0():
    with pytest.raises(ValueError, match="NaN in a row greedy verification reads"):
        run("greedy", p=torch.full((1, 4, V), float("nan")))
    p = probs()
    p[0, 0, 6] = float("nan")  # one NaN is enough: the row has no argmax
    with pytest.raises(ValueError, match="NaN"):
        run("greedy", p=p)


def test_greedy_accepts_logits_with_minus_infinity():
    logits = torch.full((1, 4, V), float("-inf"))
    logits[..., 2] = 1.0  # the root's argmax is token 2 = node 2's token
    tokens, num, path = run("greedy", p=logits)
    assert path[0, :2].tolist() == [0, 2] and tokens[0, :2].tolist() == [2, 2]


@pytest.mark.parametrize("rule", ["topk", "sampled", "greedy"])
@pytest.mark.parametrize("tokens, parents, message", [
    (TOKENS, STAR.float(), "parents must hold integers"),
    (TOKENS.float(), STAR, "draft_tokens must hold integers"),
    (torch.tensor([[5, 1, 2, V]]), STAR, f"token ids in \\[0, V\\) = \\[0, {V}\\).*found {V}"),
    (torch.tensor([[5, 1, -2, 3]]), STAR, "found -2"),
    (torch.zeros(0, 4, dtype=torch.long), STAR, "draft_tokens is empty"),
])
def test_malformed_trees_are_refused(rule, tokens, parents, message):
    B = tokens.shape[0]
    with pytest.raises(ValueError, match=message):
        run(rule, tokens=tokens, parents=parents, p=probs(B=B), q=probs(B=B, seed=1))


def test_draft_and_target_vocabularies_must_match():
    q = torch.rand(1, 4, V + 3).softmax(-1)
    with pytest.raises(ValueError, match="must have the same shape"):
        run("sampled", q=q)


@pytest.mark.parametrize("rule", ["topk", "sampled", "greedy"])
def test_valid_edge_cases_still_verify(rule):
    """Zeros in p at a child (top-k/top-p warping) and a padded child are valid input."""
    p = probs()
    p[0, 0, 1] = 0.0
    tokens = torch.tensor([[5, 1, 2, -1]])
    out, num, path = run(rule, tokens=tokens, p=p / p.sum(-1, keepdim=True))
    assert int(num[0]) >= 1 and (path[0] != 1).all() and (path[0] != 3).all()
