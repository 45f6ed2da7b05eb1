"""Greedy speculative decoding equals plain greedy decoding token for token, for every drafter and every
head kind (fresh, untrained heads: losslessness does not depend on head quality), on a ragged batch."""

import pytest
import torch

from headway.heads.base import build_head
from headway.heads.target import build_tiny_random, load_target
from headway.infer.calibrate import TreeBudget
from headway.infer.drafters import Drafter, DynamicTree, StaticTree, build_drafter
from headway.infer.engine import Engine

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
    return Engine(target).generate(prompts, max_new_tokens=NEW, stop_on_eos=False).tokens


def speculate(target, prompts, drafter, **kw):
    return Engine(target, drafter, block_size=4, budget=TreeBudget()).generate(prompts, max_new_tokens=NEW,
                                                                     stop_on_eos=False, **kw)


def test_prompt_lookup_is_lossless(target, prompts, plain):
    out = speculate(target, prompts, build_drafter("prompt_lookup", target, gamma=4))
    assert out.tokens == plain
    stats = out.stats  # each speculative step's time split into its phases, which add up to its decode time
    assert stats.speculative_steps == stats.target_forwards and stats.plain_steps == 0
    assert min(stats.draft_s, stats.tree_forward_s, stats.accept_s) > 0
    assert stats.draft_s + stats.tree_forward_s + stats.accept_s <= stats.decode_s


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
        assert out.stats.tau == len(rates) + 1  # every step emits the whole argmax path plus the bonus token


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
        stats = out.stats  # tau counts what was accepted: one token per step plus its accepted drafts
        assert stats.tau == pytest.approx(1 + sum(stats.accepted_at_depth) / stats.row_steps), (kind, policy)
        assert stats.drafted_at_depth[0] == stats.row_steps  # every row drafted at every step


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


def test_heads_drafting_over_the_paged_context_kv(target, prompts, plain, monkeypatch):
    from headway.heads import layers as head_layers

    from headway.infer.kv_cache import PagedContextKV

    head = build_head("eagle", target)
    drafter = build_drafter("head", target, head=head, policy="dynamic", total_tokens=10, depth=3, top_k=3)
    dense = speculate(target, prompts, drafter)
    monkeypatch.setattr(head_layers, "ContextKV", PagedContextKV)
    paged = speculate(target, prompts, drafter)
    assert paged.tokens == plain
    assert paged.stats.accepted_at_depth == dense.stats.accepted_at_depth  # the same drafts


@pytest.mark.parametrize("policy, opts", [("dynamic", dict(total_tokens=8, depth=3, top_k=3)),
                                          ("chain", dict(gamma=3, sample=True))])
def test_sampling_keeps_the_targets_joint_distribution(target, policy, opts):
    """3 sampled tokens (top-k 4: 64 outcomes) from 3000 rows of one speculative batch vs the exact joint."""
    from scipy.stats import chisquare

    import copy

    other = copy.deepcopy(target.model)  # a draft model that agrees with the target only partly
    with torch.no_grad():
        other.lm_head.weight.add_(0.1 * torch.randn(other.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    drafter = build_drafter("draft_model", target, draft_model=other, policy=policy, **opts)
    prompt, rows, k = [7, 8, 9, 10], 3000, 4
    flat = TreeBudget(curve={1: 1.0, 10**6: 1.0})  # no batch throttle: draft for all 3000 rows
    out = Engine(target, drafter, budget=flat).generate(
        [prompt] * rows, max_new_tokens=3, temperature=1.0, top_k=k, seed=0, stop_on_eos=False)
    assert 0.1 < out.stats.acceptance_by_depth[0] < 0.9  # drafts were accepted and rejected
    samples = torch.tensor(out.tokens)  # [rows, 3]

    def next_probs(seqs):  # exact warped next-token distributions [n, V]
        from headway.heads.sampling import warp_probs
        with torch.no_grad():
            logits = target.model(input_ids=torch.tensor(seqs)).logits[:, -1]
        return warp_probs(logits, 1.0, k, None)

    joint = {}
    p1 = next_probs([prompt])[0]
    for x1 in p1.nonzero()[:, 0].tolist():
        p2 = next_probs([prompt + [x1]])[0]
        for x2 in p2.nonzero()[:, 0].tolist():
            p3 = next_probs([prompt + [x1, x2]])[0]
            for x3 in p3.nonzero()[:, 0].tolist():
                joint[(x1, x2, x3)] = float(p1[x1] * p2[x2] * p3[x3])
    outcomes = list(joint)
    index = {o: i for i, o in enumerate(outcomes)}
    counts = torch.zeros(len(outcomes))
    for row in samples.tolist():
        counts[index[tuple(row)]] += 1  # a KeyError here is an impossible sequence
    expected = torch.tensor([joint[o] for o in outcomes]) * rows
    assert chisquare(counts.numpy(), expected.numpy() / expected.sum().item() * rows).pvalue > 1e-4


class Oracle(Drafter):
    """Proposes the plain greedy continuation for row 0 (always accepted) and junk for the others."""

    def __init__(self, continuation, gamma=4):
        self.cont, self.gamma = torch.tensor(continuation), gamma

    def feature_layers(self):
        return []

    def max_nodes(self, budget):
        return min(budget, self.gamma + 1)

    def reset(self, prompt, lengths, max_len, sampling=None):
        self.prompt_len, self.generated = lengths.clone(), torch.zeros_like(lengths)

    def commit(self, tokens, feats, positions, num_valid):
        self.generated = positions.gather(1, (num_valid - 1)[:, None])[:, 0] + 2 - self.prompt_len

    def propose(self, root, max_nodes):
        from headway.infer.drafters import Draft
        from headway.infer.tree import chain_parents

        B, n = root.shape[0], max_nodes - 1
        idx = (self.generated[:, None] + torch.arange(n)).clamp(max=self.cont.shape[1] - 1)
        tokens = torch.where(torch.arange(B)[:, None] == 0, self.cont[0].gather(0, idx[0])[None], 5)
        return Draft(torch.cat([root[:, None], tokens], 1), chain_parents(n + 1))


class Contrary(Oracle):
    """Proposes each row's plain greedy continuation with every token id shifted by one: never the argmax."""

    def __init__(self, continuations, vocab_size, gamma=4):
        super().__init__(continuations, gamma)
        self.vocab_size = vocab_size

    def propose(self, root, max_nodes):
        from headway.infer.drafters import Draft
        from headway.infer.tree import chain_parents

        n = max_nodes - 1
        idx = self.generated[:, None] + torch.arange(n)  # [B, n] positions of the next n tokens
        tokens = (self.cont.gather(1, idx) + 1) % self.vocab_size  # [B, n]
        return Draft(torch.cat([root[:, None], tokens], 1), chain_parents(n + 1))


def test_a_drafter_that_is_always_wrong_gains_nothing_and_changes_nothing(target, prompts, plain):
    gamma = 4
    cont = Engine(target).generate(prompts, max_new_tokens=NEW + gamma + 1, stop_on_eos=False).tokens
    drafter = Contrary(cont, target.model.config.vocab_size, gamma=gamma)
    out = speculate(target, prompts, drafter)
    assert out.tokens == plain
    assert out.stats.tau == 1.0  # every step emits only the target's own token
    assert out.stats.drafted_at_depth[0] == out.stats.row_steps and out.stats.acceptance_by_depth[0] == 0.0


def test_rows_accepting_different_amounts_and_a_finished_row_riding_along(target, prompts):
    prompts = prompts[:2]
    long = Engine(target).generate(prompts, max_new_tokens=200, stop_on_eos=False).tokens
    eos = next(t for i, t in enumerate(long[0]) if i >= 8 and t not in long[0][:i] + long[1][:60])
    # row 0 ends after a few (fast, oracle-drafted) steps; row 1 crawls on to 60 tokens
    plain = Engine(target, eos_token_id=eos).generate(prompts, max_new_tokens=60).tokens
    drafter = Oracle([long[0], long[0]])
    out = Engine(target, drafter, eos_token_id=eos, budget=TreeBudget()).generate(prompts, max_new_tokens=60)
    assert out.tokens == plain  # and no CacheFullError from the finished row
    assert out.stats.accepted_at_depth[0] > 0  # row 0 accepted its drafts


def test_static_tree_from_measured_accuracies_is_lossless(target, prompts, plain):
    head = build_head("medusa", target)
    drafter = build_drafter("head", target, head=head, policy="static", accuracies=[0.6, 0.4, 0.3], total_nodes=8)
    assert len(drafter.policy.choices) == 7
    assert speculate(target, prompts, drafter).tokens == plain


def test_a_briefly_trained_head_is_accepted_and_still_lossless(target):
    """Medusa fitted for a few seconds on the target's own greedy continuations drafts them back."""
    from headway.heads.base import compute_features

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (6,), generator=gen).tolist() for _ in range(16)]
    cont = Engine(target).generate(prompts, max_new_tokens=32, stop_on_eos=False).tokens
    seqs = torch.tensor([p + c for p, c in zip(prompts, cont)])
    torch.manual_seed(0)
    head = build_head("medusa", target, num_heads=3)
    feats = compute_features(target.model, seqs, None, head.feature_layers())
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    head.train()
    for _ in range(100):
        loss = head(seqs, torch.ones_like(seqs, dtype=torch.bool), feats).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter = build_drafter("head", target, head=head.eval(), policy="dynamic", total_tokens=10, depth=3, top_k=3)
    out = Engine(target, drafter, budget=TreeBudget()).generate(prompts[:4], max_new_tokens=32,
                                                                          stop_on_eos=False)
    assert out.tokens == cont[:4]
    assert out.stats.tau > 2.5


@pytest.mark.parametrize("layout", ["stock", "wide-column", "packed"])
def test_every_weight_layout_is_lossless(target, prompts, plain, layout):
    """The tree is verified by multi-row GEMMs (packed: MKL's packed kernel) while plain decoding runs
    one-row GEMVs: the tokens must not change."""
    drafter = build_drafter("draft_model", target, draft_model=build_tiny_random(seed=1)[0], policy="dynamic",
                            total_tokens=12, depth=4, top_k=3)
    engine = Engine(target, drafter, block_size=4, budget=TreeBudget(), weight_layout=layout)
    assert engine.generate(prompts, max_new_tokens=NEW, stop_on_eos=False).tokens == plain
    assert Engine(target, weight_layout=layout).generate(prompts, max_new_tokens=NEW, stop_on_eos=False).tokens == plain
