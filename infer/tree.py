"""Tree attention (SpecInfer, Miao et al. 2024; Medusa, Cai et al. 2024): masks and position ids built with tensor ops from a parent array.

A draft tree of N nodes is a parent array: parents[0] = -1 (the root, the last committed token) and
parents[i] < i. Node i attends to the committed context and to its ancestors-or-self; its RoPE position is
t0 + depth(i). The nodes are *stored* at consecutive cache positions t0..t0+N-1 (so the 4D mask indexes
storage positions), while their position ids follow depth.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ancestor_mask(parents: Tensor) -> Tensor:
    """anc[b, i, j] = node j is node i or one of its ancestors. parents [N] or [B, N] -> bool [B, N, N].

    Pointer jumping: after round r every node knows its ancestors up to distance 2^r - 1 and points at
    its 2^r-th ancestor, so ceil(log2 N) rounds of gathers cover any depth."""
    parents = parents if parents.dim() == 2 else parents[None]
    batch, n = parents.shape
    sentinel = n  # a virtual node above the root with no ancestors; it points at itself
    jump = torch.where(parents < 0, sentinel, parents)
    jump = torch.cat([jump, jump.new_full((batch, 1), sentinel)], 1)  # [B, N+1]
    anc = torch.eye(n + 1, dtype=torch.bool, device=parents.device).expand(batch, -1, -1).clone()
    anc[:, sentinel, sentinel] = False
    for _ in range(max(1, (n - 1).bit_length())):
        anc |= anc.gather(1, jump[:, :, None].expand(-1, -1, n + 1))  # add the ancestors of my jump target
        jump = jump.gather(1, jump)  # jump twice as far
    return anc[:, :n, :n]


def depths(anc: Tensor) -> Tensor:
    """Depth of every node (root 0) from its ancestor mask [B, N, N] -> [B, N]."""
    return anc.sum(-1) - 1


def attention_mask(start: Tensor, anc: Tensor, read_len: int, dtype: torch.dtype,
                   num_new: Tensor | None = None) -> Tensor:
    """4D additive mask [B, 1, Q, read_len] for Q query tokens over a block of T >= Q tree tokens stored
    from position start[b] (the queries are that block's last Q tokens; usually T = Q).

    Key j is visible to query i of row b when j is committed context (j < start[b]) or j holds block token
    j - start[b] that is i's ancestor-or-self (`anc` [B or 1, Q, T]; lower-triangular = causal prefill).
    With `num_new`, keys of padded block tokens (>= num_new[b]) are hidden; padded queries still see the
    real tokens, so no row of the mask is empty (an empty row would make SDPA produce NaN)."""
    batch, q, t = start.shape[0], anc.shape[-2], anc.shape[-1]
    keys = torch.arange(read_len, device=anc.device)
    start = start.to(anc.device)
    if t == 1:  # a plain decoding step: everything stored so far plus itself (the hot path, keep it lean)
        hidden = keys[None] > start[:, None]  # [B, L]
        return torch.zeros(hidden.shape, dtype=dtype, device=anc.device).masked_fill_(
            hidden, torch.finfo(dtype).min)[:, None, None]
    rel = keys[None] - start[:, None]  # [B, L] index of key j in the block
    in_block = (rel >= 0) & (rel < (t if num_new is None else num_new.to(anc.device)[:, None]))
    tree = anc.expand(batch, q, t).gather(2, rel.clamp(0, t - 1)[:, None, :].expand(batch, q, read_len))
    visible = (rel < 0)[:, None, :] | (in_block[:, None, :] & tree)  # [B, Q, L]
    if num_new is not None:  # padded queries attend to every real token
        pad_query = torch.arange(t - q, t, device=anc.device)[None, :] >= num_new.to(anc.device)[:, None]
        visible |= pad_query[:, :, None] & ((rel < 0) | in_block)[:, None, :]
    mask = torch.zeros(visible.shape, dtype=dtype, device=anc.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def causal_ancestors(n: int, device=None) -> Tensor:
    """The ancestor mask of a chain (plain causal attention) [1, n, n]."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]


def chain_parents(n: int, device=None) -> Tensor:
    """Parent array of a chain of n nodes [n]: -1, 0, 1, ..., n-2."""
    return torch.arange(-1, n - 1, device=device)
