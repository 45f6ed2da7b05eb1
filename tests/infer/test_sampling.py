"""warp_probs (temperature -> top-k -> top-p, greedy one-hot), exact float64 sampling, fast argmax.

law_pvalue and total_variation are the statistics test_verify.py uses too."""

import pytest
import torch
from scipy import stats

from headway.heads import sampling
from headway.heads.sampling import argmax, sample, warp_probs

torch.set_num_threads(1)


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """TV distance between the empirical law of samples [n] and probs [V]."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * (counts / samples.numel() - probs.double() / probs.double().sum()).abs().sum().item()


def law_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of samples [n] against probs [V]; bins expected below 5 are merged."""
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "a token with probability 0 was drawn"
    expected = probs * samples.numel()
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[small].sum()[None]])
    expected = torch.cat([expected[big], expected[small].sum()[None]])
    if not small.any():
        observed, expected = observed[:-1], expected[:-1]
    return stats.chisquare(observed.numpy(), expected.numpy()).pvalue


# ---------------------------------------------------------------------------------------------- warp


def test_temperature_one_is_fp32_softmax_of_any_dtype():
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0)).bfloat16()
    probs = warp_probs(logits, 1.0)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, logits.float().softmax(-1))
    torch.testing.assert_close(warp_probs(logits, 0.5), (logits.float() / 0.5).softmax(-1))


def test_temperature_zero_is_one_hot_argmax_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 0.5, 0.5]])
    probs = warp_probs(logits, 0.0, top_k=2, top_p=0.5)
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]


def test_top_k_keeps_the_k_largest_and_renormalises():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    probs = warp_probs(logits, 1.0, top_k=2)
    expected = torch.zeros(5)
    expected[[1, 3]] = torch.tensor([3.0, 2.0]).softmax(-1)
    torch.testing.assert_close(probs, expected)
    tied = warp_probs(torch.tensor([1.0, 2.0, 2.0, 0.0]), 1.0, top_k=1)  # ties with the k-th stay
    assert (tied > 0).tolist() == [False, True, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert (warp_probs(logits, 1.0, top_p=0.75) > 0).tolist() == [True, True, False, False]
    assert (warp_probs(logits, 1.0, top_p=0.85) > 0).tolist() == [True, True, True, False]
    assert (warp_probs(logits, 1.0, top_p=0.1) > 0).tolist() == [True, False, False, False]
    torch.testing.assert_close(warp_probs(logits, 1.0, top_p=0.75)[:2], torch.tensor([0.625, 0.375]))


@pytest.mark.parametrize("scale,top_p", [(3.0, 0.9), (8.0, 0.5), (0.3, 0.95), (3.0, 0.999)])
def test_top_p_on_candidates_equals_the_full_sort(scale, top_p):
    """The partial-sort nucleus keeps exactly the tokens the full stable sort keeps, ties at the boundary
    included (logits rounded to one decimal: many ties), whether a row is decided on the candidates
    (peaked rows) or falls back to the full sort (flat rows)."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 16, 4096) * scale).round(decimals=1)  # V > 2 * candidates
    probs = logits.softmax(-1)
    full = sampling._top_p_sorted(logits.view(-1, 4096), probs.view(-1, 4096), top_p).view(probs.shape)
    assert torch.equal(warp_probs(logits, 1.0, top_p=top_p), full)
    _, decided = sampling._top_p_candidates(probs.view(-1, 4096), top_p, sampling._TOP_P_CANDIDATES[0])
    assert bool(decided.all()) == (scale >= 3.0 and top_p < 0.99)  # both paths are exercised


def test_top_p_on_more_candidates_equals_the_full_sort():
    """Flat rows, whose nucleus reaches past the first 512 tokens, are decided on 4,096 candidates,
    still exactly as the full sort decides them (ties included)."""
    torch.manual_seed(1)
    logits = (torch.randn(24, 20000) * torch.linspace(0.5, 3.0, 24)[:, None]).round(decimals=1)
    probs = logits.softmax(-1)
    full = sampling._top_p_sorted(logits, probs, 0.9)
    assert torch.equal(warp_probs(logits, 1.0, top_p=0.9), full)
    first, second = (sampling._top_p_candidates(probs, 0.9, k)[1] for k in sampling._TOP_P_CANDIDATES[:2])
    assert bool((second & ~first).any()) and bool(first.any()) and not bool(second.all())  # all three paths


def test_order_is_temperature_then_top_k_then_top_p():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top-p on the renormalised top-2 ([0.57, 0.43]) keeps one token; on the raw probs it would keep two
    assert (warp_probs(logits, 1.0, top_k=2, top_p=0.5) > 0).tolist() == [True, False, False, False]
    # temperature first: at T = 0.25 the first token alone holds > 0.7 of the mass
    assert (warp_probs(logits, 0.25, top_p=0.7) > 0).tolist() == [True, False, False, False]
    assert (warp_probs(logits, 1.0, top_p=0.7) > 0).tolist() == [True, True, False, False]


def test_disabled_filters_change_nothing():
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(1))
    plain = warp_probs(logits, 0.7)
    assert torch.equal(warp_probs(logits, 0.7, top_k=33, top_p=1.0), plain)
    assert torch.equal(warp_probs(logits, 0.7, top_k=None, top_p=None), plain)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature=1.0, top_p=0.0), "top_p must be in (0, 1]"),
    (dict(temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
    (dict(temperature=1.0, top_k=0), "top_k must be >= 1"),
])
def test_bad_warp_arguments_raise_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        warp_probs(torch.zeros(4), **kwargs)


# ---------------------------------------------------------------------------------------------- sample


def draw_many(probs: torch.Tensor, n: int, gen: torch.Generator, chunk: int = 20_000) -> torch.Tensor:
    """n draws from one distribution [V], a chunk of rows at a time to bound memory."""
    return torch.cat([sample(probs.expand(min(chunk, n - i), -1), gen) for i in range(0, n, chunk)])


@pytest.mark.parametrize("V", [16, 300, 1024])  # one block, a padded last block, several blocks
def test_sample_follows_probs_exactly_and_never_draws_a_zero(V):
    gen = torch.Generator().manual_seed(V)
    probs = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample().float()
    probs[::5] = 0  # zeros scattered everywhere
    assert law_pvalue(draw_many(probs, 100_000, gen), probs) > 1e-4


def test_sample_keeps_leading_dims():
    probs = torch.rand(4, 3, 5, 50)
    draws = sample(probs)
    assert draws.shape == (4, 3, 5) and draws.dtype == torch.long and (draws < 50).all()


def test_sample_redraws_exactly_when_the_block_bound_overshoots(monkeypatch):
    # a huge slack makes about half of the first draws land past a block's real mass: the redraw
    # loop must still produce the exact law
    monkeypatch.setattr(sampling, "_SUM_SLACK", 1.0)
    V = 700
    probs = torch.distributions.Dirichlet(torch.ones(V)).sample().float()
    probs[300:600] = 0  # whole empty blocks
    assert law_pvalue(draw_many(probs, 100_000, torch.Generator().manual_seed(0)), probs) > 1e-4


def test_sample_takes_unnormalised_rows_one_hots_and_float64():
    probs = torch.tensor([[0.0, 0.0, 5.0], [2.0, 0.0, 0.0], [0.0, 1e-30, 0.0]], dtype=torch.float64)
    assert sample(probs.expand(1000, 3, 3)).unique(dim=0).tolist() == [[2, 0, 1]]
    big = torch.zeros(2, 49152)
    big[0, -1] = 3.0  # all the mass in the very last token
    big[1, 256 * 7] = 1.0  # the first token of a block
    assert sample(big).tolist() == [49151, 256 * 7]


def test_sample_is_reproducible_with_a_generator():
    probs = torch.randn(64, 1000).softmax(-1)
    first = sample(probs, torch.Generator().manual_seed(3))
    assert torch.equal(first, sample(probs, torch.Generator().manual_seed(3)))
    assert not torch.equal(first, sample(probs, torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("bad", [torch.zeros(2, 10), torch.full((2, 10), float("nan"))])
def test_sample_rejects_rows_without_mass(bad):
    with pytest.raises(ValueError, match="positive, finite mass"):
        sample(bad)


# ---------------------------------------------------------------------------------------------- argmax


def test_argmax_equals_torch_argmax_with_ties_nans_and_padding():
    gen = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(5, 49152, generator=gen),
        torch.randint(0, 3, (40, 700), generator=gen).float(),  # many ties, padded last block
        torch.randn(2, 3, 513, generator=gen),
    ]
    tied = torch.randn(3, 1000, generator=gen)
    tied[:, [10, 600, 999]] = 50.0  # the same maximum in different blocks
    tied[2, 5] = float("nan")
    inf = torch.full((2, 300), float("-inf"))
    inf[1, 299] = 0.0
    for x in cases + [tied, inf]:
        assert torch.equal(argmax(x), x.argmax(-1))
