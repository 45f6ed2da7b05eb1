"""Drafting that does not pay stops within the call (output unchanged); drafting that pays goes on; greedy calls
by default, fixed-tree measurements (no curve) and an engine told not to are never switched. Greedy calls run
with stop_unpaid_drafting="always" here so that outputs can be compared token for token."""

import pytest
import torch

from headway.infer.calibrate import TreeBudget
from headway.infer.engine import Engine
from headway.infer.payoff import DraftingGuard
from tests.infer.test_speculative import Contrary, Oracle

NEW = 48
FLAT = TreeBudget(curve={1: 0.01, 64: 0.01})  # a tree's forward costs one plain forward: drafting is cheap


@pytest.fixture(scope="module")
def target():
    from headway.heads.target import load_target

    return load_target({"path": "tiny-random", "name": "tiny-random"})


@pytest.fixture(scope="module")
def prompt():
    return [torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(1)).tolist()]


@pytest.fixture(scope="module")
def continuation(target, prompt):
    return Engine(target).generate(prompt, max_new_tokens=NEW + 8, stop_on_eos=False).tokens


def test_the_guard_judges_only_after_enough_steps_and_with_its_margin():
    guard = DraftingGuard(tree_cost=1.2, min_steps=3)
    for _ in range(2):
        guard.record(step_s=0.05, forward_s=0.04)
    assert guard.pays(tau=1.0)  # two steps: too early to judge
    guard.record(step_s=0.05, forward_s=0.04)
    assert guard.cost == pytest.approx(1.5)  # 0.05 / 0.04 x 1.2 plain steps per speculative step
    assert not guard.pays(tau=1.45)
    assert guard.pays(tau=1.51)  # pays (breaking even would, too)


def test_a_drafter_that_never_pays_is_stopped_and_output_is_unchanged(target, prompt, continuation):
    plain = Engine(target).generate(prompt, max_new_tokens=NEW, stop_on_eos=False).tokens
    out = Engine(target, Contrary(continuation, target.model.config.vocab_size), budget=FLAT,
                 stop_unpaid_drafting="always").generate(prompt, max_new_tokens=NEW, stop_on_eos=False)
    assert out.tokens == plain
    assert out.stats.drafting_stopped_at == DraftingGuard.min_steps  # judged after the first 16 steps
    assert out.stats.target_forwards == NEW - 1  # then one plain step per token (the first came from prefill)


def test_a_drafter_that_pays_keeps_drafting(target, prompt, continuation):
    out = Engine(target, Oracle(continuation), budget=FLAT, stop_unpaid_drafting="always").generate(
        prompt, max_new_tokens=NEW, stop_on_eos=False)
    assert out.tokens[0] == continuation[0][:NEW]
    assert out.stats.drafting_stopped_at is None and out.stats.tau > 4


@pytest.mark.parametrize("engine_args", [dict(budget=TreeBudget(), stop_unpaid_drafting="always"),
                                         dict(budget=FLAT, stop_unpaid_drafting="never"),
                                         dict(budget=FLAT)])  # the default: only when sampling
def test_without_a_curve_or_when_told_not_to_drafting_is_never_stopped(target, prompt, continuation, engine_args):
    drafter = Contrary(continuation, target.model.config.vocab_size)
    out = Engine(target, drafter, **engine_args).generate(prompt, max_new_tokens=NEW, stop_on_eos=False)
    assert out.stats.drafting_stopped_at is None and out.stats.target_forwards == NEW - 1
    assert out.stats.drafted_at_depth[0] == out.stats.row_steps  # every step drafted


def test_a_sampling_call_stops_drafting_that_does_not_pay_by_default(target, prompt, continuation):
    drafter = Contrary(continuation, target.model.config.vocab_size)
    out = Engine(target, drafter, budget=FLAT).generate(prompt, max_new_tokens=NEW, temperature=1.0, seed=0,
                                                        stop_on_eos=False)
    assert out.stats.drafting_stopped_at is not None and len(out.tokens[0]) == NEW


def test_a_bad_choice_is_one_clear_error(target):
    from headway.infer.engine import EngineError

    with pytest.raises(EngineError, match="stop_unpaid_drafting must be sampling, always or never"):
        Engine(target, stop_unpaid_drafting="yes")
