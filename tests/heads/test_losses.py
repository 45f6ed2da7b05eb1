"""The fused distillation loss: values and gradients equal autograd through the textbook formula."""

import torch

from headway.heads.layers import SoftCrossEntropy, TargetDistribution


def textbook_kl(logits, target_logits):
    """KL(p || q) with autograd through every op, p = 0 (no term) where the target logit is -inf."""
    log_p = target_logits.log_softmax(-1)
    support = log_p > float("-inf")
    log_p = log_p.masked_fill(~support, 0.0)
    terms = log_p.exp() * (log_p - logits.log_softmax(-1))
    return terms.masked_fill(~support, 0.0).sum(-1)


def test_kl_and_its_gradient_equal_autograd_through_the_textbook_formula():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(4, 6, 33, generator=g)
    target[0, 1, :20] = float("-inf")  # a top-k cache: tokens the target never proposes
    target[1, 2] = float("-inf")  # a row with no support at all: adds nothing
    logits = torch.randn(4, 6, 33, generator=g, requires_grad=True)
    weights = torch.rand(4, 6, generator=g)  # a different upstream gradient per row

    kl = TargetDistribution(target).kl(logits)
    expected = textbook_kl(logits, target)
    torch.testing.assert_close(kl, expected)
    assert kl[1, 2] == 0

    grad, = torch.autograd.grad((kl * weights).sum(), logits)
    expected_grad, = torch.autograd.grad((expected * weights).sum(), logits)
    torch.testing.assert_close(grad, expected_grad)
    assert grad[1, 2].abs().sum() == 0


def test_soft_cross_entropy_passes_gradcheck():
    g = torch.Generator().manual_seed(1)
    p = torch.randn(3, 5, 9, generator=g, dtype=torch.double).softmax(-1)
    p[0, 0] = 0.0  # no support
    p[2, 1, :4] = 0.0  # partial support: p sums to less than 1
    logits = torch.randn(3, 5, 9, generator=g, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: SoftCrossEntropy.apply(z.reshape(-1, 9), p.reshape(-1, 9)), (logits,))


def test_a_minus_inf_head_logit_where_the_target_has_no_mass_stays_finite():
    target = torch.randn(2, 7)
    target[:, 0] = float("-inf")
    logits = torch.randn(2, 7)
    logits[:, 0] = float("-inf")  # the head cannot emit token 0, and the target never does
    logits.requires_grad_(True)
    kl = TargetDistribution(target).kl(logits)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logits.grad).all()
    torch.testing.assert_close(kl, textbook_kl(logits.detach(), target))


def test_the_loss_in_row_blocks_equals_the_loss_in_one_block(monkeypatch):
    from headway.heads import layers

    g = torch.Generator().manual_seed(2)
    target = torch.randn(23, 40, generator=g).bfloat16()  # the target's logits come in the compute dtype
    target[3, :30] = float("-inf")
    logits = torch.randn(23, 40, generator=g).bfloat16().requires_grad_()
    weights = torch.rand(23, generator=g)

    def loss_and_grad(temperature):
        kl = TargetDistribution(target, temperature).kl(logits)
        grad, = torch.autograd.grad((kl * weights).sum(), logits)
        return kl, grad

    for temperature in (1.0, 0.5):
        whole = loss_and_grad(temperature)
        monkeypatch.setattr(layers, "ROW_BLOCK_BYTES", 4 * 40 * 5)  # blocks of 5 rows: 4 full, 1 of 3
        assert len(layers.row_blocks(logits)) == 5
        blocks = loss_and_grad(temperature)
        monkeypatch.undo()
        torch.testing.assert_close(blocks, whole, rtol=0, atol=0)
        expected = textbook_kl(logits.detach().float(), target.float() / temperature)
        torch.testing.assert_close(whole[0], expected)
