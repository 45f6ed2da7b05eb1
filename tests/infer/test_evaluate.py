"""`python -m headway.infer.evaluate` on the tiny target: eval.json schema, lossless greedy output, the training-free
baseline, and one clear error (exit 2, nothing written) for every kind of bad input."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from headway.heads.base import build_head, save_head
from headway.heads.target import TargetSpec, load_target
from headway.infer import evaluate as ev
from headway.infer.intervals import prompt_key

REPO = Path(__file__).resolve().parents[2]
TINY = {"path": "tiny-random", "name": "tiny-random"}
SCHEMA = {"target", "head", "temperature", "num_prompts", "tau", "acceptance_by_depth", "by_category",
          "tokens_per_second", "speedup_vs_vanilla", "speedup_vs_hf_generate", "greedy_match", "draft",
          "weight_layout", "step_ms", "draft_vocab_coverage", "max_new_tokens", "tau_ci95", "per_prompt",
          "greedy_mismatches"}
PROMPTS = [{"prompt": "Name three colours.", "category": "writing"},
           {"prompt": "abc abc abc abc abc", "category": "coding"},
           {"prompt": "What is 2 + 2?"}]  # no category: counted as "general"


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """An untrained head for the tiny target, saved like a run's final/."""
    target = load_target(TINY)
    head = build_head("medusa", target, num_heads=3)
    return save_head(head, tmp_path_factory.mktemp("run") / "final")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The tiny target saved as an HF model folder: as a draft model it proposes exactly what it decodes."""
    target = load_target(TINY)
    path = tmp_path_factory.mktemp("draft_model")
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def make_cfg(*overrides):
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("eval", overrides=["max_new_tokens=12", *overrides])


def quiet(*_):
    pass


def test_eval_json_schema_and_greedy_output_equals_plain(head_dir, prompts_file, tmp_path):
    out = tmp_path / "out"
    res = ev.evaluate(make_cfg(f"checkpoint={head_dir}", f"prompts={prompts_file}", "temperature=0",
                               f"output={out}", "+draft.policy=dynamic"), out=quiet)
    written = json.loads((out / "eval.json").read_text())
    assert written == res and set(written) == SCHEMA
    assert written["draft"]["policy"] == "DynamicTree" and written["acceptance_by_depth"]  # it drafted
    assert written["target"] == "tiny-random" and written["head"] == "medusa"
    assert written["num_prompts"] == 3 and written["temperature"] == 0.0
    assert written["greedy_match"] == 1.0  # lossless: greedy speculative output == plain decoding
    assert written["greedy_mismatches"] == []
    cat_taus = [c["tau"] for c in written["by_category"].values()]
    assert min(cat_taus) <= written["tau"] <= max(cat_taus)  # all steps pooled: between the categories
    assert all(0.0 <= a <= 1.0 for a in written["acceptance_by_depth"])
    rows = written["per_prompt"]  # each prompt's counts, in the order run; pooled they are tau
    assert [r["category"] for r in rows] == ["writing", "coding", "general"] and written["max_new_tokens"] == 12
    assert [r["prompt"] for r in rows] == [prompt_key(p["prompt"]) for p in PROMPTS]
    assert sum(r["emitted"] for r in rows) / sum(r["steps"] for r in rows) == pytest.approx(written["tau"])
    low, high = written["tau_ci95"]
    assert min(r["emitted"] / r["steps"] for r in rows) <= low <= written["tau"] <= high \
        <= max(r["emitted"] / r["steps"] for r in rows)
    assert {c: r["num_prompts"] for c, r in written["by_category"].items()} == {"coding": 1, "general": 1,
                                                                                 "writing": 1}
    assert set(written["tokens_per_second"]) == {"speculative", "vanilla", "hf_generate"}
    assert all(v > 0 for v in written["tokens_per_second"].values())
    tps = written["tokens_per_second"]
    assert written["speedup_vs_hf_generate"] == pytest.approx(tps["speculative"] / tps["hf_generate"])
    ms = written["step_ms"]  # where a step's time went: each phase timed, the speculative step their sum
    assert all(ms[k] > 0 for k in ("plain", "drafting", "tree_forward", "accepting"))
    assert ms["speculative"] == pytest.approx(ms["drafting"] + ms["tree_forward"] + ms["accepting"])
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.png"]  # no temp files left


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_draft_vocab_coverage_is_the_share_of_reply_tokens_a_draft_can_propose(kind, monkeypatch):
    """Medusa drafts among the inference draft vocabulary (the 2 most frequent tokens here); EAGLE-3 also
    only among its own read-out's 3 tokens, whatever larger inference vocabulary is asked for."""
    target = load_target(TargetSpec(path="tiny-random", name="tiny-random"))
    head = build_head(kind, target, **({"draft_vocab_size": 3} if kind == "eagle3" else {}))
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    counts[torch.tensor([10, 20, 30, 40])] = torch.tensor([4, 3, 2, 1])
    head.token_counts = counts
    head.init_from_data(counts)
    head.set_draft_vocab(2 if kind == "medusa" else 8)
    monkeypatch.setattr(ev, "COVERAGE_SIZES", (1, 2, 4))
    coverage = ev.draft_vocab_coverage(head, [[10, 20, 40], [30, 99]])  # 5 reply tokens
    draftable = {"medusa": 2 / 5, "eagle3": 3 / 5}[kind]  # {10, 20} / {10, 20, 30}
    assert coverage["draft_vocab"] == pytest.approx(draftable)
    assert coverage["by_size"] == pytest.approx({1: 1 / 5, 2: 2 / 5, 4: 4 / 5})
    assert ev.draft_vocab_coverage(None, [[10]]) is None and ev.draft_vocab_coverage(head, []) is None


def test_prompt_lookup_baseline_without_checkpoint(prompts_file, tmp_path):
    out = tmp_path / "pl"
    res = ev.evaluate(make_cfg("checkpoint=none", "drafter=prompt_lookup", "target=tiny-random",
                               f"prompts={prompts_file}", "baselines=[vanilla]", "plot=false",
                               f"output={out}"), out=quiet)
    assert res["head"] == "prompt_lookup" and res["greedy_match"] == 1.0
    assert res["tokens_per_second"]["hf_generate"] is None and res["speedup_vs_hf_generate"] is None
    assert sorted(p.name for p in out.iterdir()) == ["eval.json"]


def self_drafting(target_dir, prompts_file, tmp_path, *overrides):
    """The target drafting for itself: a chain of 3 that verification should accept in full."""
    return make_cfg("checkpoint=none", "drafter=draft_model", f"draft_model={target_dir}", "target=tiny-random",
                    f"prompts={prompts_file}", "baselines=[]", "plot=false", f"output={tmp_path / 'o'}",
                    "budget=static", "+draft.policy=chain", "+draft.gamma=3", *overrides)


def test_a_draft_model_equal_to_the_target_reports_tau_gamma_plus_one(target_dir, prompts_file, tmp_path):
    res = ev.evaluate(self_drafting(target_dir, prompts_file, tmp_path, "temperature=0"), out=quiet)
    assert res["head"] == "draft_model" and res["greedy_match"] == 1.0
    assert res["tau"] == 4.0 and res["acceptance_by_depth"] == [1.0, 1.0, 1.0]  # 3 drafts + the bonus token
    assert {c: r["tau"] for c, r in res["by_category"].items()} == {"coding": 4.0, "general": 4.0, "writing": 4.0}


def test_sampling_reports_no_greedy_match(target_dir, prompts_file, tmp_path):
    res = ev.evaluate(self_drafting(target_dir, prompts_file, tmp_path, "temperature=1", "top_p=0.9",
                                    "+draft.sample=true"), out=quiet)
    assert res["greedy_match"] is None and res["greedy_mismatches"] is None
    # drafts sampled from the target's own (warped) distribution are accepted up to float rounding; one
    # rejection among the 9 steps (3 prompts x 12 tokens / 4 per step) would cost at most 3/9 of tau
    assert res["tau"] == pytest.approx(4.0, abs=0.34)


def test_a_greedy_mismatch_is_reported_with_its_prompt_and_token(head_dir, prompts_file, tmp_path, monkeypatch):
    class PlainDecodingThatSlips(ev.Engine):  # the plain engine's second prompt ends on another token
        calls = 0

        def generate(self, prompts, **kwargs):
            out = super().generate(prompts, **kwargs)
            if self.drafter is None and kwargs.get("max_new_tokens") == 12:
                PlainDecodingThatSlips.calls += 1
                if PlainDecodingThatSlips.calls == 2:
                    out.tokens[0][-1] = (out.tokens[0][-1] + 1) % 50
            return out
    monkeypatch.setattr(ev, "Engine", PlainDecodingThatSlips)
    lines = []
    res = ev.evaluate(make_cfg(f"checkpoint={head_dir}", f"prompts={prompts_file}", "temperature=0", "plot=false",
                               "baselines=[vanilla]", f"output={tmp_path / 'out'}", "+draft.policy=dynamic"),
                      out=lines.append)
    [miss] = res["greedy_mismatches"]
    assert miss["index"] == 1 and miss["prompt"] == prompt_key(PROMPTS[1]["prompt"]) and miss["at"] == 11
    assert miss["tie"] is not None and res["greedy_match"] == pytest.approx(2 / 3)
    assert any(line.startswith("  prompt 2 differs from its token 12 on: ") for line in lines)
    assert all(set(row) == {"prompt", "category", "emitted", "steps"} for row in res["per_prompt"])


def test_a_greedy_mismatch_is_told_apart_as_a_tie_or_a_real_difference():
    target = load_target(TINY)
    prompt = [5, 6, 7]
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt])).logits[0, -1]  # [V]
        best, worst = int(logits.argmax()), int(logits.argmin())
        readout = target.model.get_output_embeddings().weight
        twin = (best + 1) % readout.shape[0]
        readout[twin] = readout[best]  # two tokens the target can never tell apart: their logits tie exactly
    tie = ev.greedy_divergence(target, prompt, [twin, 3], [best, 4])
    assert tie == {"at": 0, "speculative": twin, "plain": best, "margin": 0.0, "tie": True}
    assert "tie in the target's logits" in ev.mismatch_words(dict(tie, index=0))
    real = ev.greedy_divergence(target, prompt, [worst], [best])
    assert real["tie"] is False and real["margin"] > 0.01
    assert "a verification error" in ev.mismatch_words(dict(real, index=0))
    prefix = ev.greedy_divergence(target, prompt, [best], [best, 9])  # no tie makes one output stop early
    assert prefix["at"] == 1 and prefix["tie"] is None and "verification error" in ev.mismatch_words(prefix)


# ----------------------------------------------------------------------------------------- bad input

def corrupt(head_dir, tmp_path, how):
    bad = tmp_path / "bad"
    shutil.copytree(head_dir, bad)
    if how == "garbage":
        (bad / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    elif how == "missing":
        (bad / "model.safetensors").unlink()
    return bad


@pytest.mark.parametrize("case", ["other_target", "garbage_weights", "missing_weights", "empty_prompts",
                                  "malformed_prompts", "no_prompt_field", "negative_temperature", "top_p_zero",
                                  "top_p_above_one", "prompt_too_long", "no_checkpoint", "bad_budget",
                                  "renamed_prompt_set", "bad_draft_vocab"])
def test_bad_input_raises_one_clear_error_and_writes_nothing(case, head_dir, prompts_file, tmp_path):
    ckpt, prompts, extra = head_dir, prompts_file, []
    if case == "garbage_weights":
        ckpt = corrupt(head_dir, tmp_path, "garbage")
    elif case == "missing_weights":
        ckpt = corrupt(head_dir, tmp_path, "missing")
    elif case == "empty_prompts":
        prompts.write_text("")
    elif case == "malformed_prompts":
        prompts.write_text('{"prompt": "ok"}\n{"prompt": \n')
    elif case == "no_prompt_field":
        prompts.write_text('{"text": "hello"}\n')
    elif case == "prompt_too_long":
        prompts.write_text(json.dumps({"prompt": "x" * 2100}) + "\n")  # byte-level: > 2048 positions
    elif case == "renamed_prompt_set":
        prompts = "mt-bench"
    extra = {"negative_temperature": ["temperature=-0.5"], "top_p_zero": ["top_p=0"],
             "top_p_above_one": ["top_p=1.5"], "no_checkpoint": ["checkpoint=none"],
             "bad_budget": ["budget=fixed"], "bad_draft_vocab": ["+draft.draft_vocab=many"]}.get(case, [])
    out = tmp_path / "out"
    cfg = make_cfg(f"checkpoint={ckpt}", f"prompts={prompts}", f"output={out}", *extra)
    if case == "other_target":  # the head was trained on hidden 64; this target has hidden 32
        cfg.target = TargetSpec(**TINY, tiny={"hidden_size": 32, "intermediate_size": 64})
    with pytest.raises(ev.ERRORS) as info:
        ev.evaluate(cfg, out=quiet)
    message = str(info.value)
    assert message and "\n" not in message
    assert case != "renamed_prompt_set" or "prompts=chat" in message
    assert not out.exists()


def test_cli_bad_input_exits_2_with_one_line(head_dir, prompts_file, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "headway.infer.evaluate", f"checkpoint={head_dir}",
                           f"prompts={prompts_file}", "temperature=-1", f"output={tmp_path / 'o'}"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "temperature" in lines[0]
    assert not (tmp_path / "o").exists()


def test_max_prompts_samples_every_category():
    from headway.infer.evaluate import load_prompts

    rows = load_prompts("chat", 16)
    categories = [r["category"] for r in rows]
    assert len(set(categories)) >= 8  # the first 16 are not all "writing"
    assert all(categories.count(c) <= 2 for c in set(categories))
