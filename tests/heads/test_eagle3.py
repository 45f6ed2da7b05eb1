"""EAGLE-3 specifics: the reduced draft vocabulary (d2t/t2d) and the aux-layer ids."""

import pytest
import torch

from head_helpers import check_cached_chain, features, make_head, train_briefly
from headway.heads.base import HeadError, load_head, save_head
from headway.heads.eagle3 import default_aux_layers
from headway.heads.layers import chain_reachable, in_top_k

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


def test_chain_reachable_ands_the_earlier_drafts_of_each_chain():
    """Step j at query t shares its chain with step i at query t - (j - i): step 2 at t is reached only if
    step 0 hit at t - 2 and step 1 hit at t - 1; a chain that starts left of the sequence counts as reached."""
    hit0 = torch.tensor([[True, False, True, True, True]])
    hit1 = torch.tensor([[True, True, True, False, True]])
    assert chain_reachable([hit0]).tolist() == [[True, True, False, True, True]]
    assert chain_reachable([hit0, hit1]).tolist() == [[True, True, True, False, False]]
    logits = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.2, 0.1]])
    assert in_top_k(logits, torch.tensor([2, 2]), 2).tolist() == [True, False]
    assert in_top_k(logits, torch.tensor([-100, 0]), 1).tolist() == [False, True]  # off-vocabulary never hits


def test_reach_mask_scores_only_the_drafts_a_top_k_tree_reaches(target, batch):
    """reach_top_k larger than the draft vocabulary reaches every draft (the loss of the unmasked head); with
    reach_top_k=1 an untrained head's later steps are scored on fewer drafts, so their losses change, while
    step 0, which has no earlier draft, keeps its loss."""
    def run(**options):
        head = make_head("eagle3", target, seed=5, **options).train()
        with torch.no_grad():
            return head(batch["input_ids"], batch["loss_mask"], features(head, target, batch))

    plain, everything, top1 = run(), run(reach_top_k=10**6), run(reach_top_k=1)
    torch.testing.assert_close(everything.loss, plain.loss, rtol=0, atol=0)
    assert everything.metrics["reached_step1"] == 1.0
    assert top1.metrics["loss_step0"] == plain.metrics["loss_step0"]
    assert top1.metrics["reached_step1"] < 0.5 and top1.metrics["reached_step2"] <= top1.metrics["reached_step1"]
    assert top1.metrics["loss_step1"] != plain.metrics["loss_step1"]
    with pytest.raises(HeadError, match="reach_top_k must be an integer >= 0"):
        make_head("eagle3", target, reach_top_k=-1)
