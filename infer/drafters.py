"""Drafting policies behind one `Drafter` interface used by the engine.

Engine-facing interface (all tensors batched over B rows, rows ragged):
    feature_layers() -> list[int]     target hidden_states indices the drafter needs at commit
    plan(budget, batch_size, target_params) -> int
                                      tree nodes (root included) per row for a batch on this machine
                                      (budget: infer.calibrate.TreeBudget, the measured T(N) + throttle)
    max_nodes(budget) -> int          tree nodes (root included) it will propose under a node budget
    reset(prompt [B, P], lengths [B], max_len, sampling)   a new generation
    commit(tokens [B, n], feats, positions [B, n], num_valid [B])
        newly committed context, as in DraftHead.draft_begin: tokens[:, i] is the token after feature
        position positions[:, i]; the last valid token is the new root (not yet seen by the target)
    propose(root [B], max_nodes) -> Draft(tokens [B, N], parents, draft_probs)

Drafters:
    TreeDrafter(proposer, policy)   a model that scores continuations (a DraftHead via HeadProposer, or a
                                    standalone draft model via DraftModelProposer) + a tree policy:
        Chain(gamma)                gamma tokens, top-1 (or sampled from the warped draft distribution
                                    at temperature > 0 with sample=True: SpecInfer/Leviathan rule)
        StaticTree(choices)         Medusa-style choice list (paths of top-k ranks); `StaticTree.
                                    from_accuracies` derives one from measured per-depth accuracies
        DynamicTree(total_tokens, depth, top_k)   EAGLE-2: expand the top_k nodes by cumulative draft
                                    log-probability per depth, keep the best total_tokens
        AutoTree(acceptance, top_k, max_depth)    (a head's default) the static tree with the most expected
                                    tokens per unit time here: the head's measured per-depth acceptance,
                                    the target's measured T(N) and the draft cost per level
    PromptLookup(gamma, max_ngram, min_ngram)   n-gram match in the context (no model)

Deterministic children (top-k) always carry distinct sibling tokens and propose with draft_probs=None
(target-only rule: lossless at any temperature). Build from names with `build_drafter`.
"""

from __future__ import annotations

import heapq
import itertools
from abc import abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from headway.heads.base import DraftHead, HeadError
from headway.heads.target import Target
from headway.infer.kv_cache import PagedKVCache
from headway.infer.roofline import TreePlan, best_tree, rank_rate
from headway.heads.sampling import is_greedy, sample, warp_probs
from headway.infer.tree import attention_mask, chain_parents


@dataclass
class Draft:
    """A draft tree per row: node 0 is the root (the last committed token, not yet in the target cache)."""

    tokens: Tensor  # [B, N]; -1 marks padding nodes (never accepted)
    parents: Tensor  # [N] or [B, N]; parents[0] = -1, parents[i] < i
    draft_probs: Tensor | None = None  # [B, N, V] if children were *sampled* from these (SpecInfer rule)


@dataclass
class Sampling:
    """How the engine samples; drafters that *sample* proposals must warp identically."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None


class Drafter:
    def feature_layers(self) -> list[int]:
        return []

    def networks(self) -> list[nn.Module]:
        """The modules it runs while drafting (the engine puts their Linears in a fast CPU layout)."""
        return []

    def plan(self, budget, batch_size: int, target_params: int, greedy: bool = True) -> int:
        return self.max_nodes(budget.max_tokens(batch_size))

    def describe(self) -> dict:
        """What drafts, for reports (eval.json "draft")."""
        return {"drafter": type(self).__name__}

    def max_nodes(self, budget: int) -> int:
        raise NotImplementedError

    def reset(self, prompt: Tensor, lengths: Tensor, max_len: int, sampling: Sampling | None = None) -> None:
        raise NotImplementedError

    def commit(self, tokens: Tensor, feats, positions: Tensor, num_valid: Tensor) -> None:
        raise NotImplementedError

    def propose(self, root: Tensor, max_nodes: int) -> Draft:
        raise NotImplementedError


# ============================================================================ proposers (who scores)

class Proposer(Protocol):
    """Who scores draft continuations for a TreeDrafter: a head (HeadProposer) or a draft model
    (DraftModelProposer). begin/expand/end follow DraftHead.draft_begin/draft_expand/draft_end."""

    max_depth: int | None  # deepest draft it can make (None: unbounded)
    acceptance: list[float]  # measured per-depth acceptance, if any (AutoTree's input)

    def level_params(self) -> int: ...

    def feature_layers(self) -> list[int]: ...

    def reset(self, prompt: Tensor, lengths: Tensor, max_len: int) -> None: ...

    def begin(self, tokens: Tensor, feats, positions: Tensor, num_valid: Tensor) -> tuple[Tensor, Tensor]: ...

    def expand(self, depth: int, tokens: Tensor, parent_hidden: Tensor, parents: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor]: ...

    def end(self) -> None: ...


class HeadProposer:
    """A trained (or fresh) DraftHead through its draft_state/draft_begin/draft_expand/draft_end hooks."""

    def __init__(self, head: DraftHead):
        self.head = head.eval()
        self.state = None
        self.device = next(head.parameters()).device if any(True for _ in head.parameters()) else torch.device("cpu")

    @property
    def max_depth(self) -> int | None:
        return self.head.max_draft_depth

    @property
    def acceptance(self) -> list[float]:
        return self.head.acceptance

    def level_params(self) -> int:
        return self.head.draft_level_params()

    def feature_layers(self) -> list[int]:
        return list(self.head.feature_layers())

    def reset(self, prompt: Tensor, lengths: Tensor, max_len: int) -> None:
        self.state = self.head.draft_state(prompt.shape[0], max_len)

    def begin(self, tokens, feats, positions, num_valid):
        dev = self.device
        return self.head.draft_begin(self.state, tokens.to(dev), feats, positions.to(dev), num_valid.to(dev))

    def expand(self, depth, tokens, parent_hidden, parents, positions):
        dev = self.device
        return self.head.draft_expand(self.state, depth, tokens.to(dev), parent_hidden, parents.to(dev),
                                      positions.to(dev))

    def end(self) -> None:
        self.head.draft_end(self.state)


class DraftModelProposer:
    """A standalone causal LM sharing the target's tokenizer, with its own paged KV cache.

    After `begin` its cache holds exactly the committed tokens x_0..x_m (the root x_m included); `expand`
    appends tree nodes after them (tree mask: context + ancestors + self), `end` rolls them back."""

    max_depth = None
    acceptance: list[float] = []  # unknown: AutoTree falls back to its prior

    def __init__(self, model, block_size: int = 16):
        self.model = model.eval()
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def feature_layers(self) -> list[int]:
        return []

    def level_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def reset(self, prompt: Tensor, lengths: Tensor, max_len: int) -> None:
        self.cache = PagedKVCache.for_model(self.model.config, batch_size=prompt.shape[0],
                                            max_seq_len=max_len + 1024,  # + this round's tree nodes
                                            block_size=self.block_size, dtype=self.dtype, device=self.device)
        self.first = prompt[:, :1]  # x_0: the target's features start at position 0, predicting x_1
        self.round_anc = None  # [B, M, M] ancestors among this round's expanded nodes

    def begin(self, tokens, feats, positions, num_valid):
        if self.first is not None:  # the very first commit also carries x_0
            tokens, num_valid = torch.cat([self.first, tokens], 1), num_valid + 1
            self.first = None
        width = tokens.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()[None]
        start = self.cache.lengths.clone()
        logits = self._forward(tokens, num_valid, causal, start[:, None] + torch.arange(width),
                               keep=(num_valid - 1)[:, None], block_start=start, ragged=True)
        self.committed = self.cache.lengths.clone()
        self.round_anc = None
        return logits[:, 0], torch.zeros(tokens.shape[0], 1, device=self.device)  # no hidden state to carry

    def expand(self, depth, tokens, parent_hidden, parents, positions):
        B, n = tokens.shape
        new_anc = self._ancestors_of_new(parents)  # [B, n, M]
        anc = torch.cat([new_anc, torch.eye(n, dtype=torch.bool).expand(B, n, n)], 2)  # [B, n, M + n]
        pos = (self.committed - 1 + depth)[:, None].expand(B, n)  # the root x_m sits at committed - 1
        logits = self._forward(tokens, torch.full((B,), n), anc, pos, keep=0, block_start=self.committed,
                               ragged=False)
        self._grow(new_anc)
        return logits, parent_hidden

    def end(self) -> None:
        self.cache.truncate(self.committed)
        self.round_anc = None

    def _forward(self, tokens, num_new, anc, pos, keep, block_start, ragged):
        """Append tokens [B, n] (num_new per row) and run them; `anc` [B, n, T] relates them to the block
        of T tokens stored from block_start (begin: the new tokens themselves; expand: this round's tree)."""
        plan = self.cache.prepare(num_new, tokens.shape[1])
        mask = attention_mask(block_start, anc, plan.read_len, self.dtype, num_new if ragged else None)
        out = self.model(input_ids=tokens.to(self.device), position_ids=pos.to(self.device),
                         attention_mask=mask.to(self.device), cache=self.cache, use_cache=True, logits_to_keep=keep)
        return out.logits.float()

    def _ancestors_of_new(self, parents: Tensor) -> Tensor:
        B, n = parents.shape
        if self.round_anc is None:
            return torch.zeros(B, n, 0, dtype=torch.bool)
        M = self.round_anc.shape[-1]
        idx = parents.clamp(min=0).cpu()
        anc = self.round_anc.gather(1, idx[:, :, None].expand(B, n, M))
        anc |= torch.nn.functional.one_hot(idx, M).bool()
        return anc & (parents.cpu() >= 0)[:, :, None]

    def _grow(self, new_anc: Tensor) -> None:
        B, n, M = new_anc.shape
        grown = torch.zeros(B, M + n, M + n, dtype=torch.bool)
        if M:
            grown[:, :M, :M] = self.round_anc
        grown[:, M:, :M] = new_anc
        self.round_anc = grown


# ============================================================================== tree policies (what)

class TreePolicy(Protocol):
    """What shape a TreeDrafter's drafts take. Policies subclass it: `plan` defaults to nothing to plan."""

    def plan(self, proposer: Proposer, budget, batch_size: int, target_params: int, greedy: bool = True) -> None:
        """Choose the tree for a batch of `batch_size` rows on this machine (budget: TreeBudget) for a greedy
        or a sampling call; a fixed tree has nothing to choose."""

    @abstractmethod
    def size(self, max_depth: int | None) -> int:
        """Tree nodes (root included) it proposes for a proposer drafting at most `max_depth` deep."""

    @abstractmethod
    def build(self, proposer: Proposer, root: Tensor, logits: Tensor, hidden: Tensor, max_nodes: int,
              last_pos: Tensor, sampling: Sampling) -> tuple[Tensor, Tensor, Tensor | None]:
        """Draft one tree from the root's logits [B, V] and hidden [B, ...] -> (tokens [B, N], parents [N]
        or [B, N], draft_probs [B, N, V] if children were sampled, else None), N <= max_nodes."""


class Chain(TreePolicy):
    """gamma tokens, each the proposer's top-1 (or, with sample=True at temperature > 0, a sample from the
    warped draft distribution, verified with the SpecInfer rule)."""

    def __init__(self, gamma: int = 5, sample: bool = False):
        if gamma < 1:
            raise ValueError(f"chain needs gamma >= 1, got {gamma}")
        self.gamma, self.sample = gamma, sample

    def size(self, max_depth: int | None) -> int:
        return 1 + min(self.gamma, max_depth or self.gamma)

    def build(self, proposer, root: Tensor, logits: Tensor, hidden: Tensor, max_nodes: int, last_pos: Tensor,
              sampling: Sampling):
        B = root.shape[0]
        sampled = self.sample and not is_greedy(sampling.temperature)
        tokens, probs = [root.cpu()], []
        parents = torch.full((B, 1), -1)
        for depth in range(1, max_nodes):
            if sampled:
                q = warp_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # [B, V]
                tok = sample(q, sampling.generator).cpu()
                probs.append(q)
            else:
                tok = logits.argmax(-1).cpu()
            tokens.append(tok)
            if depth == max_nodes - 1:
                break
            logits, hidden = proposer.expand(depth, tok[:, None], hidden[:, None], parents,
                                             (last_pos + depth)[:, None])
            logits, hidden = logits[:, 0], hidden[:, 0]
            parents = torch.full((B, 1), depth - 1)
        draft_probs = None
        if sampled:  # the leaf has no children: its row is never read
            draft_probs = torch.stack(probs + [probs[-1]], 1).float()
        return torch.stack(tokens, 1), chain_parents(len(tokens)), draft_probs


class StaticTree(TreePolicy):
    """A Medusa-style static tree: `choices` lists paths of top-k ranks from the root, e.g.
    [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]: node (0, 1) is the second-best child of the best
    depth-1 token. The list must be prefix-closed; it is truncated in order to the budget."""

    def __init__(self, choices):
        paths = [tuple(int(r) for r in c) for c in choices]
        known = set()
        for p in paths:
            if not p or min(p) < 0:
                raise ValueError(f"static tree choice {p} must be a non-empty tuple of ranks >= 0")
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"static tree choice {p} comes before (or without) its parent {p[:-1]}")
            known.add(p)
        self.choices = paths
        self._plans = {}  # (max_nodes, max_depth) -> _StaticPlan

    @classmethod
    def from_accuracies(cls, accuracies, total_nodes: int = 32, top_k: int = 10) -> "StaticTree":
        """The tree maximising expected accepted length for measured accuracies: accuracies[d][r] =
        P(rank-r candidate right at depth d+1 | path right so far), or per-depth top-1 rates a_d (then the
        rank-r rate is modelled by infer.roofline.rank_rate). Greedy by path probability
        (Medusa's construction): a child is never likelier than its parent, so the result is a tree."""
        rates = [list(a) if hasattr(a, "__len__") else [rank_rate(float(a), r + 1) for r in range(top_k)]
                 for a in accuracies]
        heap, chosen = [(-rates[0][0], (0,))], []
        while heap and len(chosen) < total_nodes - 1:
            neg, path = heapq.heappop(heap)
            chosen.append(path)
            depth, rank = len(path), path[-1]
            if rank + 1 < len(rates[depth - 1]):  # the next sibling
                parent_p = -neg / max(rates[depth - 1][rank], 1e-12)
                heapq.heappush(heap, (-parent_p * rates[depth - 1][rank + 1], path[:-1] + (rank + 1,)))
            if depth < len(rates):  # the first child
                heapq.heappush(heap, (neg * rates[depth][0], path + (0,)))
        return cls(chosen)

    def size(self, max_depth: int | None) -> int:
        return 1 + len([p for p in self.choices if max_depth is None or len(p) <= max_depth])

    def build(self, proposer, root, logits, hidden, max_nodes, last_pos, sampling):
        plan = self._plan(max_nodes, proposer.max_depth)
        B = root.shape[0]
        tokens = torch.empty(B, plan.size, dtype=torch.long)
        tokens[:, 0] = root.cpu()
        # the newest expanded nodes' children logits [B, P, V] and hidden states [B, P, ...]; first the root alone
        level_logits, level_hidden = logits[:, None], hidden[:, None]
        for depth, level in enumerate(plan.levels, 1):
            ranked = level_logits.topk(level.need, -1).indices.cpu()  # [B, P, need]: one host read per level
            tokens[:, level.nodes] = ranked[:, level.parent_slot, level.rank]
            if not level.grow_nodes:
                break  # nothing hangs below this level
            parent_hidden = level_hidden[:, level.grow_parent_slot.to(level_hidden.device)]  # [B, G, ...]
            level_logits, level_hidden = proposer.expand(
                depth, tokens[:, level.grow_nodes], parent_hidden, level.grow_parent_expanded.expand(B, -1),
                (last_pos + depth)[:, None].expand(B, len(level.grow_nodes)))
        return tokens, plan.parents, None

    def layout(self, max_nodes: int, max_depth: int | None) -> tuple[Tensor, Tensor]:
        """The tree `build` drafts for this budget: (parents [N], ranks [N]) as _StaticPlan holds them."""
        plan = self._plan(max_nodes, max_depth)
        return plan.parents, plan.ranks

    def _plan(self, max_nodes: int, max_depth: int | None) -> "_StaticPlan":
        """The tree's layout for this budget, worked out once: nodes breadth first (parents before children)."""
        key = (max_nodes, max_depth)
        if key not in self._plans:
            paths = [p for p in self.choices if max_depth is None or len(p) <= max_depth]
            self._plans[key] = _StaticPlan.of(sorted(paths[:max_nodes - 1], key=len))
        return self._plans[key]


@dataclass(frozen=True)
class _StaticLevel:
    """One depth of a static tree. Slots number the previous level's expanded nodes in expansion order (the root
    alone before depth 1); expanded indices number every expanded node of the tree so far (the root: -1)."""
    nodes: list[int]  # tree index of each node of this depth
    parent_slot: torch.Tensor  # [n] its parent's slot
    rank: torch.Tensor  # [n] its rank among its parent's children
    need: int  # the most children any parent here has
    grow_nodes: list[int]  # the nodes of this depth that have children, in expansion order
    grow_parent_slot: torch.Tensor  # [g] their parents' slots
    grow_parent_expanded: torch.Tensor  # [1, g] their parents' expanded indices


@dataclass(frozen=True)
class _StaticPlan:
    size: int  # nodes, the root included
    parents: torch.Tensor  # [size] each node's parent's tree index (-1: the root)
    ranks: torch.Tensor  # [size] each node's rank among its parent's children (-1: the root)
    levels: list[_StaticLevel]

    @classmethod
    def of(cls, paths: list[tuple[int, ...]]) -> "_StaticPlan":
        index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
        has_kids = {p[:-1] for p in paths}
        slot, expanded = {(): 0}, {(): -1}  # the previous level's slot and every node's expanded index
        levels, count = [], 0
        for depth in range(1, max((len(p) for p in paths), default=0) + 1):
            level = [p for p in paths if len(p) == depth]
            grow = [p for p in level if p in has_kids]
            levels.append(_StaticLevel(
                nodes=[index[p] for p in level], parent_slot=torch.tensor([slot[p[:-1]] for p in level]),
                rank=torch.tensor([p[-1] for p in level]), need=max(p[-1] for p in level) + 1,
                grow_nodes=[index[p] for p in grow], grow_parent_slot=torch.tensor([slot[p[:-1]] for p in grow]),
                grow_parent_expanded=torch.tensor([[expanded[p[:-1]] for p in grow]])))
            slot = {p: j for j, p in enumerate(grow)}
            expanded |= {p: count + j for j, p in enumerate(grow)}
            count += len(grow)
        return cls(len(paths) + 1, torch.tensor([-1] + [index[p[:-1]] for p in paths]),
                   torch.tensor([-1] + [p[-1] for p in paths]), levels)


class DynamicTree(TreePolicy):
    """EAGLE-2: each depth expands the top_k nodes of the newest level by cumulative draft log-prob; every
    child seen is a candidate; the best `total_tokens - 1` candidates (plus the root) form the tree."""

    def __init__(self, total_tokens: int = 60, depth: int = 7, top_k: int = 10):
        if total_tokens < 1 or depth < 1 or top_k < 1:
            raise ValueError("dynamic tree needs total_tokens, depth and top_k >= 1")
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k

    def size(self, max_depth: int | None) -> int:
        return self.total_tokens

    def build(self, proposer, root, logits, hidden, max_nodes, last_pos, sampling):
        # sized by the budget: a tree of max_nodes can use at most max_nodes - 1 levels or siblings
        B, k = root.shape[0], min(self.top_k, logits.shape[-1], max_nodes - 1)
        depth_limit = min(self.depth, proposer.max_depth or self.depth, max_nodes - 1)
        top = logits.float().log_softmax(-1).topk(k, -1)
        scores, toks = top.values.cpu(), top.indices.cpu()  # [B, k] the depth-1 level = first frontier
        cand_tok, cand_score, cand_parent = [toks], [scores], [torch.full((B, k), -1)]
        front_cand = torch.arange(k).expand(B, k)  # candidate index of each frontier node
        front_parent = torch.full((B, k), -1)  # expanded index of each frontier node's parent
        front_hidden = hidden[:, None].expand(B, k, *hidden.shape[1:])
        num_cand = k
        for depth in range(1, depth_limit):
            out_logits, out_hidden = proposer.expand(depth, toks, front_hidden, front_parent,
                                                     (last_pos + depth)[:, None].expand(B, k))
            child = out_logits.float().log_softmax(-1).topk(k, -1)  # [B, k, k]
            child_scores = (scores[:, :, None] + child.values.cpu()).flatten(1)  # [B, k*k]
            child_toks = child.indices.cpu().flatten(1)
            cand_tok.append(child_toks)
            cand_score.append(child_scores)
            cand_parent.append(front_cand.repeat_interleave(k, 1))
            best = child_scores.topk(k, -1).indices  # [B, k] the next frontier, among the k*k children
            parent_slot = best // k  # which frontier node each new frontier node hangs from
            toks, scores = child_toks.gather(1, best), child_scores.gather(1, best)
            front_cand = num_cand + best
            front_parent = (depth - 1) * k + parent_slot  # expanded index: k nodes per earlier expand call
            front_hidden = _gather_nodes(out_hidden, parent_slot.to(out_hidden.device))
            num_cand += k * k
        return _select(torch.cat(cand_tok, 1), torch.cat(cand_score, 1), torch.cat(cand_parent, 1), root,
                       min(self.total_tokens, max_nodes))


class AutoTree(TreePolicy):
    """The static tree with the most expected tokens per unit time for this proposer on this machine
    (infer.roofline.best_tree, then StaticTree.from_accuracies), planned per batch size from:
      acceptance   per-depth top-1 acceptance: given, else the head's last validation (else PRIOR) moved toward
                   what this engine measured, for greedy calls (observe_accepted: how often each depth's rank-0
                   draft was accepted in the greedy calls drafted with this policy; a head validated on its training
                   data's distribution is usually accepted less on the user's prompts, which the plan then follows);
      T(N)         the target's measured latency curve (the engine's TreeBudget; flat without one);
      draft cost   c = weights one draft level reads / the target's weights (decoding reads every weight
                   once per step, so a level costs c plain steps), or `draft_cost` if given; once the engine
                   has drafted with this policy, the cost it measured (observe_draft_cost): on a CPU whose
                   decode step is fast, a level's Python and small kernels cost far more than its weights say.
    The batch-size throttle of the budget caps the tree; a plan of no nodes means plain decoding, chosen too
    when the best tree's predicted speedup is below `min_gain` (the cost model is approximate)."""

    PRIOR = (0.6, 0.5, 0.4, 0.35, 0.3)  # a trained head's typical rates, used when nothing was measured
    PRIOR_STEPS = 32  # a depth's expected rate counts as this many steps: the engine's counts outweigh it soon

    def __init__(self, acceptance=None, top_k: int = 4, max_depth: int = 6, draft_cost: float | None = None,
                 min_gain: float = 1.05, learn: bool = True):
        if top_k < 1 or max_depth < 1:
            raise ValueError("auto tree needs top_k and max_depth >= 1")
        if learn not in (True, False):
            raise ValueError(f"auto tree's learn must be true or false, got {learn!r}")
        self.acceptance = [float(a) for a in acceptance] if acceptance else None
        self.top_k, self.max_depth, self.draft_cost = top_k, max_depth, draft_cost
        self.min_gain = min_gain  # draft only for a predicted speedup this large: the model is approximate
        self.learn = learn  # plan from the acceptance this engine measures (given acceptance is kept as given)
        self.tree, self.planned = StaticTree([(0,)]), None
        self.measured_cost: float | None = None  # a draft level in plain steps, as the engine timed it
        self.offered: list[int] = []  # per depth d: row-steps whose accepted path could take a rank-0 draft at d
        self.taken: list[int] = []  # ... and those that took it
        self.drafted: tuple[Tensor, Tensor] | None = None  # (parents [N], ranks [N]) of the tree last built

    def plan(self, proposer: Proposer, budget, batch_size: int, target_params: int, greedy: bool = True) -> None:
        depth = min(self.max_depth, proposer.max_depth or self.max_depth)
        rates = self.expected_acceptance(proposer, measured=greedy)[:depth]
        if self.draft_cost is not None:
            cost, self.planned_cost_source = self.draft_cost, "given"
        elif self.measured_cost is not None:
            cost, self.planned_cost_source = self.measured_cost, "measured"
        else:
            cost, self.planned_cost_source = proposer.level_params() / target_params, "weights"
        self.planned_cost = cost
        cap = budget.max_tokens(batch_size)
        plain = budget.latency(batch_size) if budget.curve else 1.0

        def latency(nodes: Tensor) -> Tensor:  # a step verifying `nodes` tokens per row, in plain steps
            if not budget.curve:
                return torch.ones(len(nodes), dtype=torch.float64)
            return torch.tensor([budget.latency(batch_size * int(n)) / plain for n in nodes], dtype=torch.float64)

        def best(rates: list[float]) -> TreePlan:
            plan = best_tree(rates, latency, cost, max_nodes=max(cap - 1, 0), top_k=self.top_k)
            if plan.speedup < self.min_gain:  # a marginal plan: take the curve's first row, no tree
                plan = TreePlan(*plan.curve[0], plan.curve)
            return plan

        self.planned = best(rates)
        if not self.planned.size and self.acceptance_measured and best(self.prior_rates[:depth]).size:
            # measured acceptance alone never stops drafting: one tree more keeps measuring, so a hard first
            # prompt cannot switch drafting off for good (the measured cost still can)
            self.planned = TreePlan(*max(self.planned.curve[1:], key=lambda row: row[3]), self.planned.curve)
        if self.planned.size:
            self.tree = StaticTree.from_accuracies(rates, total_nodes=self.planned.size + 1, top_k=self.top_k)

    def expected_acceptance(self, proposer: Proposer, measured: bool = True) -> list[float]:
        """Per-depth top-1 rates to plan with (and where they came from, in acceptance_source): each depth's
        prior (the head's validation, else PRIOR) counted as PRIOR_STEPS steps beside the engine's counts
        (with `measured`: the engine counts greedy calls, the ones a head's validation acceptance describes)."""
        self.acceptance_measured = False
        if self.acceptance:
            self.acceptance_source = "given"
            return self.acceptance
        prior = self.prior_rates = proposer.acceptance or list(self.PRIOR)
        self.acceptance_source = "validation" if proposer.acceptance else "prior"
        if not (measured and self.learn and any(self.offered)):
            return prior
        self.acceptance_measured = True
        self.acceptance_source += f" + {self.offered[0]} measured steps"
        return [(taken + self.PRIOR_STEPS * rate) / (offered + self.PRIOR_STEPS)
                for rate, offered, taken in itertools.zip_longest(prior, self.offered[:len(prior)],
                                                                  self.taken[:len(prior)], fillvalue=0)]

    def observe_draft_cost(self, cost: float) -> None:
        """What one draft level cost in plain steps, measured by the engine; later plans use it."""
        self.measured_cost = float(cost)

    def observe_accepted(self, path: Tensor, num: Tensor) -> None:
        """One verification of the tree last built, for the rows still generating: path [B, D+1] the accepted
        nodes from the root (-1 padded), num [B] tokens emitted (accepted drafts + 1). Counts per depth d the
        row-steps that reached depth d - 1 at a node with a rank-0 child, and those that accepted that child."""
        if not self.learn or self.acceptance or self.drafted is None or not len(num):
            return
        parents, ranks = self.drafted
        first_child = torch.zeros(len(ranks), dtype=torch.bool)  # [N] the node has a rank-0 child
        first_child[parents[ranks == 0]] = True
        node = path.clamp(min=0)
        reached = num[:, None] - 1 >= torch.arange(path.shape[1])  # [B, D+1] the path reached depth d
        offered = (reached[:, :-1] & first_child[node[:, :-1]]).sum(0)  # [D]
        taken = (reached[:, 1:] & (ranks[node[:, 1:]] == 0)).sum(0)  # [D]
        for counts, new in ((self.offered, offered), (self.taken, taken)):
            counts.extend([0] * (len(new) - len(counts)))
            for d, n in enumerate(new.tolist()):
                counts[d] += n

    def size(self, max_depth: int | None) -> int:
        return 1 + self.planned.size if self.planned else self.tree.size(max_depth)

    def build(self, proposer, root, logits, hidden, max_nodes, last_pos, sampling):
        self.drafted = self.tree.layout(max_nodes, proposer.max_depth)
        return self.tree.build(proposer, root, logits, hidden, max_nodes, last_pos, sampling)


def _select(tok: Tensor, score: Tensor, parent: Tensor, root: Tensor, total: int):
    """Keep the best total - 1 candidates per row as a tree in creation order (parents first)."""
    B, C = tok.shape
    keep = min(total - 1, C)
    # stable: among equal scores the earlier-created candidate (an ancestor) ranks first
    order = score.sort(dim=-1, descending=True, stable=True).indices[:, :keep]
    chosen = order.sort(-1).values  # [B, keep] creation order = topological order
    node_of = torch.zeros(B, C, dtype=torch.long)  # candidate -> node index (0: not chosen / the root)
    node_of.scatter_(1, chosen, torch.arange(1, keep + 1).expand(B, keep))
    par = parent.gather(1, chosen)
    parents = torch.where(par < 0, 0, node_of.gather(1, par.clamp(min=0)))
    tokens = torch.cat([root.cpu()[:, None], tok.gather(1, chosen)], 1)
    return tokens, torch.cat([torch.full((B, 1), -1), parents], 1), None


def _gather_nodes(x: Tensor, idx: Tensor) -> Tensor:  # x [B, n, ...], idx [B, m] -> [B, m, ...]
    return x[torch.arange(x.shape[0], device=x.device)[:, None], idx]


# ================================================================================== the drafters

class TreeDrafter(Drafter):
    """A proposer (head or draft model) drafting chains/trees through a policy."""

    def __init__(self, proposer: Proposer, policy: TreePolicy):
        self.proposer, self.policy = proposer, policy
        self.sampling = Sampling()

    def feature_layers(self) -> list[int]:
        return self.proposer.feature_layers()

    def networks(self) -> list[nn.Module]:
        network = getattr(self.proposer, "head", getattr(self.proposer, "model", None))
        return [network] if isinstance(network, nn.Module) else []

    def plan(self, budget, batch_size: int, target_params: int, greedy: bool = True) -> int:
        self.policy.plan(self.proposer, budget, batch_size, target_params, greedy)
        return self.max_nodes(budget.max_tokens(batch_size))

    def max_nodes(self, budget: int) -> int:
        return max(1, min(budget, self.policy.size(self.proposer.max_depth)))

    def describe(self) -> dict:
        info = {"drafter": type(self.proposer).__name__, "policy": type(self.policy).__name__}
        head = getattr(self.proposer, "head", None)
        if head is not None:
            info["draft_vocab"] = None if head.draft_vocab is None else len(head.draft_vocab)
        plan = getattr(self.policy, "planned", None)
        if plan is not None:  # the last plan: what the cost model expected
            info.update(nodes=plan.size + 1, depth=plan.depth, expected_tau=round(plan.expected_tokens, 3),
                        predicted_speedup=round(plan.speedup, 3), draft_cost=round(getattr(self.policy, "planned_cost", 0.0), 4),
                        draft_cost_from=getattr(self.policy, "planned_cost_source", None),
                        acceptance_from=getattr(self.policy, "acceptance_source", None))
        return info

    def observe_draft_cost(self, cost: float) -> None:
        """The engine's measurement of one draft level in plain steps, for a policy that plans with it."""
        observe = getattr(self.policy, "observe_draft_cost", None)
        if observe is not None:
            observe(cost)

    def observe_accepted(self, path: Tensor, num: Tensor) -> None:
        """The engine's verification of the last draft (accepted path [B, D+1], tokens emitted [B]), for a
        policy that plans with the acceptance it sees."""
        observe = getattr(self.policy, "observe_accepted", None)
        if observe is not None:
            observe(path, num)

    def reset(self, prompt, lengths, max_len, sampling=None):
        self.sampling = sampling or Sampling()
        self.proposer.reset(prompt, lengths, max_len)

    def commit(self, tokens, feats, positions, num_valid):
        self.logits, self.hidden = self.proposer.begin(tokens, feats, positions, num_valid)
        self.last_pos = positions.gather(1, (num_valid - 1)[:, None])[:, 0]  # [B] newest feature m - 1

    def propose(self, root, max_nodes):
        if max_nodes <= 1:
            return Draft(root.cpu()[:, None], torch.tensor([-1]))
        tokens, parents, probs = self.policy.build(self.proposer, root, self.logits, self.hidden, max_nodes,
                                                   self.last_pos, self.sampling)
        self.proposer.end()
        return Draft(tokens, parents, probs)


class PromptLookup(Drafter):
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n-gram (n from
    max_ngram down to min_ngram) and propose the gamma tokens that followed it. No model; vectorised."""

    def __init__(self, gamma: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if gamma < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs gamma >= 1 and 1 <= min_ngram <= max_ngram")
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram

    def max_nodes(self, budget):
        return max(1, min(budget, self.gamma + 1))

    def describe(self) -> dict:
        return {"drafter": "PromptLookup", "gamma": self.gamma, "ngram": [self.min_ngram, self.max_ngram]}

    def reset(self, prompt, lengths, max_len, sampling=None):
        self.history = torch.full((prompt.shape[0], max_len + 1), -1, dtype=torch.long)
        self.history[:, :prompt.shape[1]] = torch.where(
            torch.arange(prompt.shape[1]) < lengths[:, None], prompt, -1)
        self.length = lengths.clone()

    def commit(self, tokens, feats, positions, num_valid):
        valid = torch.arange(tokens.shape[1]) < num_valid[:, None]
        cols = torch.where(valid, positions + 1, self.history.shape[1] - 1)  # token after feature position t
        self.history.scatter_(1, cols, torch.where(valid, tokens, -1))
        self.history[:, -1] = -1
        self.length = positions.gather(1, (num_valid - 1)[:, None])[:, 0] + 2

    def propose(self, root, max_nodes):
        B, width = self.history.shape[0], min(self.gamma, max_nodes - 1)
        if width < 1:
            return Draft(root.cpu()[:, None], torch.tensor([-1]))
        L = int(self.length.max())
        hist = self.history[:, :L]
        found = torch.full((B,), -1)  # start of the continuation in history
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if L <= n:
                continue
            tail = hist.gather(1, (self.length[:, None] - n + torch.arange(n)).clamp(min=0))  # [B, n]
            windows = hist.unfold(1, n, 1)  # [B, L - n + 1, n]
            starts = torch.arange(windows.shape[1])
            hit = (windows == tail[:, None]).all(-1) & (starts + n < self.length[:, None])  # [B, W]
            hit &= (self.length >= n)[:, None]
            latest = torch.where(hit, starts, -1).amax(-1)  # the most recent earlier occurrence
            found = torch.where((found < 0) & (latest >= 0), latest + n, found)
        cols = found[:, None] + torch.arange(width)
        ok = (found[:, None] >= 0) & (cols < self.length[:, None])
        cont = torch.where(ok, hist.gather(1, cols.clamp(0, L - 1)), -1)  # [B, width]
        depth = int(ok.sum(1).max())
        tokens = torch.cat([root.cpu()[:, None], cont[:, :depth]], 1)
        return Draft(tokens, chain_parents(depth + 1))


# ================================================================================= construction

# Drafts read this many rows of the read-out instead of the whole vocabulary: the most frequent training
# tokens cover ~88% of held-out tokens at 8k on SmolLM2 (49k vocab) for a sixth of the read-out cost.
DEFAULT_DRAFT_VOCAB = 8192

POLICIES = {"chain": Chain, "static": StaticTree, "dynamic": DynamicTree, "auto": AutoTree}


def build_drafter(kind: str, target=None, *, head: DraftHead | None = None, draft_model=None,
                  policy: str | None = None, draft_vocab: int | str | None = "auto",
                  **options) -> Drafter:
    """kind: "prompt_lookup" | "draft_model" | "head". Options go to the policy (chain: gamma, sample;
    static: choices, or accuracies (per-depth acceptance, e.g. an eval.json's acceptance_by_depth) +
    total_nodes + top_k; dynamic: total_tokens, depth, top_k; auto: acceptance, top_k, max_depth,
    draft_cost) or to PromptLookup (gamma, max_ngram, min_ngram). A head's default policy is `auto` (the
    tree sized for this machine, see AutoTree); a draft model's default is a chain. `draft_vocab`: a head
    drafts among its `draft_vocab` most frequent training tokens (None: the whole vocabulary; "auto":
    DEFAULT_DRAFT_VOCAB, except that a head with a draft vocabulary of its own, EAGLE-3, drafts over all of it,
    as serving engines do)."""
    if kind == "prompt_lookup":
        return PromptLookup(**options)
    if kind == "draft_model":
        if draft_model is None:
            raise HeadError("drafter=draft_model needs draft_model=<a causal LM sharing the target's tokenizer>")
        model = draft_model.model if isinstance(draft_model, Target) else draft_model
        if target is not None and model.config.vocab_size != target.config.vocab_size:
            raise HeadError(f"the draft model's vocab_size {model.config.vocab_size} differs from the target's "
                            f"{target.config.vocab_size}: it must share the target's tokenizer")
        return TreeDrafter(DraftModelProposer(model), _policy(policy or "chain", options))
    if kind == "head":
        if head is None:
            raise HeadError("drafter=head needs a head (headway.heads.base.load_head(RUN/final))")
        if draft_vocab == "auto":
            draft_vocab = None if head.own_draft_vocab else DEFAULT_DRAFT_VOCAB
        head.set_draft_vocab(draft_vocab)
        return TreeDrafter(HeadProposer(head), _policy(policy or "auto", options))
    raise HeadError(f"unknown drafter {kind!r}: choose prompt_lookup, draft_model or head")


def _policy(name: str, options: dict):
    if name not in POLICIES:
        raise HeadError(f"unknown tree policy {name!r}: choose one of {sorted(POLICIES)}")
    try:
        if name == "static" and "accuracies" in options:  # derive the tree from measured accuracies
            return StaticTree.from_accuracies(**options)
        return POLICIES[name](**options)
    except TypeError as exc:
        raise HeadError(f"bad options {sorted(options)} for the {name} policy: {exc}") from exc
    except ValueError as exc:  # a value the policy refuses (its message names it): one error line, not a traceback
        raise HeadError(f"the {name} policy: {exc}") from exc
