"""Behaviour every head must have: trains, round-trips, rejects bad options, keeps the target out of its
weights, and drafts with its KV cache exactly what its teacher-forced forward computes."""

import pytest
import torch

from head_helpers import (KINDS, VARIANTS, at_anchor, begin, check_cached_chain, features, make_head, train_briefly,
                          yaml_options)
from headway.heads.base import HeadError, build_head, load_head, save_head
from headway.heads.layers import chain_accuracy


@pytest.mark.parametrize("kind, options", VARIANTS)
def test_loss_falls_on_a_fixed_batch(kind, options, target, batch):
    head = make_head(kind, target, **options)
    losses, out = train_briefly(head, batch, features(head, target, batch), steps=40)
    assert out.depth_correct.shape == out.depth_count.shape == (head.num_depths,)
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("kind, options", VARIANTS)
def test_save_load_round_trip(kind, options, target, batch, tmp_path):
    head = make_head(kind, target, seed=1, **options)
    with torch.no_grad():  # move away from the initialisation so a missed tensor would show
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    head.eval()
    feats = features(head, target, batch)
    save_head(head, tmp_path / "final")
    loaded = load_head(tmp_path / "final", target)
    assert loaded.kind == kind and loaded.options == head.options
    for a, b in zip(head.anchor_logits(batch["input_ids"], feats), loaded.anchor_logits(batch["input_ids"], feats)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(head(batch["input_ids"], batch["loss_mask"], feats).loss,
                               loaded(batch["input_ids"], batch["loss_mask"], feats).loss, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_options_raise_head_error(kind, target):
    with pytest.raises(HeadError, match="unknown option.*num_hedas"):
        build_head(kind, target, **dict(yaml_options(kind), num_hedas=3))


@pytest.mark.parametrize("kind", KINDS)
def test_target_weights_stay_out_of_the_head(kind, target):
    head = make_head(kind, target)
    target_ptrs = {p.data_ptr() for p in target.model.parameters()}
    assert not target_ptrs & {p.data_ptr() for p in head.parameters()}
    assert not target_ptrs & {t.data_ptr() for t in head.state_dict().values()}
    assert not any("embed_tokens" in name for name in head.state_dict())


@pytest.mark.parametrize("kind, options", VARIANTS)
def test_validation_accuracies_are_those_of_the_teacher_forced_drafts(kind, options, target, batch):
    """The forward reads out only where a label is learnt; its depth accuracies must still be the chain
    accuracies of the full teacher-forced drafts (every position read out, over the same vocabulary)."""
    head = make_head(kind, target, seed=3, **options)
    ids, mask = batch["input_ids"], batch["loss_mask"]
    feats = features(head, target, batch)
    train_briefly(head, batch, feats, steps=30)  # so that some drafts are right
    head.eval()
    with torch.no_grad():
        out = head(ids, mask, feats)
        preds = [logits.argmax(-1) for logits in head.anchor_logits(ids, feats)]
    correct, count = chain_accuracy(preds, ids, mask)
    assert int(count[0]) > 0 and int(correct[0]) > 0
    assert torch.equal(out.depth_correct, correct) and torch.equal(out.depth_count, count)


@pytest.mark.parametrize("kind, options", VARIANTS)
def test_cached_chain_equals_teacher_forced_forward(kind, options, target, batch):
    check_cached_chain(make_head(kind, target, seed=2, **options).eval(), target, batch)


@pytest.mark.parametrize("kind, options", VARIANTS)
def test_tree_siblings_do_not_see_each_other(kind, options, target, batch):
    head = make_head(kind, target, seed=3, **options).eval()
    ids = batch["input_ids"]
    feats = features(head, target, batch)
    m = torch.tensor([6, 7, 8, 9])
    with torch.no_grad():
        reference = head.anchor_logits(ids, feats)
        state = head.draft_state(ids.shape[0], ids.shape[1])
        _, hidden = begin(head, state, ids, feats, torch.zeros_like(m), m)
        true_next = torch.gather(ids, 1, m[:, None] + 1)  # x_{m+1}
        decoy = (true_next + 17) % target.config.vocab_size
        tokens = torch.cat([decoy, true_next], 1)  # sibling 0 is a decoy, sibling 1 is on the true path
        logits, hidden = head.draft_expand(state, 1, tokens, hidden[:, None].expand(-1, 2, -1),
                                           torch.full_like(tokens, -1), m[:, None].expand(-1, 2))
        torch.testing.assert_close(logits[:, 1], at_anchor(reference[1], m), rtol=1e-4, atol=1e-4)
        if (head.max_draft_depth or 3) >= 3:  # a child of sibling 1 sees its parent, not sibling 0
            child = torch.gather(ids, 1, m[:, None] + 2)  # x_{m+2}
            logits, _ = head.draft_expand(state, 2, child, hidden[:, 1:], torch.ones_like(child), m[:, None] + 1)
            torch.testing.assert_close(logits[:, 0], at_anchor(reference[2], m), rtol=1e-4, atol=1e-4)


def test_a_head_missing_part_of_the_contract_cannot_be_built(target):
    from headway.heads.base import DraftHead
    from headway.heads.medusa import MedusaHead

    class NoDrafting(DraftHead):  # trains, but cannot draft
        num_depths = 1

        def forward(self, input_ids, loss_mask, feats):
            raise NotImplementedError

        def anchor_logits(self, input_ids, feats):
            return []

    with pytest.raises(TypeError, match="draft_begin"):
        NoDrafting(target.config)
    MedusaHead(target.config)  # a complete head builds


def test_a_kind_names_one_head_only():
    from headway.heads.base import HEAD_REGISTRY, register_head
    from headway.heads.medusa import MedusaHead

    class Impostor(MedusaHead):
        pass

    with pytest.raises(HeadError, match="'medusa' is already registered"):
        register_head("medusa")(Impostor)
    assert HEAD_REGISTRY["medusa"] is MedusaHead and register_head("medusa")(MedusaHead) is MedusaHead
