"""Tree masks and positions: tensor-op construction equals a brute-force ancestor walk, and the real HF
target run through our cache + tree mask gives the logits of running each root-to-node path from scratch."""

import pytest
import torch

from headway.heads.target import load_target
from headway.infer.kv_cache import PagedKVCache
from headway.infer.tree import ancestor_mask, attention_mask, causal_ancestors, depths


def random_parents(n, gen):
    return torch.tensor([-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, n)])


def brute_force(parents):
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            anc[i, j] = True
            j = int(parents[j])
    return anc


@pytest.mark.parametrize("n", [1, 2, 3, 9, 33])
def test_ancestor_mask_matches_a_walk(n):
    gen = torch.Generator().manual_seed(n)
    parents = torch.stack([random_parents(n, gen) for _ in range(4)])
    parents[0] = torch.arange(-1, n - 1)  # a chain: the deepest case
    anc = ancestor_mask(parents)
    for b in range(4):
        want = brute_force(parents[b])
        assert torch.equal(anc[b], want)
        assert torch.equal(depths(anc)[b], want.sum(-1) - 1)
    assert torch.equal(ancestor_mask(parents[0]), anc[:1])  # [N] works like [1, N]


def test_attention_mask_sees_context_and_ancestors_only():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    anc = ancestor_mask(parents)
    start = torch.tensor([2, 5])
    mask = attention_mask(start, anc, read_len=9, dtype=torch.float32)
    assert mask.shape == (2, 1, 4, 9)
    visible = mask[:, 0] == 0
    for b in range(2):
        s = int(start[b])
        assert visible[b, :, :s].all()
        assert torch.equal(visible[b, :, s:s + 4], anc[b])
        assert not visible[b, :, s + 4:].any()


def test_padded_queries_never_get_an_empty_row():
    mask = attention_mask(torch.tensor([0, 0]), causal_ancestors(4), 4, torch.float32, num_new=torch.tensor([4, 2]))
    visible = mask[:, 0] == 0
    assert visible.any(-1).all()
    assert not visible[1, :, 2:].any()  # nobody sees row 1's padding


def test_tree_forward_equals_each_path_from_scratch():
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    model = target.model
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(259, (7,), generator=gen), torch.randint(259, (4,), generator=gen)]
    parents = torch.stack([torch.tensor([-1, 0, 0, 1, 1, 2, 4]), random_parents(7, gen)])
    tree = torch.randint(259, (2, 7), generator=gen)

    cache = PagedKVCache.for_model(model.config, batch_size=2, max_seq_len=32, block_size=4)
    lens = torch.tensor([7, 4])
    prompt = torch.zeros(2, 7, dtype=torch.long)
    for b, p in enumerate(prompts):
        prompt[b, :len(p)] = p
    with torch.no_grad():
        plan = cache.prepare(lens, 7)
        model(input_ids=prompt, position_ids=torch.arange(7).expand(2, 7), cache=cache,
              attention_mask=attention_mask(plan.start, causal_ancestors(7), plan.read_len, torch.float32, lens))
        anc = ancestor_mask(parents)
        plan = cache.prepare(7)
        logits = model(input_ids=tree, position_ids=plan.start[:, None] + depths(anc), cache=cache,
                       attention_mask=attention_mask(plan.start, anc, plan.read_len, torch.float32)).logits
        for b in range(2):
            for i in range(7):
                path = brute_force(parents[b])[i].nonzero()[:, 0]  # ancestors in order, root first
                ids = torch.cat([prompts[b], tree[b, path]])[None]
                want = model(input_ids=ids).logits[0, -1]
                torch.testing.assert_close(logits[b, i], want, rtol=1e-4, atol=1e-4)
