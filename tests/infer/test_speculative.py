"""Greedy speculative decoding equals plain greedy decoding token for token, for every drafter and every
head kind (fresh, untrained heads: losslessness does not depend on head quality), on a ragged batch."""

import pytest
import torch

from heads.base import build_head
from heads.target import build_tiny_random, load_target
from infer.drafters import DynamicTree, StaticTree, build_drafter
from infer.engine import SpeculativeEngine

NEW = 24


@pytest.fixture(scope="module")
def target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(3, 256, (10,), generator=gen).tolist()
    return [base * 3, base[:4], (base[:3] * 5)[:13]]  # repeats give prompt lookup something to find


@pytest.fixture(scope="module")
def plain(target, prompts):
    return SpeculativeEngine(target).generate(prompts, max_new_tokens=NEW, stop_on_eos=False).tokens


def speculate(target, prompts, drafter, **kw):
    return SpeculativeEngine(target, drafter, block_size=4).generate(prompts, max_new_tokens=NEW,
                                                                     stop_on_eos=False, **kw)


def test_prompt_lookup_is_lossless(target, prompts, plain):
    out = speculate(target, prompts, build_drafter("prompt_lookup", target, gamma=4))
    assert out.tokens == plain


def test_prompt_lookup_finds_the_latest_continuation():
    lookup = build_drafter("prompt_lookup", gamma=3, max_ngram=2)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 9, 1, 5]])
    lookup.reset(prompt, torch.tensor([9]), 32)
    lookup.commit(torch.tensor([[6]]), None, torch.tensor([[8]]), torch.tensor([1]))  # context ends 5, 6
    draft = lookup.propose(torch.tensor([6]), 8)
    assert draft.tokens.tolist() == [[6, 9, 1, 5]]  # the latest "5 6" was followed by 9 1 5


@pytest.mark.parametrize("policy, opts", [("chain", dict(gamma=4)), ("dynamic", dict(total_tokens=12, depth=4, top_k=3)),
                                          ("static", dict(choices=[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]))])
def test_draft_model_equal_to_the_target_accepts_everything(target, prompts, plain, policy, opts):
    out = speculate(target, prompts, build_drafter("draft_model", target, draft_model=target, policy=policy, **opts))
    assert out.tokens == plain
    rates = out.stats.acceptance_by_depth
    assert rates[0] == 1.0  # the target's own top-1 is always its argmax
    if policy != "dynamic":  # fixed shapes keep the argmax path: every depth is accepted
        assert all(r == 1.0 for r in rates)


def test_a_different_draft_model_is_lossless(target, prompts, plain):
    other, _ = build_tiny_random(seed=1)
    assert speculate(target, prompts, build_drafter("draft_model", target, draft_model=other, gamma=3)).tokens == plain


def test_sampled_chain_from_the_target_itself_is_always_accepted(target, prompts):
    drafter = build_drafter("draft_model", target, draft_model=target, gamma=3, sample=True)
    out = speculate(target, prompts[:1], drafter, temperature=1.0, seed=0)
    assert out.stats.acceptance_by_depth[0] > 0.95  # q == p: the SpecInfer rule accepts (up to rounding)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mtp"])
def test_every_head_kind_is_lossless(target, prompts, plain, kind):
    head = build_head(kind, target)
    for policy, opts in [("dynamic", dict(total_tokens=10, depth=3, top_k=3)), ("chain", dict(gamma=3))]:
        out = speculate(target, prompts, build_drafter("head", target, head=head, policy=policy, **opts))
        assert out.tokens == plain, (kind, policy)
        assert out.stats.tau >= 1.0


def test_dynamic_tree_keeps_the_best_candidates_as_a_tree():
    class Table:  # a proposer whose children's log-probs favour token 0, then 1, ...
        max_depth = None

        def expand(self, depth, tokens, parent_hidden, parents, positions):
            logits = -torch.arange(8.0).expand(*tokens.shape, 8) * (1 + tokens[..., None])
            return logits, parent_hidden

    root_logits = -torch.arange(8.0)[None]
    tokens, parents, _ = DynamicTree(total_tokens=6, depth=3, top_k=2).build(
        Table(), torch.tensor([7]), root_logits, torch.zeros(1, 1), 6, torch.tensor([0]), None)
    parents = parents.expand_as(tokens)
    assert tokens.shape == (1, 6) and (parents[:, 1:] < torch.arange(1, 6)).all()
    assert tokens[0, 0] == 7 and set(tokens[0, 1:3].tolist()) == {0, 1}  # depth 1: the top 2


def test_static_tree_from_accuracies_prefers_likely_paths():
    tree = StaticTree.from_accuracies([0.8, 0.6, 0.4], total_nodes=6, top_k=3)
    assert tree.choices[0] == (0,) and tree.choices[1] == (0, 0)
    assert all(len(c) == 1 or c[:-1] in tree.choices[:i] for i, c in enumerate(tree.choices))
    assert len(tree.choices) == 5
