"""Medusa specifics: a fresh head is the target's LM head; separate blocks; the KL (self-distillation) loss."""

import torch

from head_helpers import features, make_head


def test_fresh_heads_reproduce_the_target(target, batch):
    head = make_head("medusa", target, num_layers=2)
    feats = features(head, target, batch, with_logits=True)
    with torch.no_grad():
        for logits in head.anchor_logits(batch["input_ids"], feats):
            torch.testing.assert_close(logits, feats.logits, rtol=1e-5, atol=1e-5)
    blocks = head.blocks[0].layers
    assert blocks[0].weight.data_ptr() != blocks[1].weight.data_ptr()  # never [ResBlock] * L


def test_kl_loss_trains_towards_the_target(target, batch):
    head = make_head("medusa", target, loss="kl")
    feats = features(head, target, batch)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = head(batch["input_ids"], batch["loss_mask"], feats).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses
