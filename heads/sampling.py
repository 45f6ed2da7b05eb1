"""Logits warping and exact sampling, shared by plain decoding, the drafter, the verifier and data generation.

Speculative decoding is only lossless when the target distribution p, the draft distribution q and
the bonus token all go through the same warping as plain sampling, so every caller uses
`warp_probs` and `sample` from here.
"""

import math

import torch

# Below this temperature sampling is greedy (vLLM's convention, _SAMPLING_EPS = 1e-5): logits / T
# overflows fp32 long before T reaches 0 (T <= 1e-38 gives inf - inf = NaN probabilities), and a
# distribution that sharp is a one-hot at the argmax anyway, up to exact ties.
GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    """Whether `temperature` decodes greedily (0, or so small that it is greedy in effect)."""
    return temperature < GREEDY_BELOW


def warp_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Turn logits [..., V] into the fp32 distribution [..., V] that sampling draws from.

    Order: temperature, then top-k, then top-p (the order of HF `generate`).
    temperature == 0 (or below GREEDY_BELOW) means greedy: a one-hot at the argmax (ties go to the
    lowest index, as `torch.argmax`); top-k/top-p cannot change the argmax, so they are skipped.
    A NaN or infinite temperature is a ValueError.
    top-k keeps every token tied with the k-th largest logit. top-p keeps the smallest
    highest-probability set whose mass reaches top_p (at least one token).
    """
    _check_warp_args(temperature, top_k, top_p)
    logits = logits.float()  # softmax in fp32 whatever the model's dtype
    if is_greedy(temperature):
        return _one_hot_argmax(logits)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p is not None and top_p < 1:
        probs = _top_p_filter(logits, probs, top_p)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of probs [..., V] -> LongTensor [...].

    Exact inverse CDF with float64 uniforms: a token with probability 0 is never drawn, and rows
    need not be normalised (each must have positive, finite mass: ValueError otherwise).

    Above 256 tokens, two levels so that the only pass over V is an fp32 sum (a float64 cumsum
    over V costs ~20x more on CPU at V = 49152): a block of 256 tokens is chosen from the block
    sums, then a token inside it from its float64 cumsum. fp32 block sums are off by at most
    ~1.5e-5 relative, so they are inflated into upper bounds and a draw that lands past the
    block's exact float64 mass is redrawn (rejection sampling: probability ~2e-4 per row), which
    keeps the law exact.
    """
    V = probs.shape[-1]
    if V <= _BLOCK:
        token = _sample_one_level(probs.reshape(-1, V), generator)
    else:
        token = _sample_two_levels(_blocks(probs), generator)
    return token.view(probs.shape[:-1])


def _sample_one_level(rows: torch.Tensor, generator) -> torch.Tensor:
    cdf = rows.cumsum(-1, dtype=torch.float64)  # [R, V]
    total = cdf[:, -1:].contiguous()
    _check_mass(total)
    u = torch.rand(total.shape, dtype=torch.float64, device=rows.device, generator=generator)
    token = torch.searchsorted(cdf, u * total, right=True)  # the first entry whose cdf passes
    last_with_mass = torch.searchsorted(cdf, total)  # u * total can round up to total itself
    return torch.minimum(token, last_with_mass)[:, 0]


def _sample_two_levels(blocks: torch.Tensor, generator) -> torch.Tensor:
    bound = blocks.sum(-1).double() * (1 + _SUM_SLACK)  # [R, nb] >= each block's exact mass
    _check_mass(bound.sum(-1))
    token = torch.empty(blocks.shape[0], dtype=torch.long, device=blocks.device)
    todo = torch.arange(blocks.shape[0], device=blocks.device)
    while todo.numel():  # one pass almost always
        drawn, accepted = _draw_from_blocks(blocks, bound, todo, generator)
        token[todo[accepted]] = drawn[accepted]
        todo = todo[~accepted]
    return token


def _check_mass(total: torch.Tensor) -> None:
    if not bool(((total > 0) & (total < float("inf"))).all()):
        raise ValueError("sample: every row of probs needs positive, finite mass")


# the relative error of an fp32 sum of 256 non-negative terms is below 255 * 2^-24 ~ 1.5e-5
_SUM_SLACK = 2.0**-12


def _draw_from_blocks(blocks, bound, rows, generator):
    """One attempt for each of rows: (token [R], accepted [R]). Given acceptance, token ~ probs."""
    block_cdf = bound[rows].cumsum(-1)  # [R, nb]
    u = torch.rand(rows.shape[0], 1, dtype=torch.float64, device=blocks.device, generator=generator)
    target = u * block_cdf[:, -1:]  # [R, 1] uniform over the inflated mass
    block = torch.searchsorted(block_cdf, target, right=True).clamp(max=blocks.shape[1] - 1)
    start = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner_cdf = start + blocks[rows, block[:, 0]].cumsum(-1, dtype=torch.float64)  # [R, bs] exact
    accepted = (target < inner_cdf[:, -1:])[:, 0]  # past the exact mass: the inflation, redraw
    inside = (inner_cdf <= target).sum(-1)  # first entry whose cdf passes target: it has mass
    return block[:, 0] * blocks.shape[-1] + inside, accepted


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (the first maximal index) for x [..., V], ~40x faster on CPU at large V.

    The first block holding the maximum holds its first occurrence, so the two levels agree with
    torch.argmax token for token, ties and NaNs included.
    """
    blocks = _blocks(x, pad_value=float("-inf"))  # [R, nb, bs]
    block = blocks.amax(-1).argmax(-1)  # [R]
    inside = blocks[torch.arange(blocks.shape[0], device=x.device), block]  # [R, bs]
    return (block * blocks.shape[-1] + inside.argmax(-1)).view(x.shape[:-1])


_BLOCK = 256


def _blocks(x: torch.Tensor, pad_value: float = 0.0) -> torch.Tensor:
    """[..., V] -> [R, ceil(V / bs), bs], padding the last block with pad_value when needed."""
    V = x.shape[-1]
    size = min(_BLOCK, V)
    x = x.reshape(-1, V)
    if V % size:
        x = torch.nn.functional.pad(x, (0, size - V % size), value=pad_value)
    return x.view(x.shape[0], -1, size)


def _check_warp_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None (no top-k), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None (no top-p), got {top_p}")


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    best = argmax(logits)[..., None]  # [..., 1]
    return torch.zeros_like(logits).scatter_(-1, best, 1.0)


# Tokens ranked before the full sort is needed, tried in turn on the rows still undecided: a peaked row's
# nucleus lies in the first 512; a flat one (temperature ~1 at the start of a free-form text) can need
# thousands, and a partial sort of 4,096 or 16,384 still costs 1/6 to 1/2 of sorting V = 49152 on CPU.
_TOP_P_CANDIDATES = (512, 4096, 16384)


def _top_p_filter(logits: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask every token outside the top-p nucleus of probs [..., V] and renormalise.

    The nucleus is decided on the K most probable tokens, a partial sort. That is exact wherever the tokens
    strictly above the K-th probability already carry top_p of the mass: every other token then has at
    least that mass before it. Rows not decided that way try the next K; the rest fall back to the full
    sort. Every path keeps exactly the tokens the full stable sort keeps."""
    V = probs.shape[-1]
    flat_logits, flat_probs = logits.reshape(-1, V), probs.reshape(-1, V)
    drop = torch.ones_like(flat_probs, dtype=torch.bool)  # [R, V]
    rest = torch.arange(flat_probs.shape[0], device=probs.device)  # rows not decided yet
    for k in _TOP_P_CANDIDATES:
        if 2 * k > V or not len(rest):
            break
        rest_drop, decided = _top_p_candidates(flat_probs[rest], top_p, k)
        drop[rest[decided]] = rest_drop[decided]
        rest = rest[~decided]
    out = flat_logits.masked_fill(drop, float("-inf")).softmax(-1)
    if len(rest):
        out[rest] = _top_p_sorted(flat_logits[rest], flat_probs[rest], top_p)
    return out.view(probs.shape)


def _top_p_candidates(probs: torch.Tensor, top_p: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, V] -> (tokens to drop [R, V], rows for which that is exact [R])."""
    values, index = probs.topk(k, dim=-1)  # [R, k], ties in no defined order
    index, by_index = index.sort(-1)  # the full sort breaks ties by token id: do the same
    ranked, order = values.gather(-1, by_index).sort(dim=-1, descending=True, stable=True)  # [R, k]
    mass_before = ranked.cumsum(-1) - ranked
    above_kth = (ranked > values[:, -1:]).sum(-1)  # [R] tokens strictly above the k-th probability
    mass_above = mass_before.gather(-1, above_kth[:, None].clamp(max=k - 1))[:, 0]
    decided = (above_kth < k) & (mass_above >= top_p)
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(-1, index.gather(-1, order), mass_before >= top_p)
    return drop, decided


def _top_p_sorted(logits: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # a stable sort makes the set deterministic when probabilities tie at the boundary
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., V]
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the strictly better tokens
    drop_sorted = mass_before >= top_p  # never drops the first token: top_p > 0
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf")).softmax(-1)
