"""train/muon.py: torch.optim.Muon's step with the orthogonalisation in a dtype the hardware multiplies."""

import pytest
import torch
import torch.optim._muon as torch_muon

from headway.train import muon as headway_muon
from headway.train.muon import Muon, orthogonalisation_dtype, orthogonalise

OPTIONS = dict(lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_steps=5)


def matrices(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((24, 40), (40, 24), (16, 16))]


def run(optimizer_cls, steps=3, **kwargs):
    """Parameters after `steps` steps on fixed pseudo-random gradients."""
    params = matrices()
    opt = optimizer_cls(params, **OPTIONS, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


def torch_orthogonalise_in_fp32(grad, ns_coefficients, ns_steps, eps):
    return orthogonalise(grad, ns_coefficients, ns_steps, eps, torch.float32)


def test_fp32_step_is_torch_muons_step_with_an_fp32_orthogonalisation(monkeypatch):
    """Momentum, Nesterov, decoupled weight decay and the shape-adjusted lr follow torch.optim.Muon exactly:
    torch's own step with its orthogonalisation swapped for the fp32 one gives the same parameters."""
    ours = run(Muon, orthogonalise_in=torch.float32)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", torch_orthogonalise_in_fp32)
    reference = run(torch.optim.Muon)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_step_is_torch_muon_unchanged():
    for a, b in zip(run(Muon, orthogonalise_in=torch.bfloat16), run(torch.optim.Muon)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_orthogonalise_matches_torchs_iteration_in_bf16_and_is_more_exact_in_fp32():
    """In bf16 the iteration is torch's to the bit; in fp32 it lands nearer torch's result run in fp64 (the same
    iteration without rounding) than bf16 does, on both a wide and a tall matrix."""
    coefficients = (torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C)
    for shape in ((32, 96), (96, 32)):
        update = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        theirs = torch_muon._zeropower_via_newtonschulz(update, coefficients, 5, 1e-7)
        assert torch.equal(orthogonalise(update, coefficients, 5, 1e-7, torch.bfloat16), theirs)
        exact = orthogonalise(update.double(), coefficients, 5, 1e-7, torch.float64)
        fp32 = orthogonalise(update, coefficients, 5, 1e-7, torch.float32)
        assert fp32.shape == shape and fp32.dtype == torch.float32
        assert (fp32.double() - exact).abs().max() < 0.1 * (theirs.double() - exact).abs().max()


@pytest.mark.parametrize("has_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_cpu_orthogonalises_in_bf16_only_where_it_multiplies_bf16(monkeypatch, has_bf16, expected):
    monkeypatch.setattr(headway_muon, "cpu_multiplies_bf16", lambda: has_bf16)
    assert orthogonalisation_dtype(torch.device("cpu")) == expected
    assert Muon(matrices(), lr=1e-3).iteration_dtype() == expected  # decided for the parameters' device


def test_checkpoints_move_between_torchs_muon_and_ours():
    """The state is torch.optim.Muon's (a momentum buffer per matrix, no extra group keys): a run resumed with
    the other class continues from the same momentum."""
    params = matrices()
    theirs = torch.optim.Muon(params, **OPTIONS)
    for p in params:
        p.grad = torch.ones_like(p)
    theirs.step()
    ours = Muon(params, **OPTIONS, orthogonalise_in=torch.float32)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict()["param_groups"] == theirs.state_dict()["param_groups"]
    ours.step()  # the loaded groups lack nothing the fp32 step reads
    assert all(torch.isfinite(p).all() for p in params)
