"""EAGLE-3 specifics: the reduced draft vocabulary (d2t/t2d) and the aux-layer ids."""

import pytest
import torch

from head_helpers import check_cached_chain, features, make_head, train_briefly
from headway.heads.base import HeadError, load_head, save_head
from headway.heads.eagle3 import default_aux_layers

VD = 64


@pytest.fixture
def small_vocab_head(target):
    head = make_head("eagle3", target, draft_vocab_size=VD)
    V = target.config.vocab_size
    counts = torch.zeros(V, dtype=torch.long)
    counts[100:200] = 5  # 100 tied tokens: the lower ids win the 60 places left
    counts[[7, 250, 3, 42]] = torch.tensor([50, 40, 30, 20])
    head.init_from_data(counts)
    return head.eval()


def test_draft_vocab_keeps_the_most_frequent_tokens(small_vocab_head, target):
    head = small_vocab_head
    expected = torch.tensor(sorted([3, 7, 42, 250] + list(range(100, 160))))
    torch.testing.assert_close(torch.arange(VD) + head.d2t, expected)  # target_id = draft_id + d2t[draft_id]
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    assert head.t2d.sum() == VD and head.t2d[expected].all()
    torch.testing.assert_close(head.lm_head.weight, target.model.lm_head.weight[expected])


def test_off_vocabulary_tokens_get_no_probability(small_vocab_head, target, batch):
    head = small_vocab_head
    with torch.no_grad():
        logits = head.anchor_logits(batch["input_ids"], features(head, target, batch))[0]
    assert torch.isinf(logits[..., ~head.t2d]).all() and torch.isfinite(logits[..., head.t2d]).all()


def test_small_vocab_drafting_and_round_trip(small_vocab_head, target, batch, tmp_path):
    check_cached_chain(small_vocab_head, target, batch)
    save_head(small_vocab_head, tmp_path / "h")
    loaded = load_head(tmp_path / "h", target)
    assert torch.equal(loaded.d2t, small_vocab_head.d2t) and torch.equal(loaded.t2d, small_vocab_head.t2d)


def test_aux_layers_default_and_range(target):
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M: inputs of layers 2, 15 and 27
    assert make_head("eagle3", target).aux_layers == default_aux_layers(4)
    with pytest.raises(HeadError, match="out of range"):
        make_head("eagle3", target, aux_layers=[1, 2, 9])
    with pytest.raises(HeadError, match="token_counts"):
        make_head("eagle3", target).init_from_data(torch.ones(5))


EAGLE31 = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)


def test_eagle31_norms_draft_with_the_cache_what_training_computes(target, batch):
    """With input_norm, the normed residual and the normed recurrent output, cached tree drafting still
    equals the teacher-forced training unroll, and the head learns."""
    head = make_head("eagle3", target, seed=3, **EAGLE31)
    assert head.input_norm.weight.shape == (len(head.aux_layers) * target.config.hidden_size,)
    check_cached_chain(head.eval(), target, batch)
    head.train()
    losses, _ = train_briefly(head, batch, features(head, target, batch), steps=30)
    assert losses[-1] < 0.6 * losses[0], losses


def test_eagle31_flags_must_be_booleans(target):
    with pytest.raises(HeadError, match="norm_output must be true or false"):
        make_head("eagle3", target, norm_output="yes")


@pytest.mark.parametrize("train_lm_head", [True, False])
def test_a_frozen_read_out_stays_the_targets_rows(target, batch, train_lm_head):
    head = make_head("eagle3", target, seed=4, draft_vocab_size=VD, train_lm_head=train_lm_head)
    head.init_from_data(torch.arange(target.config.vocab_size))
    rows = target.model.lm_head.weight[head.draft_ids]
    fc = head.fc.weight.detach().clone()
    train_briefly(head.train(), batch, features(head, target, batch), steps=3)
    assert torch.equal(head.lm_head.weight, rows) != train_lm_head
    assert not torch.equal(head.fc.weight, fc)  # the rest learns either way
    with pytest.raises(HeadError, match="train_lm_head must be true or false"):
        make_head("eagle3", target, train_lm_head="no")


def test_a_larger_draft_vocabulary_keeps_the_trained_rows_and_maps_the_new_ones(target):
    """init_from with a larger draft_vocab_size: the shared tokens keep their trained rows exactly, and the
    new tokens' rows follow the map the training applied to the shared ones (here an exact linear map), not
    the target's raw rows, which would give the new tokens logits the trained head never produced."""
    V, h = target.config.vocab_size, target.config.hidden_size
    counts = torch.arange(V, 0, -1)  # lower ids more frequent: the 100-token vocabulary lies inside the 200
    small = make_head("eagle3", target, draft_vocab_size=100)
    small.init_from_data(counts)
    trained_map = torch.eye(h) + 0.3 * torch.randn(h, h, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # "training": rows moved from the target's by one linear map
        small.lm_head.weight.copy_(target.model.lm_head.weight[:100] @ trained_map)
    large = make_head("eagle3", target, draft_vocab_size=200)
    large.init_from_data(counts)
    state = large.carry_state({k: v.clone() for k, v in small.state_dict().items()})
    torch.testing.assert_close(state["lm_head.weight"][:100], small.lm_head.weight.detach(), rtol=0, atol=0)
    expected_new = target.model.lm_head.weight[100:200] @ trained_map
    torch.testing.assert_close(state["lm_head.weight"][100:], expected_new, rtol=1e-3, atol=1e-3)
    assert torch.equal(state["d2t"], large.d2t) and torch.equal(state["t2d"], large.t2d)
    large.load_state_dict(state)  # every shape fits the larger head
