"""Self-distillation: the target answers every user turn; runs resume after a kill."""

import json
import subprocess
import sys

import pytest

from headway.heads.target import load_target
from headway.train.data.regenerate import GenerationSettings, done_ids, prompt_rows, regenerate

PROMPTS = [{"id": f"p{i}", "category": "qa", "prompt": f"Question number {i}?" + "!" * i} for i in range(5)]
MULTI_TURN = {"id": "mt", "conversations": [
    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
    {"from": "gpt", "value": "old answer"}, {"from": "human", "value": "Again"}, {"from": "gpt", "value": "old"}]}
SETTINGS = GenerationSettings(max_new_tokens=6, temperature=0.0, batch_size=2)


@pytest.fixture(scope="module")
def tiny_target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_answers_every_user_turn(tiny_target, tmp_path):
    rows, skipped = prompt_rows(PROMPTS + [MULTI_TURN, {"id": "bad", "messages": [{"role": "user"}]}])
    assert skipped == {"missing_field": 1}
    stats = regenerate(rows, tiny_target, tmp_path / "out.jsonl", SETTINGS, progress=False)
    out = {r["id"]: r for r in read(tmp_path / "out.jsonl")}
    assert stats["written"] == 6 and set(out) == {r["id"] for r in rows}
    mt = out["mt"]["messages"]
    assert [m["role"] for m in mt] == ["system", "user", "assistant", "user", "assistant"]
    assert "old" not in (mt[2]["content"], mt[4]["content"])  # regenerated, not copied
    row = out["p3"]
    assert row["prompt"] == PROMPTS[3]["prompt"] and row["messages"][-1]["content"] == row["response"]
    assert row["provenance"]["target"] == "tiny-random" and row["provenance"]["max_new_tokens"] == 6
    assert row["category"] == "qa" and stats["generated_tokens"] > 0


def test_regenerate_resumes_after_a_kill(tiny_target, tmp_path):
    rows, _ = prompt_rows(PROMPTS)
    whole = tmp_path / "whole.jsonl"
    regenerate(rows, tiny_target, whole, SETTINGS, progress=False)
    # a run killed mid-write: two complete rows and a torn third line
    lines = whole.read_text().splitlines(keepends=True)
    killed = tmp_path / "killed.jsonl"
    killed.write_text(lines[0] + lines[1] + lines[2][:15])
    stats = regenerate(rows, tiny_target, killed, SETTINGS, progress=False)
    assert stats["resumed"] == 2 and stats["written"] == 3
    got = read(killed)
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)  # each conversation exactly once
    assert done_ids(killed) == done_ids(whole)
    assert regenerate(rows, tiny_target, killed, SETTINGS, progress=False)["written"] == 0


def test_prepare_data_cli(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:3]))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "scripts/prepare_data.py", "target=tiny-random", f"input={src}", f"output={out}",
           "generation.max_new_tokens=4", "generation.batch_size=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(read(out)) == 3 and json.loads(done.stdout[done.stdout.index("{"):])["written"] == 3


def test_prepare_data_bad_input_is_a_clear_error(tmp_path):
    import importlib.util

    from headway.heads.target import TargetSpec
    from headway.train.data import DataError

    spec = importlib.util.spec_from_file_location("prepare_data", "scripts/prepare_data.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules["prepare_data"] = script  # dataclasses look their module up
    spec.loader.exec_module(script)
    cfg = script.PrepareConfig(input=str(tmp_path / "missing.jsonl"), output=str(tmp_path / "o.jsonl"),
                               target=TargetSpec(name="tiny-random", path="tiny-random"))
    with pytest.raises(DataError, match="does not exist"):
        script.prepare(cfg)
    cfg.input, cfg.output = str(tmp_path), None
    with pytest.raises(DataError, match="output=<file.jsonl> is required"):
        script.prepare(cfg)
    assert not (tmp_path / "o.jsonl").exists()
    cfg.output = str(tmp_path / "o.jsonl")
    cfg.generation.backend = "tensorrt"
    with pytest.raises(DataError, match="generation.backend='tensorrt': use one of hf, vllm, auto"):
        script.prepare(cfg)
    assert not (tmp_path / "o.jsonl").exists()


def test_prepare_data_builds_the_default_set_with_its_cache(tmp_path):
    """input=builtin:default: the settings of conf/data/default.yaml (overridable as default_set.regen.*),
    and the features head=eagle reads captured into the training cache."""
    import os

    cmd = [sys.executable, "scripts/prepare_data.py", "target=tiny-random", "max_conversations=3",
           "default_set.regen.target=tiny-random", "default_set.regen.target_name=tiny-random",
           "default_set.regen.self_prompts=0", "default_set.regen.max_new_tokens=4", "capture_head=eagle"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HEADWAY_CACHE=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{\n"):])  # the report: the last thing printed
    assert report["written"] == 3 and report["settings"]["sampled_fraction"] == 0.25  # conf/data/default.yaml
    assert len(read(tmp_path / "data" / report["output"].split("/")[-1])) == 3
    (cache,) = (tmp_path / "hidden").iterdir()
    assert cache.name.endswith("-L4")  # eagle reads the last hidden state of the 4-layer tiny target
    bad = subprocess.run(cmd[:-1] + ["capture_head=nope"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, HEADWAY_CACHE=str(tmp_path / "other")))
    assert bad.returncode == 2 and "capture_head='nope' is unknown" in bad.stderr.strip().splitlines()[-1]


def test_the_target_generates_in_the_weight_layout_asked_for_and_is_restored_after(tiny_target, tmp_path,
                                                                                   monkeypatch):
    from headway.heads.kernels.weight_layout import current_layout
    from headway.train.data import decode as decode_module

    seen, decode = [], decode_module.decode
    monkeypatch.setattr(decode_module, "decode", lambda model, *a, **k: (seen.append(current_layout(model)),
                                                                           decode(model, *a, **k))[1])
    rows, _ = prompt_rows(PROMPTS[:2])
    settings = GenerationSettings(max_new_tokens=4, batch_size=2, weight_layout="wide-column")
    regenerate(rows, tiny_target, tmp_path / "out.jsonl", settings, progress=False)
    assert seen == ["wide-column"] and current_layout(tiny_target.model) == "stock"


def test_a_weight_layout_the_target_cannot_run_is_one_clear_error(tiny_target, tmp_path):
    from headway.train.data.config import DataError

    rows, _ = prompt_rows(PROMPTS[:1])
    with pytest.raises(DataError, match="weight_layout=blocks: .*needs a target loaded from a block-quantized GGUF"):
        regenerate(rows, tiny_target, tmp_path / "out.jsonl", GenerationSettings(weight_layout="blocks"),
                   progress=False)
    assert not (tmp_path / "out.jsonl").exists() or not read(tmp_path / "out.jsonl")


def test_a_row_holding_a_unicode_line_separator_is_read_back_whole(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028 as it is; str.splitlines would cut the row there (a
    self-written prompt holding one once stopped a default dataset build)."""
    path = tmp_path / "rows.jsonl"
    rows = [{"id": "a", "prompt": "one\u2028two"}, {"id": "b", "prompt": "three"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert done_ids(path) == {"a", "b"}
