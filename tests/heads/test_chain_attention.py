"""The training-time test's attention (heads/kernels/chain_attention.py): the same attention as SDPA with the
dense chain mask, forward and backward, inside a head's training step too."""

import pytest
import torch
import torch.nn.functional as F

from head_helpers import features, make_head
from headway.heads.kernels.chain_attention import ChainMask, chain_attention, dense_chain_masks


def dense_reference(q, k, v, steps):
    """SDPA with the chain's dense mask, keys/values repeated per query head (what training ran before)."""
    g = q.shape[1] // k.shape[1]
    mask = ChainMask(steps, q.shape[2]).dense(q.device)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)


def test_the_dense_mask_is_the_chain():
    # step 3 over 4 positions: context block at <= t - 2, step-2 block at t - 1, own block at t
    expected = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
                             [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
                             [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
                             [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(ChainMask(steps=3, length=4).dense("cpu")[0, 0], expected)
    assert torch.equal(ChainMask(steps=1, length=3).dense("cpu")[0, 0], torch.ones(3, 3).tril().bool())


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
def test_equals_sdpa_with_the_dense_mask_forward_and_backward(steps, heads, kv_heads):
    torch.manual_seed(steps)
    B, T, D = 2, 29, 16
    q = torch.randn(B, heads, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, kv_heads, steps * T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, kv_heads, steps * T, D, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(B, heads, T, D, dtype=torch.float64)
    ours = chain_attention(q, k, v, steps, D ** -0.5)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad_out)
    ref = dense_reference(q, k, v, steps)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_heads_training_step_is_the_dense_masks(kind, target, batch):
    """The head's loss and gradients with the chain attention equal those of the dense-mask path (fp32)."""
    feats = features(make_head(kind, target), target, batch)

    def loss_and_grads(dense: bool):
        head = make_head(kind, target, seed=1, noise=0.0).train()
        if dense:
            with dense_chain_masks():
                loss = head(batch["input_ids"], batch["loss_mask"], feats).loss
        else:
            loss = head(batch["input_ids"], batch["loss_mask"], feats).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in head.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads(dense=False)
    ref_loss, ref_grads = loss_and_grads(dense=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_dense_chain_masks_restores_the_chain_path():
    import headway.heads.kernels.chain_attention as chain

    with dense_chain_masks():
        assert chain._dense_only
    assert not chain._dense_only
