"""Conversations -> tokenised, assistant-masked datasets and batches."""

import json

import pytest
import torch

from headway.train.data import DataConfig, DataError, build_datasets, collate_fn, token_counts
from headway.train.data.conversations import end_of_turn_markers, tokenize_conversation

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Eleven is prime too."},
]
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def masked_runs(ids, mask):
    """Contiguous runs of loss-masked token ids."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def check_mask_covers_assistant_turns(tokenizer, eot):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, 10_000, end_of_turn_markers(tokenizer))
    runs = [tokenizer.decode(r) for r in masked_runs(ids, mask)]
    assert runs == ["Seven." + eot, "Eleven is prime too." + eot]
    # the unmasked tokens are exactly everything else of the rendering (system, users, template glue)
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(ids) == full
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "Name a prime." in unmasked and "Seven" not in unmasked and "Eleven" not in unmasked


def test_mask_covers_exactly_assistant_tokens_chatml(tiny_tokenizer):
    check_mask_covers_assistant_turns(tiny_tokenizer, "<|im_end|>")


def test_mask_covers_exactly_assistant_tokens_smollm2(smollm2_tokenizer):
    check_mask_covers_assistant_turns(smollm2_tokenizer, "<|im_end|>")
    # no system message: the template injects its default one, which is never learned
    ids, mask = tokenize_conversation(smollm2_tokenizer, CONVERSATION[1:3], 10_000,
                                      end_of_turn_markers(smollm2_tokenizer))
    assert [smollm2_tokenizer.decode(r) for r in masked_runs(ids, mask)] == ["Seven.<|im_end|>"]


def test_mask_llama3_style_template():
    from headway.heads.target import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                         "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    check_mask_covers_assistant_turns(tok, "<|eot_id|>")


def test_prompt_tokens_match_generation_prompt(smollm2_tokenizer):
    """The ids before an assistant turn are exactly what inference feeds the target (prompt + generate)."""
    tok = smollm2_tokenizer
    ids, mask = tokenize_conversation(tok, CONVERSATION[:3], 10_000, end_of_turn_markers(tok))
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=True, add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    assert ids[:len(prompt)] == list(prompt) and not any(mask[:len(prompt)]) and mask[len(prompt)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def to_sharegpt(messages):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


def build(tokenizer, tmp_path, source, max_length=512, **overrides):
    cfg = DataConfig(name="t", source=source, cache_dir=str(tmp_path / "hf"), val_size=0, **overrides)
    return build_datasets(cfg, tokenizer, max_length, seed=0, return_stats=True)


def test_sharegpt_and_messages_give_same_examples(tiny_tokenizer, tmp_path):
    rows = [json.loads(line) for line in open("train/data/builtin/tiny.jsonl")]
    msgs = write_jsonl(tmp_path / "m.jsonl", rows)
    share = write_jsonl(tmp_path / "s.jsonl", [to_sharegpt(r["messages"]) for r in rows])
    a, _, sa = build(tiny_tokenizer, tmp_path, msgs)
    b, _, sb = build(tiny_tokenizer, tmp_path, share)
    assert len(a) == len(rows) and sa.kept == sb.kept == len(rows)
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]


def test_bad_rows_are_skipped_and_counted(tiny_tokenizer, tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [
        good,
        {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "late"}]},
        {"other": 1},
    ]
    ds, _, stats = build(tiny_tokenizer, tmp_path, write_jsonl(tmp_path / "bad.jsonl", rows), max_length=64)
    assert len(ds) == 1 and stats.rows == 7 and stats.kept == 1
    assert stats.skipped == {"unknown_role": 1, "empty_content": 1, "missing_field": 1, "no_assistant_turn": 1,
                             "no_assistant_token_after_truncation": 1, "missing_messages": 1}


def test_empty_dataset_is_a_clear_error(tiny_tokenizer, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "no answer"}]}] * 3
    with pytest.raises(DataError, match="no usable conversation.*no_assistant_turn=3"):
        build(tiny_tokenizer, tmp_path, write_jsonl(tmp_path / "empty.jsonl", rows))
    with pytest.raises(DataError, match="does not exist"):
        build(tiny_tokenizer, tmp_path, "./no/such/file.jsonl")
    with pytest.raises(DataError, match="expected a 'messages'"):
        build(tiny_tokenizer, tmp_path, write_jsonl(tmp_path / "cols.jsonl", [{"text": "a"}]))


def test_truncation_split_and_collate(tiny_tokenizer, tmp_path):
    cfg = DataConfig(name="tiny", source="builtin:tiny", cache_dir=str(tmp_path / "hf"), val_size=8)
    train, val = build_datasets(cfg, tiny_tokenizer, 48, seed=0)
    assert len(train) + len(val) <= 64 and len(val) == 8
    assert max(len(x) for x in train["input_ids"]) <= 48
    items = [train[i] for i in range(4)]
    batch = collate_fn(tiny_tokenizer.pad_token_id)(items)
    lengths = [len(x["input_ids"]) for x in items]
    assert batch["input_ids"].shape == (4, max(lengths)) and batch["loss_mask"].dtype == torch.bool
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for row, x in zip(range(4), items):  # right padding: the example first, then pad with mask off
        n = len(x["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == x["input_ids"]
        assert batch["loss_mask"][row, :n].tolist() == x["loss_mask"] and not batch["loss_mask"][row, n:].any()
        assert (batch["input_ids"][row, n:] == tiny_tokenizer.pad_token_id).all()


def test_split_seed_fixes_the_split_whatever_the_training_seed(tiny_tokenizer, tmp_path):
    def val_rows(seed, **extra):
        cfg = DataConfig(name="tiny", source="builtin:tiny", cache_dir=str(tmp_path / "hf"), val_size=8, **extra)
        return sorted(map(tuple, build_datasets(cfg, tiny_tokenizer, 48, seed=seed)[1]["input_ids"]))

    assert val_rows(0) != val_rows(1)  # by default the training seed draws the split
    assert val_rows(1, split_seed=0) == val_rows(2, split_seed=0) == val_rows(0)


def test_token_counts_count_only_assistant_tokens(tiny_tokenizer, tmp_path):
    train, _, stats = build(tiny_tokenizer, tmp_path, "builtin:tiny")
    counts = token_counts(train, len(tiny_tokenizer))
    expected = torch.zeros(len(tiny_tokenizer), dtype=torch.long)
    for x in train:
        for t, m in zip(x["input_ids"], x["loss_mask"]):
            expected[t] += m
    assert torch.equal(counts, expected) and counts.sum() == stats.train_loss_tokens
    assert counts[tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")] == 0


def test_packing_keeps_every_token(tiny_tokenizer, tmp_path):
    plain, _, _ = build(tiny_tokenizer, tmp_path, "builtin:tiny", max_length=256)
    packed, _, _ = build(tiny_tokenizer, tmp_path, "builtin:tiny", max_length=256, packing=True)
    assert len(packed) < len(plain) and max(len(x) for x in packed["input_ids"]) <= 256
    assert sum(plain["input_ids"], []) == sum(packed["input_ids"], [])
    assert sum(plain["loss_mask"], []) == sum(packed["loss_mask"], [])


def test_unknown_option_and_bad_values(tiny_tokenizer):
    with pytest.raises(DataError, match="unknown data option"):
        build_datasets({"name": "x", "sorce": "builtin:tiny"}, tiny_tokenizer, 64)
    with pytest.raises(DataError, match="data.format"):
        build_datasets({"name": "x", "format": "alpaca"}, tiny_tokenizer, 64)
    with pytest.raises(DataError, match="data.cache_precision=fp16: use one of auto, fp32, bf16"):
        build_datasets({"name": "x", "cache_precision": "fp16"}, tiny_tokenizer, 64)


@pytest.mark.parametrize("name", ["tiny", "default", "sharegpt", "ultrachat", "local"])
def test_data_yaml_matches_schema(name):
    from omegaconf import OmegaConf

    text = open(f"conf/data/{name}.yaml").read()
    assert text.startswith("# ") and "train/main.py" in text.splitlines()[0]
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(f"conf/data/{name}.yaml"))
    assert OmegaConf.to_object(merged).name == name


def test_row_rejected_by_the_chat_template_is_skipped(tmp_path):
    from headway.heads.target import CHATML_TEMPLATE, build_tiny_tokenizer

    tok = build_tiny_tokenizer()  # a strict template, like Mistral's: roles must alternate
    tok.chat_template = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]"
                         "['role'] %}{{ raise_exception('roles must alternate') }}{% endif %}{% endfor %}"
                         + CHATML_TEMPLATE)
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                          {"role": "assistant", "content": "c"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}]}]
    ds, _, stats = build(tok, tmp_path, write_jsonl(tmp_path / "strict.jsonl", rows))
    assert len(ds) == 1 and stats.skipped == {"rejected_by_chat_template": 1}
