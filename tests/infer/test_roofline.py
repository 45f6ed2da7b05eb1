"""The roofline formulas: ridge point, the chain speedup (Leviathan et al. 2023) and its limits, the best
tree size."""

import json

import pytest
import torch

from headway.heads.target import target_config, target_preset
from headway.infer import roofline as rf

H100 = rf.DEVICES["h100-sxm"]
# A 7B-class Llama: d_model far above the token counts of interest, so I(N) ~ N holds (bf16)
LLAMA7B = rf.TargetShape("llama-7b", hidden=4096, intermediate=11008, layers=32, vocab=32000, heads=32,
                         kv_heads=32, head_dim=128)


def test_param_count_matches_smollm2():
    # SmolLM2-135M-Instruct's checkpoint holds 134,515,008 parameters (tied embeddings)
    assert rf.get_target("smollm2-135m").num_params == 134_515_008


def test_param_count_from_hf_config_file(tmp_path):
    cfg = dict(target_config(target_preset("smollm2-135m")), tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = rf.get_target(str(tmp_path))
    assert shape.num_params == 134_515_008 + 49152 * 576  # an untied LM head adds V x h


def test_intensity_is_about_n_in_bf16_for_a_large_model():
    for n in (1, 8, 64):
        assert float(rf.intensity(LLAMA7B, n, 2)) == pytest.approx(n, rel=0.05)


def test_ridge_point_near_hand_computed_value_for_h100():
    # N_ridge = 989 / 3.35 ~ 295 tokens for a bf16 model with N << d_model
    assert H100.ridge_intensity == pytest.approx(295.2, abs=0.1)
    n_ridge = rf.ridge_tokens(LLAMA7B, H100, 2)
    assert 295 <= n_ridge <= 400  # activation traffic pushes it a little above the weight-only value
    # latency is flat below the ridge and grows linearly well above it
    t = rf.predicted_latency(LLAMA7B, H100, torch.tensor([1, 64, 4 * n_ridge, 8 * n_ridge]), 2)
    assert float(t[1] / t[0]) < 1.05
    assert 2.0 <= float(t[3] / t[2]) <= 2.2  # linear in N, plus attention's N x (context + N) term


def test_ridge_point_grows_with_bandwidth_scarcity_and_shrinks_with_fewer_bytes():
    slow_mem = rf.DeviceSpec("x", H100.peak_flops, H100.bandwidth / 4)
    assert rf.ridge_tokens(LLAMA7B, slow_mem, 2) > rf.ridge_tokens(LLAMA7B, H100, 2)
    assert rf.ridge_tokens(LLAMA7B, H100, 1) < rf.ridge_tokens(LLAMA7B, H100, 2)  # fp8 weights


def test_speedup_formula_worked_example_and_limits():
    # Leviathan et al. 2023, chain speedup: alpha 0.8, gamma 5, c 0.05 -> 3.69 tokens/step, 2.95x
    assert rf.expected_tokens_chain(0.8, 5) == pytest.approx(3.689, abs=1e-3)
    assert rf.chain_speedup(0.8, 5, 0.05) == pytest.approx(2.951, abs=1e-3)
    assert rf.chain_speedup(0.0, 5, 0.1) == pytest.approx(1 / 1.5)  # nothing accepted: pure overhead
    assert rf.chain_speedup(1.0, 5, 0.0) == pytest.approx(6.0)  # everything accepted, free drafts
    assert rf.chain_speedup(1 - 1e-9, 5, 0.0) == pytest.approx(6.0, rel=1e-6)  # continuous at alpha = 1
    assert rf.chain_speedup(0.7, 0, 0.3) == pytest.approx(1.0)  # no drafts: plain decoding
    assert rf.chain_speedup(0.9, 4, 0.05) > rf.chain_speedup(0.6, 4, 0.05)


def flat(n):  # a target whose step latency never grows: verification is free
    return torch.ones_like(torch.as_tensor(n, dtype=torch.float64))


def test_tree_probs_form_a_valid_tree_best_first():
    nodes = rf.tree_path_probs([0.8, 0.6, 0.5], max_nodes=50, top_k=4)
    probs = [p for p, _ in nodes]
    assert probs == sorted(probs, reverse=True)
    assert max(d for _, d in nodes) <= 3  # never deeper than the measured depths
    assert nodes[0] == (pytest.approx(0.8), 1)
    # the whole 3-deep 4-wide tree has 4 + 16 + 64 nodes; its path probabilities sum to E[tokens] - 1
    full = rf.tree_path_probs([0.8, 0.6, 0.5], max_nodes=1000, top_k=4)
    assert len(full) == 84


def test_chain_plan_matches_simulated_tau():
    # top_k = 1 makes the tree a chain: expected tokens = 1 + sum_k prod_j a_j (expected tokens of a chain)
    rates = [0.8, 0.6, 0.5]
    plan = rf.best_tree(rates, flat, draft_cost=0.0, max_nodes=10, top_k=1)
    assert plan.size == 3 and plan.depth == 3
    assert plan.expected_tokens == pytest.approx(1 + 0.8 + 0.48 + 0.24)


def linear(n):  # every verified token adds 5% of a plain step
    return 1 + torch.as_tensor(n, dtype=torch.float64) / 20


def test_best_chain_deepens_and_speedup_grows_with_acceptance():
    chains = [rf.best_tree([a] * 12, linear, 0.02, top_k=1) for a in (0.3, 0.5, 0.7, 0.9)]
    assert [p.size for p in chains] == sorted(p.size for p in chains) and chains[-1].size > chains[0].size
    trees = [rf.best_tree([a] * 12, linear, 0.02) for a in (0.3, 0.5, 0.7, 0.9)]
    assert [p.speedup for p in trees] == sorted(p.speedup for p in trees)
    assert all(t.speedup >= c.speedup for t, c in zip(trees, chains))  # a tree never loses to its chain


def test_best_tree_shrinks_as_verification_or_drafting_gets_dearer():
    def roof(bw):  # 100 TFLOP/s and bw bytes/s: the ridge moves to smaller N as bandwidth grows
        return lambda n: rf.predicted_latency(LLAMA7B, rf.DeviceSpec("d", 100e12, bw), n, 2)

    sizes = [rf.best_tree([0.7] * 6, roof(bw), 0.02).size for bw in (0.5e12, 2e12, 8e12, 32e12)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    plans = [rf.best_tree([0.7] * 6, linear, c) for c in (0.0, 0.1, 0.5, 5.0)]
    assert [p.depth for p in plans] == sorted((p.depth for p in plans), reverse=True)
    assert plans[-1].size == 0 and plans[-1].speedup == pytest.approx(1.0)  # drafting too dear: don't
    # free verification and free drafting: the biggest tree allowed wins
    assert rf.best_tree([0.7] * 6, flat, 0.0, max_nodes=40).size == 40


def test_read_acceptance_from_eval_json(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps({"acceptance_by_depth": [0.7, 0.5]}))
    assert rf.read_acceptance(str(tmp_path)) == [0.7, 0.5]
    assert rf.read_acceptance("0.9, 0.4") == [0.9, 0.4]
    with pytest.raises(rf.RooflineError):
        rf.read_acceptance("0.9,1.5")
    with pytest.raises(rf.RooflineError):
        rf.read_acceptance(str(tmp_path / "missing.json"))


def test_cli_prints_the_model(capsys):
    assert rf.main(["device=h200", "target=smollm2-135m", "dtype=bf16", "acceptance=[0.8,0.6,0.4]"]) == 0
    out = capsys.readouterr().out
    assert "N_ridge" in out and "T(N) pred ms" in out and "best size" in out
    assert "speedup 2.95x" in out  # defaults alpha 0.8, gamma 5, c 0.05: the worked example above


@pytest.mark.parametrize("argv, named", [
    (["device=tpu"], "tpu"),
    (["config=/nonexistent/config.json", "device=a100"], "/nonexistent/config.json"),
    (["target=/nonexistent/config.json", "device=a100"], "config=PATH"),  # a path is not a preset
    (["alpha=2", "device=a100"], "alpha"),
    (["aplha=0.5"], "aplha"),  # a misspelled key fails instead of being ignored
    (["gamma=five"], "gamma"),
    (["acceptance=0.8,0.6"], "key=[a,b]"),  # Hydra's list syntax, named in the error
])
def test_cli_bad_input_is_one_line_exit_2(argv, named, capsys):
    assert rf.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err


def test_cli_on_this_machine_prints_measured_next_to_predicted(capsys):
    assert rf.main(["device=local", "target=tiny-random"]) == 0
    out = capsys.readouterr().out
    assert "device local" in out and "T(N) meas ms" in out and "of roofline" in out


def test_a_head_folder_stands_for_the_target_it_records(tmp_path, capsys):
    from headway.heads.base import build_head, save_head
    from headway.heads.target import load_target

    target = load_target(target_preset("tiny-random"))
    final = save_head(build_head("medusa", target, num_heads=2), tmp_path / "final")
    assert rf.main(["device=a100", f"config={final}"]) == 0
    out = capsys.readouterr().out
    assert f"target tiny-random: {sum(p.numel() for p in target.model.parameters()) / 1e6:.1f}M params" in out


def test_interpolated_measured_curve():
    t = rf.interpolate({1: 1.0, 4: 1.0, 8: 2.0})
    assert t(torch.tensor([1, 2, 4, 6, 8, 16])).tolist() == pytest.approx([1.0, 1.0, 1.0, 1.5, 2.0, 4.0])
    noisy = rf.interpolate({1: 1.5, 2: 1.0, 4: 1.2})  # a disturbed T(1) is lowered to T(2)
    assert noisy(torch.tensor([1, 2])).tolist() == pytest.approx([1.0, 1.0])


def test_lower_ranked_siblings_are_damped_by_their_rank():
    from headway.infer.roofline import tree_path_probs

    nodes = tree_path_probs([0.3], max_nodes=3, top_k=3)  # one depth: the three best siblings
    assert [p for p, _ in nodes] == pytest.approx([0.3, 0.3 * 0.7 / 2, 0.3 * 0.7 ** 2 / 3])
