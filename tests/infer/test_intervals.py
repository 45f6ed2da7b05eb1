"""infer.intervals: bootstrap intervals of a pooled tau, and the paired difference of two heads."""

import pytest
import torch

from headway.infer.intervals import (IntervalError, compare_results, paired_difference, per_prompt, prompt_key,
                                     tau_interval)


def prompts(n, seed=0):
    """n prompts of 60-200 target steps whose own tau spreads over 1.2-3.0, as held-out prompts do."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(60, 200, (n,), generator=g)
    tau = 1.2 + 1.8 * torch.rand(n, generator=g)
    return (steps * tau).round().long().tolist(), steps.tolist()


def pooled(emitted, steps):
    return sum(emitted) / sum(steps)


def test_the_interval_holds_the_pooled_tau_and_narrows_with_more_prompts():
    few, many = prompts(12), prompts(480)
    low, high = tau_interval(*few)
    assert low < pooled(*few) < high
    wide = high - low
    low, high = tau_interval(*many)
    assert low < pooled(*many) < high
    assert high - low < 0.5 * wide  # 40x the prompts: ~1/6 the width


def test_prompts_of_one_tau_leave_no_doubt():
    low, high = tau_interval([20, 40, 60], [10, 20, 30])
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)


def test_the_interval_covers_the_true_tau_about_as_often_as_it_says():
    """Draw 48 prompts from a large population 200 times: the 95% interval should hold the population's tau
    in roughly 95% of draws (a biased or too narrow interval misses far more often)."""
    emitted, steps = (torch.tensor(x, dtype=torch.float64) for x in prompts(20_000, seed=1))
    truth = float(emitted.sum() / steps.sum())
    g = torch.Generator().manual_seed(2)
    hits = 0
    for _ in range(200):
        pick = torch.randint(len(steps), (48,), generator=g)
        low, high = tau_interval(emitted[pick], steps[pick], resamples=2000)
        hits += low <= truth <= high
    assert 0.88 <= hits / 200 <= 0.99


def test_a_shared_difficulty_makes_the_paired_interval_narrow():
    """Head b gains 0.05 tau on every prompt. Prompts differ far more than that, so separate intervals
    overlap, but pairing removes the prompts' own spread and the difference is clearly above zero."""
    ea, s = prompts(48)
    eb = [e + round(0.05 * n) for e, n in zip(ea, s)]
    a_low, a_high = tau_interval(ea, s)
    b_low, b_high = tau_interval(eb, s)
    assert b_low < a_high  # unpaired, the two overlap
    d = paired_difference((ea, s), (eb, s))
    assert d.delta == pytest.approx(pooled(eb, s) - pooled(ea, s))
    assert 0 < d.low < d.delta < d.high and d.above_zero == 1.0 and d.shared == 48


def test_a_head_against_itself_differs_by_nothing():
    e, s = prompts(30)
    d = paired_difference((e, s), (e, s))
    assert d.delta == 0 and d.low == 0 and d.high == 0 and d.above_zero == 0


def test_the_interval_is_a_function_of_the_seed():
    e, s = prompts(40)
    assert tau_interval(e, s, seed=3) == tau_interval(e, s, seed=3)
    assert tau_interval(e, s, seed=3) != tau_interval(e, s, seed=4)


@pytest.mark.parametrize("emitted, steps, match", [
    ([1, 2], [1], "one emitted count and one step count per prompt"),
    ([], [], "one emitted count"),
    ([3, 4], [2, 0], "at least one target step"),
])
def test_bad_counts_are_one_clear_error(emitted, steps, match):
    with pytest.raises(IntervalError, match=match):
        tau_interval(emitted, steps)


def result(rows, **extra):
    return {"tau": 0.0, "temperature": 0.0, "max_new_tokens": 64, **extra,
            "per_prompt": [{"prompt": prompt_key(p), "category": "c", "emitted": e, "steps": s} for p, e, s in rows]}


def test_results_are_compared_on_the_prompts_both_hold():
    a = result([("x", 30, 10), ("y", 40, 20), ("z", 10, 10)])
    b = result([("y", 50, 20), ("x", 30, 10), ("w", 99, 9)])  # another order, one prompt each of its own
    d = compare_results(a, b)
    assert d.shared == 2 and d.delta == pytest.approx(80 / 30 - 70 / 30)


def test_a_prompt_listed_twice_stays_two_prompts():
    counts = per_prompt(result([("x", 30, 10), ("x", 12, 6)]))
    assert list(counts.values()) == [(30, 10), (12, 6)]


@pytest.mark.parametrize("a, b, match", [
    (result([("x", 3, 1)]), {"tau": 2.0}, "b has no per-prompt counts"),
    (result([("x", 3, 1)]), result([("y", 3, 1)]), "share no prompt"),
    (result([("x", 3, 1)]), result([("x", 3, 1)], max_new_tokens=128), "max_new_tokens 64 and 128"),
    (result([("x", 3, 1)]), result([("x", 3, 1)], temperature=1.0), "temperature 0.0 and 1.0"),
])
def test_results_that_cannot_be_compared_say_why(a, b, match):
    with pytest.raises(IntervalError, match=match):
        compare_results(a, b)
