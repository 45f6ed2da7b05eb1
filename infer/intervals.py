"""How sure a held-out tau is: percentile bootstrap intervals over the prompts.

tau pools every step of every prompt (emitted tokens / target steps), so what makes it uncertain is which
prompts were drawn: resampling the prompts with replacement and pooling again gives an interval for one
head. Two heads measured on the same prompts are compared pairwise: the same resampled prompts for both, so
that a prompt easy for one head (a list, a code block) is easy for the other too, and the interval of their
difference is far narrower than two separate intervals suggest. Resampling is seeded: the same results give
the same interval.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

LEVEL = 0.95
RESAMPLES = 10_000


class IntervalError(ValueError):
    """Results an interval cannot be computed from (said in one line)."""


@dataclass
class Difference:
    """tau(b) - tau(a) over the prompts both were measured on, with its paired bootstrap interval."""

    shared: int  # prompts in both
    delta: float  # pooled tau of b minus pooled tau of a, on the shared prompts
    low: float
    high: float
    above_zero: float  # share of the resamples in which b pools higher than a


def prompt_key(prompt: str) -> str:
    """How a prompt is named in eval.json's per_prompt: the first 16 hex digits of its SHA-1."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def tau_interval(emitted, steps, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> list[float]:
    """[low, high]: the percentile bootstrap interval of sum(emitted) / sum(steps) over prompts."""
    e, s = _counts(emitted, steps)
    return _percentiles(_pooled(e, s, _resampled(len(e), resamples, seed)), level)


def paired_difference(a: tuple, b: tuple, level: float = LEVEL, resamples: int = RESAMPLES,
                      seed: int = 0) -> Difference:
    """a, b: (emitted, steps) per prompt, the same prompts in the same order -> tau(b) - tau(a)."""
    ea, sa = _counts(*a)
    eb, sb = _counts(*b)
    if len(ea) != len(eb):
        raise IntervalError(f"a paired difference needs the same prompts on both sides: {len(ea)} against {len(eb)}")
    idx = _resampled(len(ea), resamples, seed)  # one draw of prompts, used for both heads
    deltas = _pooled(eb, sb, idx) - _pooled(ea, sa, idx)  # [R]
    low, high = _percentiles(deltas, level)
    delta = float(eb.sum() / sb.sum() - ea.sum() / sa.sum())
    return Difference(len(ea), delta, low, high, float((deltas > 0).double().mean()))


def per_prompt(res: dict, name: str = "results") -> dict[str, tuple[int, int]]:
    """eval.json's per_prompt as {prompt key: (emitted, steps)}."""
    rows = res.get("per_prompt")
    if not rows:
        raise IntervalError(f"{name} has no per-prompt counts (an eval.json written before they were recorded): "
                            "evaluate the head again")
    counts, seen = {}, {}
    try:
        for r in rows:  # a prompt listed twice stays two prompts: its second occurrence is KEY#1
            n = seen[r["prompt"]] = seen.get(r["prompt"], -1) + 1
            counts[r["prompt"] + (f"#{n}" if n else "")] = (int(r["emitted"]), int(r["steps"]))
    except (KeyError, TypeError, ValueError):
        raise IntervalError(f"{name}: per_prompt rows need \"prompt\", \"emitted\" and \"steps\"") from None
    return counts


def compare_results(a: dict, b: dict, names: tuple[str, str] = ("a", "b"), **kwargs) -> Difference:
    """Two eval.json dicts -> tau(b) - tau(a) on the prompts both hold, paired."""
    for key in ("temperature", "max_new_tokens"):
        if key in a and key in b and a[key] != b[key]:
            raise IntervalError(f"{names[0]} and {names[1]} were evaluated with {key} {a[key]} and {b[key]}: "
                                "compare evaluations of one setting")
    pa, pb = per_prompt(a, names[0]), per_prompt(b, names[1])
    shared = [k for k in pa if k in pb]
    if not shared:
        raise IntervalError(f"{names[0]} and {names[1]} share no prompt: evaluate both on the same prompt set")
    pick = lambda counts: ([counts[k][0] for k in shared], [counts[k][1] for k in shared])  # noqa: E731
    return paired_difference(pick(pa), pick(pb), **kwargs)


def _counts(emitted, steps) -> tuple[Tensor, Tensor]:
    e = torch.as_tensor(emitted, dtype=torch.float64).reshape(-1)
    s = torch.as_tensor(steps, dtype=torch.float64).reshape(-1)
    if len(e) != len(s) or len(e) == 0:
        raise IntervalError(f"need one emitted count and one step count per prompt, got {len(e)} and {len(s)}")
    if bool((s <= 0).any()) or bool((e < 0).any()):
        raise IntervalError("every prompt needs at least one target step and no negative count")
    return e, s


def _resampled(n: int, resamples: int, seed: int) -> Tensor:
    """[R, n] prompt indices, drawn with replacement."""
    return torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))


def _pooled(emitted: Tensor, steps: Tensor, idx: Tensor) -> Tensor:
    return emitted[idx].sum(1) / steps[idx].sum(1)  # [R]: tau of each resample, every step of it pooled


def _percentiles(values: Tensor, level: float) -> list[float]:
    if not 0 < level < 1:
        raise IntervalError(f"level must lie in (0, 1), got {level}")
    tail = (1 - level) / 2
    low, high = torch.quantile(values, torch.tensor([tail, 1 - tail], dtype=values.dtype)).tolist()
    return [low, high]
