"""The inference draft vocabulary: every head drafts among its most frequent training tokens only, with
the same scores it gives them over the whole vocabulary; the counts travel with the saved head."""

import pytest
import torch

from head_helpers import KINDS, begin, features, make_head
from headway.heads.base import COUNTS_NAME, HeadError, load_head, save_head


def skewed_counts(vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    counts[torch.arange(vocab_size - 1, vocab_size - 41, -1)] = torch.arange(40, 0, -1)  # high ids most frequent
    return counts


def draft_logits(head, target, batch):
    head.eval()
    feats = features(head, target, batch)
    ids = batch["input_ids"]
    B, T = ids.shape
    with torch.no_grad():
        state = head.draft_state(B, T + 8)
        logits, _ = begin(head, state, ids, feats, torch.zeros(B, dtype=torch.long), torch.full((B,), 6))
    return logits  # [B, V]


@pytest.mark.parametrize("kind", KINDS)
def test_restricted_readout_keeps_the_scores_of_the_kept_tokens(kind, target, batch):
    head = make_head(kind, target)
    head.token_counts = skewed_counts(target.config.vocab_size)
    head.init_from_data(head.token_counts)
    full = draft_logits(head, target, batch)
    head.set_draft_vocab(20)
    small = draft_logits(head, target, batch)
    kept = torch.isfinite(small[0])
    expected = torch.zeros_like(kept)
    expected[torch.arange(target.config.vocab_size - 1, target.config.vocab_size - 21, -1)] = True
    if kind == "eagle3":  # its own draft vocabulary (the 40 counted tokens + lowest ids) bounds the choice
        expected &= torch.isfinite(full[0])
    assert torch.equal(kept, expected)
    torch.testing.assert_close(small[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    head.set_draft_vocab(None)
    torch.testing.assert_close(draft_logits(head, target, batch), full, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_by_default_only_a_head_without_its_own_vocabulary_is_cut_to_the_default_size(kind, target, monkeypatch):
    """EAGLE-3 drafts over all of its own draft vocabulary by default, as vLLM serves it (a larger
    draft_vocab_size must reach the drafts); heads reading the whole vocabulary keep the DEFAULT_DRAFT_VOCAB
    most frequent tokens. An explicit draft_vocab still cuts either."""
    from headway.infer import drafters
    monkeypatch.setattr(drafters, "DEFAULT_DRAFT_VOCAB", 50)
    head = make_head(kind, target, **({"draft_vocab_size": 100} if kind == "eagle3" else {}))
    head.token_counts = skewed_counts(target.config.vocab_size)
    head.init_from_data(head.token_counts)
    drafters.build_drafter("head", target, head=head, policy="chain")
    assert head.draftable().sum() == (100 if kind == "eagle3" else 50)
    drafters.build_drafter("head", target, head=head, policy="chain", draft_vocab=20)
    assert head.draftable().sum() == 20


def test_training_mode_ignores_the_draft_vocabulary(target, batch):
    head = make_head("eagle", target)
    feats = features(head, target, batch)
    head.train()
    torch.manual_seed(0)
    before = head(batch["input_ids"], batch["loss_mask"], feats).loss
    head.set_draft_vocab(5)
    torch.manual_seed(0)
    after = head(batch["input_ids"], batch["loss_mask"], feats).loss
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_counts_are_saved_and_loaded_with_the_head(target, tmp_path):
    head = make_head("eagle", target)
    head.token_counts = skewed_counts(target.config.vocab_size)
    save_head(head, tmp_path / "final")
    assert (tmp_path / "final" / COUNTS_NAME).is_file()
    loaded = load_head(tmp_path / "final", target)
    assert torch.equal(loaded.token_counts, head.token_counts)
    loaded.set_draft_vocab(3)
    assert loaded.draft_vocab.tolist() == [target.config.vocab_size - 3, target.config.vocab_size - 2,
                                           target.config.vocab_size - 1]


def test_without_counts_the_lowest_ids_are_kept(target, tmp_path):
    head = make_head("mtp", target)
    save_head(head, tmp_path / "final")  # a head trained before counts were saved has none
    loaded = load_head(tmp_path / "final", target)
    assert loaded.token_counts is None
    loaded.set_draft_vocab(4)
    assert loaded.draft_vocab.tolist() == [0, 1, 2, 3]


def test_bad_counts_file_and_size_are_errors(target, tmp_path):
    head = make_head("eagle", target)
    save_head(head, tmp_path / "final")
    (tmp_path / "final" / COUNTS_NAME).write_bytes(b"not safetensors")
    with pytest.raises(HeadError, match="token_counts.safetensors is corrupted"):
        load_head(tmp_path / "final", target)
    for bad in (0, "many", 2.5):
        with pytest.raises(HeadError, match="draft_vocab must be >= 1"):
            head.set_draft_vocab(bad)
