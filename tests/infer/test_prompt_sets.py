"""Held-out evaluation prompt sets: format, categories, and no overlap with any training prompt."""

import json
import re
from collections import Counter

import pytest

from headway.infer.prompt_sets import PromptSetError, load_prompt_set

CHAT_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def test_chat_set():
    rows = load_prompt_set("chat")
    assert len(rows) == 80 and len({r["id"] for r in rows}) == len(rows)
    assert Counter(r["category"] for r in rows) == {c: 10 for c in CHAT_CATEGORIES}


@pytest.mark.parametrize("old", ["mt-bench", "MTBench", "mt_bench"])
def test_the_old_name_of_the_chat_set_says_its_new_name(old):
    with pytest.raises(PromptSetError, match="now called 'chat'.*prompts=chat"):
        load_prompt_set(old)


def test_humaneval_set():
    rows = load_prompt_set("humaneval")
    assert len(rows) == 164 and rows[0]["id"] == "HumanEval/0" and {r["category"] for r in rows} == {"coding"}
    assert all(r["code"] in r["prompt"] and "def " in r["code"] for r in rows)


def test_prompt_set_from_path_and_errors(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "a", "category": "qa", "prompt": "Why?"}) + "\n")
    assert load_prompt_set(str(path)) == [{"id": "a", "category": "qa", "prompt": "Why?"}]
    with pytest.raises(PromptSetError, match="unknown prompt set"):
        load_prompt_set("no-such-set")
    path.write_text(json.dumps({"prompt": "Why?"}) + "\n")
    assert load_prompt_set(str(path)) == [{"id": "mine-1", "category": "general", "prompt": "Why?"}]
    path.write_text(json.dumps({"id": "a", "text": "Why?"}) + "\n")
    with pytest.raises(PromptSetError, match="mine.jsonl:1 has no \"prompt\""):
        load_prompt_set(str(path))


# ---------------------------------------------------------------------------------- no overlap

def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def training_prompts() -> list[str]:
    """Every user turn of the built-in training sets."""
    rows = [json.loads(line) for line in open("train/data/builtin/tiny.jsonl")]
    prompts = [m["content"] for r in rows for m in r["messages"] if m["role"] == "user"]
    from headway.train.data.default_set import default_prompts

    return prompts + [p["prompt"] for p in default_prompts()]


@pytest.mark.parametrize("name", ["chat", "humaneval"])
def test_eval_prompts_never_overlap_training_prompts(name):
    """No eval prompt equals a training prompt, and none shares an 8-word passage with one."""
    train = training_prompts()
    train_exact = {" ".join(p.lower().split()) for p in train}
    train_shingles = set().union(*(shingles(p) for p in train))
    for row in load_prompt_set(name):
        text = row.get("code", row["prompt"])
        assert " ".join(row["prompt"].lower().split()) not in train_exact, row["id"]
        shared = shingles(text) & train_shingles
        assert not shared, f"{row['id']} shares {sorted(shared)[:2]} with a training prompt"


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "{path}:2 is not UTF-8 text"),
    (b"", "{path} is empty"),
    (b'{"prompt": "ok"}\n{"prompt": "cut', "{path}:2 is not valid JSON"),
])
def test_a_bad_prompt_file_names_file_and_line(content, message, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(PromptSetError, match=message.format(path=path).replace("(", "\\(")):
        load_prompt_set(str(path))
