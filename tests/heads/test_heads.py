"""Behaviour every head must have: trains, round-trips, rejects bad options, keeps the target out of its
weights, and drafts with its KV cache exactly what its teacher-forced forward computes."""

import pytest
import torch

from head_helpers import KINDS, features, make_head, yaml_options
from heads.base import HeadError, TargetFeatures, build_head, load_head, save_head

DEPTHS = 3  # chain depth checked by the cache-equivalence tests


@pytest.mark.parametrize("kind", KINDS)
def test_loss_falls_on_a_fixed_batch(kind, target, batch):
    head = make_head(kind, target)
    feats = features(head, target, batch)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(40):
        out = head(batch["input_ids"], batch["loss_mask"], feats)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert out.depth_correct.shape == out.depth_count.shape == (head.num_depths,)
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(kind, target, batch, tmp_path):
    head = make_head(kind, target, seed=1)
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


# ------------------------------------------------------------------------------ cached drafting

def gather_feats(feats: TargetFeatures, index: torch.Tensor) -> TargetFeatures:
    """Per-row time gather: feats at positions index [B, n]."""
    def take(x):
        return torch.gather(x, 1, index[:, :, None].expand(-1, -1, x.shape[-1]))
    return TargetFeatures({k: take(v) for k, v in feats.hidden_states.items()}, feats.num_layers)


def begin(head, state, input_ids, feats, start, stop):
    """Commit features at positions start..stop-1 (and tokens start+1..stop) for each row."""
    n = int((stop - start).max())
    pos = (start[:, None] + torch.arange(n)[None]).clamp(max=input_ids.shape[1] - 2)
    tokens = torch.gather(input_ids, 1, pos + 1)
    return head.draft_begin(state, tokens, gather_feats(feats, pos), pos, stop - start)


def chain(head, state, input_ids, root_hidden, m, depths):
    """Expand a one-node-per-depth chain along the true tokens x_{m+1}, x_{m+2}, ...; logits per depth."""
    out, hidden = [], root_hidden[:, None]
    for d in range(1, depths):
        tokens = torch.gather(input_ids, 1, (m + d)[:, None])  # x_{m+d}
        parents = torch.full_like(tokens, d - 2)  # the previous chain node (-1: the root)
        logits, hidden = head.draft_expand(state, d, tokens, hidden, parents, (m - 1 + d)[:, None])
        out.append(logits[:, 0])
    return out


def at_anchor(logits: torch.Tensor, m: torch.Tensor) -> torch.Tensor:  # [B, T, V] at anchor m-1 -> [B, V]
    return logits[torch.arange(logits.shape[0]), m - 1]


@pytest.mark.parametrize("kind", KINDS)
def test_cached_chain_equals_teacher_forced_forward(kind, target, batch):
    head = make_head(kind, target, seed=2).eval()
    ids = batch["input_ids"]
    feats = features(head, target, batch)
    depths = min(DEPTHS, head.max_draft_depth or DEPTHS)
    with torch.no_grad():
        reference = head.anchor_logits(ids, feats)  # [d-1]: depth-d logits [B, T, V] by anchor
        state = head.draft_state(ids.shape[0], ids.shape[1])
        start = torch.zeros(ids.shape[0], dtype=torch.long)
        for m in (torch.tensor([5, 9, 6, 7]), torch.tensor([8, 10, 12, 9]), torch.tensor([9, 13, 15, 10])):
            logits, hidden = begin(head, state, ids, feats, start, m)  # ragged num_valid per row
            drafted = [logits] + chain(head, state, ids, hidden, m, depths)
            for d, got in enumerate(drafted):
                torch.testing.assert_close(got, at_anchor(reference[d], m), rtol=1e-4, atol=1e-4,
                                           msg=lambda s: f"depth {d + 1}, committed {m.tolist()}: {s}")
            head.draft_end(state)
            start = m


@pytest.mark.parametrize("kind", KINDS)
def test_tree_siblings_do_not_see_each_other(kind, target, batch):
    head = make_head(kind, target, seed=3).eval()
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
