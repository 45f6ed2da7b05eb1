"""The default tree policy plans the tree from measured acceptance, the target's T(N) and the draft cost:
cheap drafting and good heads get big trees, expensive drafting or slow wide steps get small ones or none."""

import pytest
import torch

from headway.heads.base import HeadError, build_head, load_head, save_head
from headway.heads.target import load_target
from headway.infer.calibrate import TreeBudget
from headway.infer.drafters import AutoTree, build_drafter
from headway.infer.engine import Engine


class Proposer:  # what AutoTree reads from a proposer
    def __init__(self, acceptance=(), level_params=10, max_depth=None):
        self.acceptance, self._params, self.max_depth = list(acceptance), level_params, max_depth

    def level_params(self):
        return self._params


def planned(policy, proposer, budget, batch_size=1, target_params=1000):
    policy.plan(proposer, budget, batch_size, target_params)
    return policy.planned


def test_cheap_drafts_and_a_flat_curve_give_a_big_deep_tree():
    plan = planned(AutoTree(), Proposer([0.8, 0.7, 0.6, 0.5], level_params=1), TreeBudget(max_nodes=32))
    assert plan.size == 31 and plan.depth == 4


def test_a_draft_level_costing_a_target_step_means_no_drafting():
    plan = planned(AutoTree(), Proposer([0.3, 0.2], level_params=1000), TreeBudget(max_nodes=32))
    assert plan.size == 0


def test_a_steep_latency_curve_shrinks_the_tree():
    flat = TreeBudget(max_nodes=64, curve={1: 1.0, 64: 1.0})
    steep = TreeBudget(max_nodes=64, curve={1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6, 16: 2.0, 64: 8.0})
    head = Proposer([0.7, 0.6, 0.5, 0.4], level_params=50)
    assert planned(AutoTree(), head, steep).size < planned(AutoTree(), head, flat).size


def test_the_batch_throttle_caps_the_tree():
    budget = TreeBudget(max_nodes=64)  # static throttle: one node (no drafting) past batch 32
    assert planned(AutoTree(), Proposer([0.9, 0.9]), budget, batch_size=64).size == 0


def test_given_acceptance_overrides_the_heads_and_depth_is_capped_by_the_head():
    policy = AutoTree(acceptance=[0.9, 0.9, 0.9, 0.9, 0.9], top_k=1)
    plan = planned(policy, Proposer([0.1], level_params=1, max_depth=3), TreeBudget(max_nodes=16))
    assert plan.depth == 3 and plan.size == 3  # a chain: top_k 1, three depths


def test_the_recorded_validation_acceptance_is_loaded_with_the_head(tmp_path):
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    head = build_head("eagle", target)
    validation = {"loss": 1.0, "acc_depth_1": 0.5, "acc_depth_2": 0.25, "acc_depth_3": 0.0}
    save_head(head, tmp_path / "final", extra={"training": {"validation": validation}})
    assert load_head(tmp_path / "final", target).acceptance == [0.5, 0.25]  # depth 3 never measured


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def head_drafter_and_plain_output(kind: str, max_new_tokens: int):
    """A tiny target, an untrained `kind` head drafting through an auto tree, and plain decoding's PROMPTS output."""
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    torch.manual_seed(0)
    drafter = build_drafter("head", target, head=build_head(kind, target), acceptance=[0.9, 0.8, 0.7], top_k=2)
    return target, drafter, Engine(target).generate(PROMPTS, max_new_tokens=max_new_tokens, stop_on_eos=False).tokens


def test_an_auto_tree_engine_plans_from_the_budget_and_stays_lossless():
    target, drafter, plain = head_drafter_and_plain_output("mtp", 12)
    engine = Engine(target, drafter, budget=TreeBudget(max_nodes=16))
    out = engine.generate(PROMPTS, max_new_tokens=12, stop_on_eos=False)
    assert out.tokens == plain
    assert drafter.policy.planned.size >= 2  # mtp (2 depths) at rates 0.9/0.8: drafting pays


def test_a_marginal_gain_is_not_worth_drafting():
    head = Proposer([0.3], level_params=0)
    budget = TreeBudget(max_nodes=8, curve={1: 1.0, 2: 1.45, 8: 1.45})  # best plan: ~1.02x predicted
    assert planned(AutoTree(min_gain=1.0), head, budget).size > 0
    assert planned(AutoTree(), head, budget).size == 0


def test_a_measured_draft_cost_replaces_the_weight_estimate():
    policy, head, budget = AutoTree(), Proposer([0.6, 0.5, 0.4], level_params=1), TreeBudget(max_nodes=16)
    assert planned(policy, head, budget).size > 0  # a level's weights: 0.1% of the target's
    policy.observe_draft_cost(1.0)  # but the engine timed each level at a whole plain step
    assert planned(policy, head, budget).size == 0 and policy.planned_cost == 1.0
    assert policy.planned_cost_source == "measured"
    assert planned(AutoTree(draft_cost=0.001), head, budget).size > 0  # a given cost still wins


def test_the_engine_reports_what_a_draft_level_cost_and_the_next_call_plans_with_it():
    target, drafter, plain = head_drafter_and_plain_output("eagle", 40)
    budget = TreeBudget(max_nodes=16, curve={1: 1.0, 2: 1.0, 64: 1.0})
    unmeasured = Engine(target, drafter, budget=budget, stop_unpaid_drafting="never")  # the evaluator's setting
    assert unmeasured.generate(PROMPTS, max_new_tokens=40, stop_on_eos=False).tokens == plain
    assert drafter.policy.measured_cost is None  # "never": the plan from the head's weights stays
    engine = Engine(target, drafter, budget=budget)
    assert engine.generate(PROMPTS, max_new_tokens=40, stop_on_eos=False).tokens == plain
    measured = drafter.policy.measured_cost
    assert measured is not None and measured > 0  # a random head accepts little: many steps were timed
    out = engine.generate(PROMPTS, max_new_tokens=40, stop_on_eos=False)
    assert out.tokens == plain and drafter.describe()["draft_cost_from"] == "measured"
    assert drafter.policy.planned_cost == measured  # the second call planned with the first call's measurement


def test_accepted_paths_count_how_often_each_depths_rank_0_draft_was_offered_and_taken():
    policy = AutoTree()
    policy.drafted = (torch.tensor([-1, 0, 0, 1]), torch.tensor([-1, 0, 1, 0]))  # root; (0,), (1,), (0, 0)
    path = torch.tensor([[0, 1, 3],     # both rank-0 drafts accepted
                         [0, 2, -1],    # the rank-1 sibling accepted: depth 1 offered, not taken; (1,) has no child
                         [0, -1, -1]])  # nothing accepted
    policy.observe_accepted(path, torch.tensor([3, 2, 1]))
    assert policy.offered == [3, 1] and policy.taken == [1, 1]


def test_measured_acceptance_moves_the_plan_from_the_heads_validation():
    head = Proposer([0.9, 0.9, 0.9], level_params=1)
    budget = TreeBudget(max_nodes=16, curve={1: 1.0, 2: 1.1, 4: 1.3, 16: 2.0})  # each verified token costs
    policy = AutoTree(top_k=1)
    assert planned(policy, head, budget).depth == 3 and policy.acceptance_source == "validation"
    policy.drafted = (torch.tensor([-1, 0, 1, 2]), torch.tensor([-1, 0, 0, 0]))  # the chain it planned
    for _ in range(10):  # 320 row-steps: the head's first draft is accepted one time in ten, never a second
        policy.observe_accepted(torch.tensor([[0, 1, -1, -1]] * 4 + [[0, -1, -1, -1]] * 28), torch.tensor([2] * 4 + [1] * 28))
    rates = policy.expected_acceptance(head)
    assert abs(rates[0] - (40 + 32 * 0.9) / (320 + 32)) < 1e-9  # 40 taken of 320, beside the prior's 32 steps
    assert abs(rates[1] - 32 * 0.9 / (40 + 32)) < 1e-9 and rates[2] == 0.9  # depth 3 never offered: its prior
    assert planned(policy, head, budget).depth < 3 and policy.acceptance_source == "validation + 320 measured steps"
    given = AutoTree(acceptance=[0.9, 0.9, 0.9], top_k=1)
    given.drafted = policy.drafted
    given.observe_accepted(torch.tensor([[0, -1, -1, -1]] * 32), torch.tensor([1] * 32))
    assert planned(given, head, budget).depth == 3 and given.offered == []  # given acceptance is kept as given


def test_the_engine_reports_accepted_drafts_and_the_next_call_plans_with_them():
    target, _, plain = head_drafter_and_plain_output("eagle", 40)
    torch.manual_seed(0)
    drafter = build_drafter("head", target, head=build_head("eagle", target), top_k=2)  # no acceptance given
    budget = TreeBudget(max_nodes=16, curve={1: 1.0, 2: 1.0, 64: 1.0})
    assert Engine(target, drafter, budget=budget, stop_unpaid_drafting="never").generate(
        PROMPTS, max_new_tokens=40, stop_on_eos=False).tokens == plain
    assert drafter.policy.offered == []  # "never": the plan stays
    engine = Engine(target, drafter, budget=budget)
    out = engine.generate(PROMPTS, max_new_tokens=40, stop_on_eos=False)
    assert out.tokens == plain
    offered, taken = drafter.policy.offered, drafter.policy.taken
    assert offered[0] == out.stats.row_steps  # every step offered the rank-0 draft at depth 1
    assert sum(taken) <= out.stats.emitted - out.stats.row_steps  # taken drafts are accepted drafts
    engine.generate(PROMPTS, max_new_tokens=40, stop_on_eos=False)
    assert drafter.describe()["acceptance_from"].startswith("prior + ")


def test_measured_acceptance_alone_never_stops_drafting_but_the_cost_still_can():
    head = Proposer([0.9, 0.9, 0.9], level_params=1)
    budget = TreeBudget(max_nodes=16, curve={1: 1.0, 2: 1.1, 4: 1.3, 16: 2.0})
    for cost, size in ((None, 1), (1.0, 0)):  # the weights' cost (drafting pays at validation's rates), or a whole step
        policy = AutoTree(top_k=1, draft_cost=cost)
        policy.drafted = (torch.tensor([-1, 0]), torch.tensor([-1, 0]))
        policy.observe_accepted(torch.tensor([[0, -1]] * 320), torch.tensor([1] * 320))  # never accepted
        assert policy.expected_acceptance(head)[0] < 0.1
        assert planned(policy, head, budget).size == size  # one draft keeps measuring; a step-sized level: none


def test_sampling_calls_are_not_counted_and_plan_from_validation():
    target, _, _ = head_drafter_and_plain_output("eagle", 8)
    torch.manual_seed(0)
    drafter = build_drafter("head", target, head=build_head("eagle", target), top_k=2, draft_cost=0.001)
    engine = Engine(target, drafter, budget=TreeBudget(max_nodes=16, curve={1: 1.0, 2: 1.0, 64: 1.0}))
    engine.generate(PROMPTS, max_new_tokens=12, temperature=1.0, seed=0, stop_on_eos=False)
    assert drafter.policy.offered == []
    engine.generate(PROMPTS, max_new_tokens=12, stop_on_eos=False)
    assert drafter.policy.offered and drafter.describe()["acceptance_from"] == "prior"  # planned before counting
    engine.generate(PROMPTS, max_new_tokens=12, temperature=1.0, seed=0, stop_on_eos=False)
    assert drafter.describe()["acceptance_from"] == "prior"  # a sampling call plans from the prior still
    engine.generate(PROMPTS, max_new_tokens=12, stop_on_eos=False)
    assert drafter.describe()["acceptance_from"].startswith("prior + ")


@pytest.mark.parametrize("options, words", [({"learn": "maybe"}, "learn must be true or false"),
                                            ({"top_k": 0}, "top_k and max_depth")])
def test_a_bad_auto_tree_option_is_one_head_error_naming_it(options, words):
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    with pytest.raises(HeadError, match=words) as error:
        build_drafter("head", target, head=build_head("eagle", target), **options)
    assert "\n" not in str(error.value)  # the evaluator prints it as one `error:` line
