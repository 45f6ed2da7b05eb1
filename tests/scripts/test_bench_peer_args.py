"""bench_peer's input checks run before anything is built (no venvs needed)."""

import sys
from pathlib import Path

import pytest


@pytest.fixture
def bench_peer(load_script):
    return load_script("bench_peer")


def test_a_missing_data_file_is_one_clear_error_before_any_work(bench_peer, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"^error: --data .*nope\.jsonl: no such file"):
        bench_peer.main(["--out", str(out), "--data", str(tmp_path / "nope.jsonl")])
    assert not out.exists()


def test_the_judges_prompts_are_written_for_headways_evaluator_too(bench_peer, monkeypatch, tmp_path):
    """prompts.jsonl beside vLLM's prompts.json: headway's evaluator (a 3-draft chain) reads the same prompts."""
    import json

    from headway.infer.prompt_sets import load_prompt_set

    args = bench_peer.parse_args(["--out", str(tmp_path)])
    args.vllm_python = sys.executable

    def fake_judge(cmd, log, env=None):  # what scripts/peer/vllm_judge.py writes, without vLLM
        Path(cmd[5]).write_text(json.dumps({"mean_acceptance_length": 1.5, "acceptance_by_position": [0.5]}))

    monkeypatch.setattr(bench_peer, "run", fake_judge)
    assert bench_peer.judge(args, tmp_path, tmp_path, "headway-seed0")["mean_acceptance_length"] == 1.5
    vllm_prompts = json.loads((tmp_path / "judge" / "prompts.json").read_text())
    assert len(vllm_prompts) == 8 * args.per_category
    assert [r["prompt"] for r in load_prompt_set(str(tmp_path / "judge" / "prompts.jsonl"))] == vllm_prompts
