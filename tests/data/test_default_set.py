"""The default dataset built in one pass: prompts (written, stdlib, self-written), greedy and sampled replies,
and the hidden-state cache training reads, filled during generation; clear errors when nothing can be written."""

import json
import sys

import pytest
import torch

from headway.heads.target import load_target
from headway.train.data import DataConfig, DataError, build_datasets
from headway.train.data.capture import capture_plan
from headway.train.data.config import RegenConfig
from headway.train.data.hidden_cache import HiddenStateCache, build_cache
from headway.train.data.overlap import OverlapIndex, evaluation_prompts
from headway.train.data.regenerate import JsonlSink
from headway.train.data.self_prompts import (MAX_EXAMPLE_CHARS, CATEGORIES, SelfPromptSettings, example_pools,
                                             examples_for, select_prompts, user_turn_prefix)

LAYERS = [2, 4]  # an eagle3-like head on the tiny target (4 layers): aux layer 2 and the last one
REGEN = dict(target="tiny-random", target_name="tiny-random", num_prompts=10, max_new_tokens=8, batch_size=5,
             temperature=0.8, sampled_fraction=0.5, self_prompts=1, self_prompt_max_new_tokens=4,
             precision="fp32")  # fp32 on every CI machine (auto, the default, takes bf16 where the CPU has it)


@pytest.fixture(scope="module")
def target():
    """The tiny random target writing printable ASCII only: its replies decode to text that re-tokenises
    to the same bytes (random bytes would decode to U+FFFD and be skipped by the capture)."""
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    tok, head = target.tokenizer, target.model.lm_head.weight
    printable = [i for i in range(len(tok)) if len(s := tok.decode([i])) == 1 and "!" <= s <= "~"]
    with torch.no_grad():
        rows = head[printable] * 10  # the others' logits are 0: far below the best printable one
        head.zero_()
        head[printable] = rows
    return target


def default_cfg(tmp_path, **regen):
    return DataConfig(name="default", source="builtin:default", format="messages", hidden_states="offline",
                      val_size=3, cache_dir=str(tmp_path / "hf"), regen=RegenConfig(**{**REGEN, **regen}))


def test_generation_fills_the_cache_training_reads(target, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    cfg = default_cfg(tmp_path)
    capture = capture_plan(cfg, target, LAYERS, 96)
    train_ds, val_ds = build_datasets(cfg, target.tokenizer, 96, capture=capture)
    # the cache pass training runs next finds every example already there: one pass, not two
    stats = build_cache(capture.directory, target, [train_ds, val_ds], LAYERS, progress=False)
    assert stats["new_entries"] == 0 and stats["entries"] == len(train_ds) + len(val_ds) == 10
    cache = HiddenStateCache(capture.directory, target, LAYERS)
    assert cache.validate(target, samples=len(cache)) < 1e-4  # the cache's own recompute check
    data = next((tmp_path / "cache" / "data").glob("default-tiny-random-*[0-9a-f].jsonl"))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert {r["sampled"] for r in rows} == {True, False}  # greedy and sampled, recorded per row
    assert {r["source"] for r in rows} == {"written"}
    report = json.loads(data.with_name(data.name + ".report.json").read_text())
    assert report["captured"] == 10 and report["sampled"] == sum(r["sampled"] for r in rows)


def built_rows(**regen) -> tuple[dict, dict]:
    """The complete default dataset of these settings -> ({id: row}, its report)."""
    from headway.train.data.default_set import default_dataset_path, default_prompts
    from headway.train.data.config import RegenConfig

    cfg = RegenConfig(**{**REGEN, "self_prompts": 0, **regen})
    path = default_dataset_path(cfg, default_prompts(cfg.num_prompts))
    report = json.loads(path.with_name(path.name + ".report.json").read_text())
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}, report


def test_a_larger_build_answers_only_the_prompts_earlier_builds_did_not(target, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    build_datasets(default_cfg(tmp_path, num_prompts=6, self_prompts=0), target.tokenizer, 96)
    small, _ = built_rows(num_prompts=6)
    build_datasets(default_cfg(tmp_path, num_prompts=9, self_prompts=0), target.tokenizer, 96)
    large, report = built_rows(num_prompts=9)
    assert report["reused"] == 6 and report["written"] == 3 and report["resumed"] == 0
    assert all(large[i] == row for i, row in small.items())  # taken as they were, sampled ones included
    # another seed writes other replies: nothing is reused across it
    build_datasets(default_cfg(tmp_path, num_prompts=9, self_prompts=0, seed=1), target.tokenizer, 96)
    assert built_rows(num_prompts=9, seed=1)[1]["reused"] == 0
    build_datasets(default_cfg(tmp_path, num_prompts=7, self_prompts=0, reuse=False), target.tokenizer, 96)
    assert built_rows(num_prompts=7)[1]["written"] == 7


@pytest.mark.parametrize("steering", [{}, {"self_prompt_examples": 2, "self_prompt_examples_shared": 2}])
def test_a_larger_build_writes_only_the_candidates_earlier_builds_did_not(target, tmp_path, monkeypatch, steering):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))

    def candidates() -> dict[str, dict]:  # the largest build's, by id
        files = (tmp_path / "cache" / "data").glob("*-candidates.jsonl")
        rows = max(([json.loads(line) for line in f.read_text().splitlines()] for f in files), key=len)
        return {r["id"]: r for r in rows}

    build_datasets(default_cfg(tmp_path, num_prompts=4, self_prompts=1, **steering), target.tokenizer, 96)
    small = candidates()  # 2 per category (1 kept x oversample 1.5), kept and dropped
    build_datasets(default_cfg(tmp_path, num_prompts=4, self_prompts=2, **steering), target.tokenizer, 96)
    large = candidates()
    assert len(small) == 2 * len(CATEGORIES) and len(large) == 3 * len(CATEGORIES)
    # the same texts: written again, in batches of 3 instead of 2, they would be other draws
    assert all(large[i]["prompt"] == row["prompt"] for i, row in small.items())


def test_only_rows_answered_as_this_build_would_are_reused(tmp_path):
    from headway.train.data.reuse import reusable_answers

    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prov = {"target": "t", "seed": 0, "backend": "hf"}
    earlier = {"id": "a", "messages": turns + [{"role": "assistant", "content": "Hello"}], "provenance": prov}
    rows = [{"id": "a", "turns": turns}]

    def reused(row, **provenance):
        path = tmp_path / "default-t-0.jsonl"
        path.write_text(json.dumps(row) + "\nnot json\n")
        return reusable_answers(rows, {**prov, **provenance}, [path])

    assert reused(earlier) == [earlier]
    assert reused(earlier, backend="vllm") == [earlier]  # the backend changes speed, not what is written
    assert reused(earlier, seed=1) == []
    assert reused({**earlier, "id": "b"}) == []
    other_system = [{"role": "system", "content": "Be long."}] + earlier["messages"][1:]
    assert reused({**earlier, "messages": other_system}) == []


def test_reuse_reads_only_complete_builds_of_the_same_target(tmp_path):
    from headway.train.data.reuse import earlier_builds

    names = ["default-t-aaa.jsonl", "default-t-aaa-prompts.jsonl", "default-t-aaa-candidates.jsonl",
             "default-t-bbb.jsonl.partial", "default-t-bbb-prompts.jsonl.partial", "default-u-ccc.jsonl",
             "default-t-own.jsonl"]
    for name in names:
        (tmp_path / name).write_text("")
    own = tmp_path / "default-t-own.jsonl"
    assert [p.name for p in earlier_builds(own)] == ["default-t-aaa.jsonl"]
    assert [p.name for p in earlier_builds(own, "-candidates")] == ["default-t-aaa-candidates.jsonl"]


def test_no_capture_when_another_model_writes_the_data(target, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    other = load_target({"path": "tiny-random", "name": "tiny-random", "seed": 1})
    cfg = default_cfg(tmp_path, num_prompts=4, self_prompts=0)
    capture = capture_plan(cfg, other, LAYERS, 96)
    capture.target.spec.name = "other"  # not the model named in regen: its features would be wrong
    build_datasets(cfg, target.tokenizer, 96, capture=capture)
    assert not capture.directory.exists()


def test_unwritable_cache_is_one_clear_error(target, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HEADWAY_CACHE", str(blocker / "cache"))  # a folder that cannot be created
    with pytest.raises(DataError, match="cannot write .*writable folder"):
        build_datasets(default_cfg(tmp_path, num_prompts=2, self_prompts=0), target.tokenizer, 96)


def test_full_disk_is_a_data_error():
    sink = JsonlSink("/dev/full")  # every write fails with ENOSPC
    with pytest.raises(DataError, match="No space left"):
        sink.write([{"id": "a"}])


# ----------------------------------------------------------------------------- self-written prompts

def test_user_turn_prefix_ends_where_the_user_writes(target):
    ids = user_turn_prefix(target.tokenizer, "hint")
    assert target.tokenizer.decode(ids).endswith("<|im_start|>user\n") and "hint" in target.tokenizer.decode(ids)


def test_examples_come_first_as_earlier_user_turns(target):
    tok = target.tokenizer
    text = tok.decode(user_turn_prefix(tok, "hint", ["Write a poem.", "What is 2+2?"]))
    assert text.endswith("<|im_start|>user\n")
    users = text.split("<|im_start|>user\n")
    assert [u.split("<|im_end|>")[0] for u in users[1:-1]] == ["Write a poem.", "What is 2+2?"]
    assert all("<|im_start|>assistant\n...<|im_end|>" in u for u in users[1:-1])  # an answer between them


def test_each_candidate_draws_its_own_examples_the_same_way_every_time():
    pool = [f"Prompt number {i}." for i in range(20)]
    three = SelfPromptSettings(examples=3)
    draws = {row: examples_for(row, pool, three) for row in ("self-math-00000", "self-math-00001")}
    assert all(len(d) == 3 == len(set(d)) and set(d) <= set(pool) for d in draws.values())
    assert draws["self-math-00000"] != draws["self-math-00001"]  # candidates differ ...
    assert examples_for("self-math-00000", pool, three) == draws["self-math-00000"]  # ... a resumed build does not
    assert examples_for("self-math-00000", pool, SelfPromptSettings(examples=3, seed=1)) != draws["self-math-00000"]
    assert examples_for("x", pool[:2], three) == examples_for("x", pool[:2], three) and \
        len(examples_for("x", pool[:2], three)) == 2 and examples_for("x", [], three) == []
    assert examples_for("x", pool, SelfPromptSettings()) == []  # examples=0: the hint alone


def test_a_block_of_candidates_shares_one_draw_of_examples():
    pool = [f"Prompt number {i}." for i in range(40)]
    shared = SelfPromptSettings(examples=3, examples_shared=4)
    draws = [tuple(examples_for(f"self-math-{k:05d}", pool, shared)) for k in range(12)]
    assert len(set(draws[:4])) == len(set(draws[4:8])) == len(set(draws[8:])) == 1  # a block: one draw
    assert len(set(draws)) == 3  # blocks: their own draws
    assert draws[0] != tuple(examples_for("self-humanities-00000", pool, shared))  # categories: theirs
    own = SelfPromptSettings(examples=3)
    assert examples_for("self-math-00001", pool, own) != examples_for("self-math-00002", pool, own)


def test_shared_examples_key_a_new_dataset_and_a_bad_count_is_one_clear_error():
    from headway.train.data.default_set import default_dataset_path, default_prompts, self_prompt_settings

    prompts = default_prompts(4)
    own = RegenConfig(**{**REGEN, "self_prompts": 5, "self_prompt_examples": 3})
    shared = RegenConfig(**{**REGEN, "self_prompts": 5, "self_prompt_examples": 3, "self_prompt_examples_shared": 8})
    assert default_dataset_path(own, prompts) != default_dataset_path(shared, prompts)
    unsteered = RegenConfig(**{**REGEN, "self_prompts": 5})  # no examples shown: nothing shared, the same data
    assert default_dataset_path(unsteered, prompts) == \
        default_dataset_path(RegenConfig(**{**REGEN, "self_prompts": 5, "self_prompt_examples_shared": 8}), prompts)
    with pytest.raises(DataError, match=r"self_prompt_examples_shared=0: use 1"):
        self_prompt_settings(RegenConfig(**{**REGEN, "self_prompt_examples_shared": 0}))


def test_example_pools_hold_the_short_written_prompts_of_each_category():
    long_one = "Summarise: " + "word " * MAX_EXAMPLE_CHARS
    pools = example_pools([{"category": "math", "prompt": "What is 3 x 4?"},
                           {"category": "math", "prompt": long_one},
                           {"category": "translation", "prompt": "Translate 'cat' into French."}])
    assert pools["math"] == ["What is 3 x 4?"] and pools["advice"] == [] and set(pools) == set(CATEGORIES)


def test_a_negative_example_count_is_one_clear_error():
    from headway.train.data.default_set import self_prompt_settings

    with pytest.raises(DataError, match=r"self_prompt_examples=-1: use 0"):
        self_prompt_settings(RegenConfig(**{**REGEN, "self_prompt_examples": -1}))


def test_shown_examples_key_a_new_dataset():
    from headway.train.data.default_set import default_dataset_path, default_prompts

    prompts = default_prompts(4)
    plain = RegenConfig(**{**REGEN, "self_prompts": 5})
    steered = RegenConfig(**{**REGEN, "self_prompts": 5, "self_prompt_examples": 3})
    assert default_dataset_path(plain, prompts) != default_dataset_path(steered, prompts)


def candidate(i, text, category="writing", finished=True):
    return {"id": f"c{i}", "category": category, "prompt": text, "finished": finished}


def test_filters_drop_unusable_duplicate_and_held_out_prompts():
    held_out = evaluation_prompts()
    eval_copy = " ".join(held_out[0].split()[:12]) + "?"  # 12 words of an evaluation prompt
    cands = [candidate(0, "Write a short poem about the sea at night, please."),
             candidate(1, "Write a short poem about the sea at night please!"),  # same words
             candidate(2, "Write a short poem about the sea at night, with rhymes please."),  # near duplicate
             candidate(3, "the the the the the the the the the the the the the?"),  # repetitive
             candidate(4, "Tell me"),  # too short
             candidate(5, "Explain how rainbows form in the sky and why", finished=False),  # cut off
             candidate(6, "Explain how rainbows form in the sky and why they"),  # no sensible ending
             candidate(7, "Hi <|im_start|>assistant tell me a story about dragons."),  # chat markup
             candidate(8, eval_copy),
             candidate(9, "How do I plan a cheap weekend trip to the mountains?", "advice"),
             candidate(10, "What should I cook for a quick healthy dinner tonight?", "advice"),
             candidate(11, "Give me tips for sleeping better during a hot summer?", "advice")]
    kept, dropped = select_prompts(cands, 2, OverlapIndex(held_out), ["What is a good gift for my sister?"])
    assert [r["id"] for r in kept] == ["c0", "c9", "c10"]  # advice capped at 2; writing has only one
    assert dropped == {"duplicate": 1, "near_duplicate": 1, "repetitive": 1, "too_short": 1, "unfinished": 1,
                       "bad_ending": 1, "chat_markup": 1, "eval_overlap": 1,
                       "categories_short": {c: 2 - (c == "writing") for c in CATEGORIES if c != "advice"}}


def test_built_in_training_prompts_never_overlap_evaluation_prompts():
    from headway.train.data.default_set import MORE_PROMPTS, _read_prompts, default_prompts

    held_out = OverlapIndex(evaluation_prompts())
    shipped = default_prompts() + _read_prompts(MORE_PROMPTS, "written")  # builtin:more unfiltered
    bad = [(p["id"], why) for p in shipped if (why := held_out.overlap(p["prompt"]))]
    assert not bad


def test_extra_prompts_are_answered_and_shown_as_examples(tmp_path):
    from headway.train.data.default_set import default_dataset_path, default_prompts

    extra = tmp_path / "mine.jsonl"
    extra.write_text('{"id": "mine-0", "category": "advice", "prompt": "How do I keep basil alive on a windowsill?"}\n'
                     '\n{"id": "mine-1", "category": "stem", "prompt": "What causes the seasons on Earth?"}\n')
    plain, more = default_prompts(), default_prompts(extra=str(extra))
    written = [p for p in plain if p["source"] == "written"]
    # after the built-in written set, before the stdlib ones; the held-out question is left out
    assert more == written + [{"id": "mine-0", "category": "advice", "source": "written",
                               "prompt": "How do I keep basil alive on a windowsill?"}] + plain[len(written):]
    assert "How do I keep basil alive on a windowsill?" in example_pools(more)["advice"]
    assert example_pools(plain)["advice"] == []
    regen = RegenConfig(**REGEN)
    assert default_dataset_path(regen, more) != default_dataset_path(regen, plain)  # another dataset


def test_the_more_prompts_fill_every_self_prompt_category():
    from headway.train.data.default_set import default_prompts

    pools = example_pools(default_prompts(extra="builtin:more"))
    assert min(len(pool) for pool in pools.values()) >= 40  # advice had none


@pytest.mark.parametrize("text, says", [
    (None, "cannot read"),
    ('{"id": "x", "category": "stem"}\n', "line 1"),
    ('{"id": "writing-000", "category": "stem", "prompt": "Why is ice slippery?"}\n', "'writing-000' is taken"),
    ("\n\n", "no prompts"),
])
def test_a_bad_extra_prompt_file_is_one_clear_error(tmp_path, text, says):
    from headway.train.data.default_set import default_prompts

    path = tmp_path / "mine.jsonl"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DataError, match=f"data.regen.extra_prompts=.*{says}"):
        default_prompts(extra=str(path))


def test_the_default_prompts_do_not_depend_on_the_interpreter_path():
    """`python` and `accelerate launch` (python3) must key the same default dataset: no prompt may show a
    path of this machine (platform.architecture's default is sys.executable)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import hashlib, json; from headway.train.data.default_set import default_prompts; "
            "print(hashlib.sha256(json.dumps(default_prompts()).encode()).hexdigest())")
    real = Path(sys.executable).resolve()
    alias = Path(sys.executable).with_name("python-alias-for-test")
    alias.unlink(missing_ok=True)
    alias.symlink_to(real)
    try:
        digests = {subprocess.run([exe, "-c", code], capture_output=True, text=True, check=True).stdout
                   for exe in (sys.executable, str(alias))}
    finally:
        alias.unlink()
    assert len(digests) == 1


def test_the_default_prompts_do_not_depend_on_the_python_version(monkeypatch):
    """The stdlib coding prompts come from the shipped file, not from this interpreter's docstrings (which
    change between Python versions, and with them the default dataset and its key)."""
    from headway.train.data import stdlib_prompts
    from headway.train.data.default_set import STDLIB_PROMPTS, default_prompts

    monkeypatch.setattr(stdlib_prompts, "_candidates", lambda: pytest.fail("read this Python's docstrings"))
    shipped = [json.loads(line) for line in STDLIB_PROMPTS.read_text().splitlines()]
    stdlib = [p for p in default_prompts() if p["source"] == "stdlib"]
    assert len(shipped) == 100 and [p["prompt"] for p in stdlib] == [p["prompt"] for p in shipped]


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the shipped stdlib prompts were written by Python 3.11")
def test_the_shipped_stdlib_prompts_are_what_the_generator_writes():
    from headway.train.data.default_set import STDLIB_PROMPTS
    from headway.train.data.stdlib_prompts import stdlib_coding_prompts

    shipped = [json.loads(line) for line in STDLIB_PROMPTS.read_text().splitlines()]
    assert shipped == stdlib_coding_prompts(100)


def test_a_bf16_build_fills_the_cache_and_marks_what_it_computed(target, tmp_path, monkeypatch):
    """regen.precision=bf16: a bf16 copy of the target writes the data and its states; the fp32 target is
    back after, the set has its own key, and the cache's shards say they hold bf16-computed states, which
    validation then allows bf16's larger error (the fp32 tolerance would reject them)."""
    from headway.train.data.default_set import default_dataset_path, default_prompts
    from headway.train.data.hidden_cache import REL_TOL

    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    cfg = default_cfg(tmp_path, precision="bf16")
    capture = capture_plan(cfg, target, LAYERS, 96)
    train_ds, val_ds = build_datasets(cfg, target.tokenizer, 96, capture=capture)
    assert next(target.model.parameters()).dtype == torch.float32
    stats = build_cache(capture.directory, target, [train_ds, val_ds], LAYERS, progress=False)
    assert stats["new_entries"] == 0  # captured in the same pass, as in fp32
    cache = HiddenStateCache(capture.directory, target, LAYERS)
    assert {s.get("computed_in") for s in cache.index["shards"]} == {"bfloat16"}
    err = cache.validate(target, samples=len(cache))
    assert REL_TOL[torch.float32] < err < cache.tolerance(cache.keys()[0])
    prompts = default_prompts(REGEN["num_prompts"])
    paths = {p: default_dataset_path(RegenConfig(**{**REGEN, "precision": p}), prompts) for p in ("fp32", "bf16")}
    assert paths["fp32"] != paths["bf16"]
    assert paths["fp32"] == default_dataset_path(RegenConfig(**REGEN), prompts)


def test_an_unknown_generation_precision_is_one_clear_error(target, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DataError, match="precision=fp16: use one of auto, fp32, bf16"):
        build_datasets(default_cfg(tmp_path, precision="fp16"), target.tokenizer, 96)
    assert not list((tmp_path / "cache" / "data").glob("*.jsonl"))


@pytest.mark.parametrize("hardware_bf16", [True, False])
def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_it_and_keys_what_it_resolved_to(
        target, tmp_path, monkeypatch, hardware_bf16):
    """regen.precision=auto writes with a bf16 copy on a CPU with bf16 instructions and with the fp32 target
    elsewhere; the dataset it builds is the one that precision names (same key, same file)."""
    from headway.heads.kernels import machine_choice
    from headway.train.data.decode import resolve_precision
    from headway.train.data.default_set import default_dataset_path, default_prompts, ensure_default_dataset

    monkeypatch.setattr(machine_choice, "cpu_multiplies_bf16", lambda: hardware_bf16)
    resolved = "bf16" if hardware_bf16 else "fp32"
    assert resolve_precision("auto", "cpu") == resolved
    assert resolve_precision("fp32", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    regen = RegenConfig(**{**REGEN, "precision": "auto", "self_prompts": 0})
    built = ensure_default_dataset(regen, "cpu")
    want = default_dataset_path(RegenConfig(**{**REGEN, "precision": resolved, "self_prompts": 0}),
                                default_prompts(REGEN["num_prompts"]))
    assert built == want and built.is_file()
    rows = [json.loads(line) for line in built.read_text().splitlines()]
    assert {r["provenance"].get("precision", "fp32") for r in rows} == {resolved}  # fp32: the key as before


def test_generation_on_a_gpu_mixes_no_devices(target, tmp_path, monkeypatch):
    """The same build with the target on a GPU (tests/virtual_cuda.py's without one): prompts, replies and the
    hidden states captured on the way, written from host copies."""
    from tests.virtual_cuda import on_gpu

    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    cfg = default_cfg(tmp_path)
    with on_gpu(monkeypatch, target.model):
        capture = capture_plan(cfg, target, LAYERS, 96)
        train_ds, val_ds = build_datasets(cfg, target.tokenizer, 96, capture=capture)
        stats = build_cache(capture.directory, target, [train_ds, val_ds], LAYERS, progress=False)
    assert stats["new_entries"] == 0 and stats["entries"] == 10
