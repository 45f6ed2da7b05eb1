"""Prompts the target writes itself (Magpie, Xu et al. 2024): no external data.

An instruct model fed its chat template up to the start of a user turn (`<|im_start|>system\\n...<|im_end|>
\\n<|im_start|>user\\n` for ChatML) writes a plausible user message. A category hint in the system turn
steers the topic, so categories can be balanced; with `examples`, a few of the written training prompts of the
category come first as earlier user turns (each candidate its own draw, or one per block of `examples_shared`
consecutive candidates, whose one prompt is then prefilled once), which steers the style too: a small
target's unsteered prompts are long and rambling, unlike what users ask. Candidates are sampled (temperature ~1),
then filtered:
unfinished, empty, too short, degenerate (repetitive), chat markup, no sensible ending, duplicates, near
duplicates (4-gram Jaccard) and anything overlapping a held-out evaluation prompt (train.data.overlap).
Each category keeps the same number of prompts (the smallest survivor count caps none: a category short
of its quota is reported, not padded).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch

from headway.train.data.overlap import OverlapIndex, words

PLACEHOLDER = "\x00USER\x00"
CATEGORIES = {  # category -> hint in the system turn (the user turn itself is the model's own)
    "writing": "The user asks for a piece of writing: a story, a poem, an email, a speech or a blog post.",
    "roleplay": "The user asks the assistant to play a character or a role and to answer in that role.",
    "reasoning": "The user asks a logic puzzle or a question that needs step-by-step reasoning.",
    "math": "The user asks a math problem: arithmetic, algebra, geometry, probability or word problems.",
    "coding": "The user asks for help with programming: write, explain or fix code (Python, JavaScript, SQL).",
    "extraction": "The user gives a short text and asks to extract, summarise or reformat information from it.",
    "stem": "The user asks a question about science, technology, engineering, medicine or nature.",
    "humanities": "The user asks about history, philosophy, economics, law, art, literature or society.",
    "advice": "The user asks for practical advice about health, work, travel, cooking, money or daily life.",
}
EXAMPLE_REPLY = "..."  # the earlier turns' assistant side: the model writes a user turn, not a reply
MAX_EXAMPLE_CHARS = 300  # longer written prompts (passages to summarise) are not shown as examples
MIN_WORDS, MIN_CHARS = 4, 20
NEAR_DUP_N, NEAR_DUP_JACCARD = 4, 0.5
MARKUP = ("<|", "|>", "<im_", "[INST]", "</s>")
GOOD_ENDINGS = tuple(".?!:)]}\"'`*")


@dataclass
class SelfPromptSettings:
    per_category: int = 0  # prompts kept per category (0: none written)
    oversample: float = 2.0  # candidates written per kept prompt (filtering drops some)
    max_new_tokens: int = 64  # a longer user message is dropped as unfinished
    temperature: float = 1.0
    top_p: float = 0.95
    batch_size: int = 64
    seed: int = 0
    examples: int = 0  # written prompts of the category shown first as earlier user turns (0: the hint only)
    examples_shared: int = 1  # consecutive candidates shown one draw of examples: one prompt, prefilled once


def user_turn_prefix(tokenizer, system: str, examples: list[str] = ()) -> list[int]:
    """Token ids of the chat template up to where a user message's text starts, after `examples` as
    earlier user turns."""
    turns = [m for ex in examples for m in ({"role": "user", "content": ex},
                                            {"role": "assistant", "content": EXAMPLE_REPLY})]
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, *turns,
                                          {"role": "user", "content": PLACEHOLDER}], tokenize=False)
    return tokenizer(text[:text.index(PLACEHOLDER)], add_special_tokens=False)["input_ids"]


def example_pools(prompts: list[dict]) -> dict[str, list[str]]:
    """Category -> the short prompts in `prompts` (the written training set) that can be shown as examples."""
    pools = {cat: [] for cat in CATEGORIES}
    for p in prompts:
        if p["category"] in pools and len(p["prompt"]) <= MAX_EXAMPLE_CHARS:
            pools[p["category"]].append(p["prompt"])
    return pools


def examples_for(row_id: str, pool: list[str], settings: SelfPromptSettings) -> list[str]:
    """The examples one candidate is shown: a draw fixed by its id and the seed (a resumed build redraws the
    same ones); fewer when the category has fewer, none for a category without written prompts."""
    key = example_draw(row_id, settings.examples_shared)
    rng = random.Random(settings.seed * 1_000_003 + zlib.crc32(key.encode()))
    return rng.sample(pool, min(settings.examples, len(pool)))


def example_draw(row_id: str, shared: int) -> str:
    """Which draw of examples a candidate (id `<stem>-<k>`) is shown: its own, or with shared > 1 that of its
    block of `shared` consecutive candidates, whose prompt is then the same and is prefilled once (decode.py).
    The candidates of a block still differ: each samples its own user turn."""
    if shared == 1:
        return row_id  # the draws of builds before blocks existed
    stem, _, k = row_id.rpartition("-")
    return f"{stem}-draw{int(k) // shared}"


def candidate_rows(settings: SelfPromptSettings) -> list[dict]:
    """The candidates to write: {"id", "category"}, interleaved across categories."""
    n = round(settings.per_category * settings.oversample)
    return [{"id": f"self-{cat}-{k:05d}", "category": cat} for k in range(n) for cat in CATEGORIES]


@torch.no_grad()
def write_candidates(target, todo: list[dict], settings: SelfPromptSettings, stop_ids: list[int], decoder=None,
                     pools: dict[str, list[str]] | None = None):
    """Yield (rows with "prompt" and "finished", tokens written) one batch at a time; a batch holds one
    category. pools: example_pools of the written prompts (settings.examples of them shown per candidate).
    decoder: a VllmDecoder (else HF here)."""
    from headway.train.data.decode import decode_with

    tok = target.tokenizer
    for cat, hint in CATEGORIES.items():
        pool = (pools or {}).get(cat, [])
        rows = [r for r in todo if r["category"] == cat]
        prefix_of = {}  # examples shown -> prefix ids: the hint alone is templated once per category, not per row
        for start in range(0, len(rows), settings.batch_size):
            chunk = rows[start:start + settings.batch_size]
            shown = [tuple(examples_for(r["id"], pool, settings)) for r in chunk]
            for ex in set(shown) - prefix_of.keys():
                prefix_of[ex] = user_turn_prefix(tok, hint, ex)
            prefixes = [prefix_of[ex] for ex in shown]
            seed = settings.seed * 1_000_003 + zlib.crc32("|".join(r["id"] for r in chunk).encode())
            out = decode_with(target, prefixes, settings.max_new_tokens, stop_ids,
                              settings.temperature, settings.top_p, seed, decoder=decoder)
            written = [dict(r, prompt=tok.decode(ids, skip_special_tokens=True).strip(), finished=fin, source="self")
                       for r, ids, fin in zip(chunk, out.tokens, out.finished)]
            yield written, sum(len(t) for t in out.tokens)


def rejection(row: dict) -> str | None:
    """Why a candidate is unusable on its own (None: keep)."""
    text = row["prompt"]
    if not row.get("finished", True):
        return "unfinished"
    if not text:
        return "empty"
    w = words(text)
    if len(w) < MIN_WORDS or len(text) < MIN_CHARS:
        return "too_short"
    if any(m in text for m in MARKUP):
        return "chat_markup"
    trigrams = [tuple(w[i:i + 3]) for i in range(len(w) - 2)]
    if len(trigrams) >= 6 and len(set(trigrams)) < 0.7 * len(trigrams):
        return "repetitive"
    if not text.endswith(GOOD_ENDINGS) and not text.rstrip("`").endswith("\n"):
        return "bad_ending"
    return None


def select_prompts(candidates: list[dict], per_category: int, held_out: OverlapIndex,
                   keep_out: list[str] = ()) -> tuple[list[dict], dict[str, int]]:
    """Filter the candidates (in order) and keep up to per_category of each category.
    keep_out: other training prompts they must not duplicate. -> (kept, dropped count by reason)."""
    seen = OverlapIndex(keep_out, long_n=10 ** 6, short_n=NEAR_DUP_N, max_jaccard=NEAR_DUP_JACCARD,
                        max_word_jaccard=None)  # rewordings of one another: different replies to learn
    exact = {" ".join(words(t)) for t in keep_out}
    kept, dropped, count = [], {}, {cat: 0 for cat in CATEGORIES}
    for row in candidates:
        if count.get(row["category"], 0) >= per_category:
            continue
        norm = " ".join(words(row["prompt"]))
        why = rejection(row) or ("duplicate" if norm in exact else None) \
            or ("near_duplicate" if seen.overlap(row["prompt"]) else None) \
            or ("eval_overlap" if held_out.overlap(row["prompt"]) else None)
        if why:
            dropped[why] = dropped.get(why, 0) + 1
            continue
        exact.add(norm)
        seen.add(row["prompt"])
        count[row["category"]] = count.get(row["category"], 0) + 1
        kept.append({"id": row["id"], "category": row["category"], "prompt": row["prompt"], "source": "self"})
    short = {cat: per_category - n for cat, n in count.items() if n < per_category}
    if short:
        dropped["categories_short"] = short
    return kept, dropped
