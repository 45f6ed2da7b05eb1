"""Small pieces the draft heads share: options, decoder layers of the target's architecture, attention over a
committed-context KV cache plus a draft tree, and chained (conditional) depth accuracies.

Attention inside a head layer is always "explicit keys + boolean mask": a layer call attends to
`prefix keys (context / tree) ++ its own new keys`, and the mask says which. The same code path serves the
teacher-forced training forward (no prefix), `draft_begin` (prefix = committed context) and `draft_expand`
(prefix = committed context ++ this round's tree), so cached drafting equals a full recompute by
construction.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headway.heads.base import HeadError, HeadLoss, TargetFeatures
from headway.heads.kernels import chain_attention


# ------------------------------------------------------------------------------------------- options

def resolve_options(kind: str, defaults: dict, given: dict, choices: dict | None = None) -> dict:
    """defaults <- given, with one clear error for a misspelled name or an invalid choice."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise HeadError(f"unknown option(s) {unknown} for head {kind!r}: valid options are {sorted(defaults)}")
    options = dict(defaults, **given)
    for name, allowed in (choices or {}).items():
        if options[name] not in allowed:
            raise HeadError(f"head {kind!r}: option {name}={options[name]!r} is not one of {list(allowed)}")
    return options


def require(ok: bool, message: str) -> None:
    if not ok:
        raise HeadError(message)


def positive_int(kind: str, options: dict, *names: str) -> None:
    for name in names:
        value = options[name]
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"head {kind!r}: option {name} must be an integer >= 1, got {value!r}")


# ------------------------------------------------------------------------- target-architecture layers

def decoder_layer_class(config) -> type[nn.Module]:
    """The decoder-layer class of the target's architecture (e.g. LlamaDecoderLayer), found from its config
    alone so that a head can be built before (or without) the target's weights."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as exc:
        raise HeadError(f"target model_type {config.model_type!r} has no causal-LM class in transformers") from exc
    module = sys.modules[model_cls.__module__]
    names = [n for n in (model_cls._no_split_modules or []) if n.endswith("DecoderLayer") and hasattr(module, n)]
    if not names:
        raise HeadError(f"cannot find the decoder-layer class of {model_cls.__name__}: heads support "
                        f"Llama-like targets (Llama, Qwen2, Mistral)")
    return getattr(module, names[0])


def head_layer_config(config):
    """The target's config for the head's own layers: same shapes, our attention path (explicit masks: tensors
    through SDPA, the training-time test's ChainMasks through heads.kernels.chain_attention)."""
    cfg = copy.deepcopy(config)
    cfg._attn_implementation = chain_attention.NAME
    return cfg


def new_decoder_layer(config, layer_idx: int = 0) -> nn.Module:
    """A decoder layer of the target's class and shapes; `layer_idx` picks its key/value heads in a JoinKV (a head
    with several layers)."""
    return decoder_layer_class(config)(head_layer_config(config), layer_idx=layer_idx)


INIT_LAYER = ("random", "last")


@torch.no_grad()
def copy_target_layer(head_layer: nn.Module, target_layer: nn.Module) -> None:
    """Start a head's decoder layer from the target's last one (`init_layer=last`): a head predicts what
    the target's top layer computes, so its weights are a closer start than random ones. Parameters of equal
    shape are copied; a projection reading a wider input [.., k*h] than the target's [.., h] (EAGLE-3's
    q/k/v over cat(embedding, feature)) takes the target's weight for its last h columns (the feature);
    parameters the target lacks keep their initialisation."""
    source = dict(target_layer.named_parameters())
    for name, param in head_layer.named_parameters():
        src = source.get(name)
        if src is None:
            continue
        if src.shape == param.shape:
            param.copy_(src)
        elif src.dim() == 2 and src.shape[0] == param.shape[0] and param.shape[1] % src.shape[1] == 0:
            param[:, -src.shape[1]:].copy_(src)


def new_rms_norm(layer: nn.Module, config, size: int | None = None) -> nn.Module:
    """An RMSNorm of the target's own flavour (the class its decoder layer uses), hidden_size wide by default."""
    return type(layer.post_attention_layernorm)(size or config.hidden_size, eps=config.rms_norm_eps)


class JoinKV:
    """Stands in for a transformers Cache during one step of a head's layers: each layer attends to `prefix ++ new`
    keys; the new (rotated) keys/values are kept so the caller can store them.

    A head with several layers keeps them side by side on the key/value-head axis ([B, layers * Hkv, n, d],
    layer i's heads at [i * Hkv, (i + 1) * Hkv)): the committed context, the draft tree and the training-time
    test's earlier steps store one tensor whatever the depth of the head, and every layer sees the same mask."""

    def __init__(self, prefix: tuple[Tensor, Tensor] | None = None):
        self.prefix = prefix
        self.new: dict[int, tuple[Tensor, Tensor]] = {}  # layer_idx -> its new key, value [B, Hkv, n, d]

    def update(self, key, value, layer_idx=0, *args, **kwargs):  # [B, Hkv, n, d]
        self.new[layer_idx] = key, value
        if self.prefix is None:
            return key, value
        heads = slice(layer_idx * key.shape[1], (layer_idx + 1) * key.shape[1])
        return torch.cat([self.prefix[0][:, heads], key], 2), torch.cat([self.prefix[1][:, heads], value], 2)

    @property
    def key(self) -> Tensor:  # [B, layers * Hkv, n, d]
        return self._stacked(0)

    @property
    def value(self) -> Tensor:
        return self._stacked(1)

    def _stacked(self, which: int) -> Tensor:
        parts = [self.new[i][which] for i in sorted(self.new)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def rotary(frozen: dict, x: Tensor, positions: Tensor):
    """(cos, sin) of the target's rotary embedding at `positions` [B, n]."""
    return frozen["rotary_emb"](x, positions.clamp(min=0))


def attend_mask(q_pos: Tensor, k_pos: Tensor, k_valid: Tensor, gap: int = 0) -> Tensor:
    """Key j is visible to query i if it is valid and at least `gap` positions earlier (gap 0 = causal).
    q_pos [B, n], k_pos/k_valid [B, L] -> [B, 1, n, L] bool."""
    ok = (k_pos[:, None, :] <= q_pos[:, :, None] - gap) & k_valid[:, None, :]
    return ok[:, None]


def self_mask(n: int, device) -> Tensor:  # [1, 1, n, n]: every query sees its own key
    return torch.eye(n, dtype=torch.bool, device=device)[None, None]


# ---------------------------------------------------------------------------------- committed context

class ContextKV:
    """Keys/values of the committed context for one attention layer, preallocated [B, Hkv, max_len, d] and
    filled left to right per row (rows are ragged). Only `append` and `view` are used by the heads, so a
    paged cache can replace this class."""

    def __init__(self, batch_size: int, max_len: int):
        self.batch_size, self.max_len = batch_size, max_len
        self.k = self.v = None
        self.pos = None  # [B, max_len] position of each stored entry
        self.lengths = None  # [B]

    def append(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Store the valid entries of k/v [B, Hkv, n, d] (positions/valid [B, n]) after each row's last."""
        if self.k is None:
            B, H, _, d = k.shape
            self.k = k.new_zeros(B, H, self.max_len, d)
            self.v = v.new_zeros(B, H, self.max_len, d)
            self.pos = torch.zeros(B, self.max_len, dtype=torch.long, device=k.device)
            self.lengths = torch.zeros(B, dtype=torch.long, device=k.device)
        slot = self.lengths[:, None] + valid.long().cumsum(1) - 1  # [B, n] destination of valid entries
        if int((slot.masked_fill(~valid, -1).max())) >= self.max_len:
            raise HeadError(f"draft context longer than max_len={self.max_len}: raise max_len in draft_state")
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(slot)
        b, s = rows[valid], slot[valid]
        self.k[b, :, s] = k.transpose(1, 2)[valid]
        self.v[b, :, s] = v.transpose(1, 2)[valid]
        self.pos[b, s] = positions[valid]
        self.lengths += valid.sum(1)

    def view(self):
        """(k, v [B, Hkv, L, d], positions [B, L], valid [B, L]) trimmed to the longest row."""
        if self.k is None:
            return None
        L = max(int(self.lengths.max()), 1)
        valid = torch.arange(L, device=self.k.device)[None] < self.lengths[:, None]
        return self.k[:, :, :L], self.v[:, :, :L], self.pos[:, :L], valid


@dataclass
class DraftTree:
    """This round's tree nodes (tree-local K/V and who is whose ancestor); dropped by draft_end."""

    k: Tensor | None = None  # [B, Hkv, N, d]
    v: Tensor | None = None
    ancestors: Tensor | None = None  # [B, N, N] bool: ancestors[b, i, j] = node j is an ancestor of node i

    @property
    def size(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def ancestors_of_new(self, parents: Tensor) -> Tensor:
        """[B, n, N]: ancestors of new nodes hanging from `parents` [B, n] (-1 = root)."""
        B, n = parents.shape
        N = self.size
        if N == 0:
            return torch.zeros(B, n, 0, dtype=torch.bool, device=parents.device)
        idx = parents.clamp(min=0)
        anc = torch.gather(self.ancestors, 1, idx[:, :, None].expand(B, n, N))  # the parent's ancestors
        anc = anc | F.one_hot(idx, N).bool()  # plus the parent itself
        return anc & (parents >= 0)[:, :, None]

    def add(self, k: Tensor, v: Tensor, anc_new: Tensor) -> None:
        B, n, N = anc_new.shape
        if N == 0:
            self.k, self.v, self.ancestors = k, v, anc_new.new_zeros(B, n, n)
            return
        self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        grown = anc_new.new_zeros(B, N + n, N + n)
        grown[:, :N, :N] = self.ancestors
        grown[:, N:, :N] = anc_new
        self.ancestors = grown


@dataclass
class ContextDraftState:
    """Inference state of a head with one attention layer: committed-context KV + this round's tree."""

    context: ContextKV
    tree: DraftTree = field(default_factory=DraftTree)
    last_pos: Tensor | None = None  # [B] position of the newest committed feature (m - 1)


def begin_mask(ctx_view, positions: Tensor, valid: Tensor, gap: int = 0) -> Tensor:
    """Mask for this round's new entries [B, n] attending to the stored context and to each other."""
    new = attend_mask(positions, positions, valid, gap) | self_mask(positions.shape[1], positions.device)
    if ctx_view is None:
        return new
    return torch.cat([attend_mask(positions, ctx_view[2], ctx_view[3], gap), new], -1)


def expand_mask(ctx_view, tree: DraftTree, anc_new: Tensor, q_pos: Tensor) -> Tensor:
    """Mask for new tree nodes: committed context, their ancestors in the tree, themselves."""
    parts = [] if ctx_view is None else [attend_mask(q_pos, ctx_view[2], ctx_view[3])]
    parts += [anc_new[:, None], self_mask(q_pos.shape[1], q_pos.device).expand(q_pos.shape[0], -1, -1, -1)]
    return torch.cat(parts, -1)


def context_prefix(ctx_view, tree: DraftTree | None = None):
    """Keys/values the new entries attend to before their own: context (++ tree)."""
    ks, vs = [], []
    if ctx_view is not None:
        ks.append(ctx_view[0]), vs.append(ctx_view[1])
    if tree is not None and tree.size:
        ks.append(tree.k), vs.append(tree.v)
    if not ks:
        return None
    return torch.cat(ks, 2), torch.cat(vs, 2)


def last_valid(x: Tensor, num_valid: Tensor) -> Tensor:
    """x [B, n, ...] -> x[b, num_valid[b] - 1] [B, ...]."""
    idx = (num_valid - 1).clamp(min=0)
    return x[torch.arange(x.shape[0], device=x.device), idx]


def valid_slots(num_valid: Tensor, n: int) -> Tensor:  # [B, n] bool, left-aligned
    return torch.arange(n, device=num_valid.device)[None] < num_valid[:, None]


# ----------------------------------------------------------------------- training-time unrolled steps

class UnrollKV:
    """Keys of earlier unrolled steps for the training-time test (EAGLE-3's TTT, EAGLE's open-loop eval).

    Step j (1-based) at query position t drafts from the anchor c = t - j + 1: it sees step-1 entries (true
    features) at positions <= c and the step-i entry at position c + i - 1 for i = 2..j (its ancestors in a
    chain, and itself) -- exactly what `draft_expand` sees in a chain at depth j - 1."""

    def __init__(self):
        self.keys: list[tuple[Tensor, Tensor]] = []

    def step_kv_and_mask(self, T: int) -> tuple[JoinKV, chain_attention.ChainMask]:
        """The next step's keys (earlier steps' ++ its own) and which of them each query sees: step j's query t
        sees step-1 keys at positions <= t - (j - 1) and one key of each step i = 2..j, at t - (j - i)."""
        mask = chain_attention.ChainMask(steps=len(self.keys) + 1, length=T)
        prefix = None
        if self.keys:
            prefix = (torch.cat([k for k, _ in self.keys], 2), torch.cat([v for _, v in self.keys], 2))
        return JoinKV(prefix), mask

    def keep(self, kv: JoinKV) -> None:
        self.keys.append((kv.key, kv.value))


def shift_right(x: Tensor, steps: int = 1) -> Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t - steps] (zeros where t < steps)."""
    if steps == 0:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 2) + (steps, 0))[:, : x.shape[1]]


def shift_left(x: Tensor, steps: int, fill=0) -> Tensor:
    """x [B, T, ...] -> y with y[:, t] = x[:, t + steps] (`fill` past the end)."""
    if steps == 0:
        return x
    return torch.cat([x[:, steps:], x.new_full((x.shape[0], steps) + x.shape[2:], fill)], 1)


def learnt_queries(loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Queries t whose draft of x_{t+2} is learnt (loss_mask[t+2]), and the positions t+1 whose target
    features score them: two [B, T] bool masks that select the same number of rows in the same order. Heads
    read out only there: a prompt or padding position is never scored, so its logits need not exist."""
    queries = shift_left(loss_mask.bool(), 2, fill=False)
    features = torch.zeros_like(queries)
    features[:, 1:] = queries[:, :-1]
    return queries, features


def scatter_rows(mask: Tensor, values: Tensor, fill: int = -1) -> Tensor:
    """values [n] of the rows `mask` [B, T] selects -> [B, T], `fill` elsewhere (an id no label equals)."""
    out = values.new_full(mask.shape, fill)
    out[mask] = values
    return out


# ---------------------------------------------------------------------------------------- metrics

def labels_at_depth(input_ids: Tensor, loss_mask: Tensor, depth: int):
    """Depth d drafted from anchor c (the last position with a target feature) predicts x_{c+1+d}:
    returns (labels [B, T], scored [B, T]) indexed by anchor c."""
    labels = shift_left(input_ids, depth + 1)
    scored = shift_left(loss_mask.bool(), depth + 1, fill=False)
    return labels, scored


def chain_accuracy(preds: list[Tensor], input_ids: Tensor, loss_mask: Tensor,
                   computed: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Conditional top-1 accuracy by depth of a greedy chain.

    preds[d-1] [B, T]: the depth-d draft from anchor c. Depth d is counted at anchors whose depths 1..d-1
    were all right, so prod_k(correct_k / count_k) is the empirical probability that the chain is
    accepted through depth k, and `simulated_tau` of these rates is the chain's empirical tau.
    `computed[d-1]` [B, T] marks anchors whose depth-d draft was actually computed (default: all)."""
    correct_all, count_all = [], []
    alive = torch.ones_like(loss_mask, dtype=torch.bool)
    for d, pred in enumerate(preds, start=1):
        labels, scored = labels_at_depth(input_ids, loss_mask, d)
        if computed is not None:
            scored = scored & computed[d - 1]
        counted = alive & scored
        hit = counted & (pred == labels)
        correct_all.append(hit.sum())
        count_all.append(counted.sum())
        alive = hit
    return torch.stack(correct_all), torch.stack(count_all)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values over mask (0 when the mask is empty, keeping the graph)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


class TargetDistribution:
    """The target's next-token distribution p [..., V] (fp32) and its entropy, computed once per batch and
    shared by every training-time-test step's loss. Target logits may be -inf (a top-k cache): those
    tokens have p = 0; a row with no finite logit has p = 0 everywhere and adds nothing. `temperature`
    divides the logits first (below 1 the distribution moves toward the target's argmax)."""

    def __init__(self, target_logits: Tensor, temperature: float = 1.0):
        V = target_logits.shape[-1]
        logits = target_logits.reshape(-1, V)  # [n, V], any float dtype: each block is raised to fp32 in cache
        self.shape = target_logits.shape[:-1]
        self.p = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        self.entropy = torch.empty(logits.shape[0], device=logits.device)  # [n]
        with torch.no_grad():
            for rows in row_blocks(logits):
                z = logits[rows].float()
                log_p = (z / temperature if temperature != 1.0 else z).log_softmax(-1)
                p = torch.exp(log_p, out=self.p[rows]).nan_to_num_(0.0)  # NaN rows (no support) -> 0
                log_p.nan_to_num_(0.0, neginf=torch.finfo(log_p.dtype).min)  # where p = 0: 0 x finite
                self.entropy[rows] = -(p * log_p).sum(-1)
        self.p_sum = self.p.sum(-1)  # [n]: 1, or 0 for a row with no support

    def kl(self, logits: Tensor) -> Tensor:
        """KL(p || q) per position, [..., V] -> [...] (fp32): the soft cross-entropy minus the target's entropy,
        so the same gradient, and 0 means the head matches the target."""
        flat = logits.reshape(-1, logits.shape[-1])
        return (SoftCrossEntropy.apply(flat, self.p, self.p_sum) - self.entropy).reshape(self.shape)


class SoftCrossEntropy(torch.autograd.Function):
    """-sum_i p_i log softmax(z)_i per row of [n, V], with the closed-form gradient softmax(z) sum(p) - p.

    The read-out's [n, V] logits are the largest tensors of a training step, and on a CPU a pass over a whole
    [n, V] tensor streams it from memory: so the loss and its gradient are computed block by block of rows
    (row_blocks), every pass over a block in cache, and the gradient is kept in the logits' dtype for the
    backward pass, which only scales each row by its upstream gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, p: Tensor, p_sum: Tensor | None = None) -> Tensor:  # [n, V] -> [n]
        p_sum = p.sum(-1) if p_sum is None else p_sum
        loss = torch.empty(logits.shape[0], dtype=p.dtype, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        for rows in row_blocks(logits):
            log_q = logits[rows].to(p.dtype).log_softmax(-1)  # in p's precision (fp32 from TargetDistribution)
            log_q.clamp_(min=torch.finfo(log_q.dtype).min)  # a -inf logit where p = 0 adds 0, not 0 * inf = NaN
            loss[rows] = -(p[rows] * log_q).sum(-1)
            if grad is not None:
                grad[rows] = log_q.exp_().mul_(p_sum[rows, None]).sub_(p[rows])
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad, = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype).unsqueeze(-1), None, None


ROW_BLOCK_BYTES = 1 << 21  # fp32 rows per block on a CPU: about a core's L2 cache


def row_blocks(x: Tensor) -> list[slice]:
    """Row slices of a [n, V] tensor for blockwise passes: ~ROW_BLOCK_BYTES of fp32 each on a CPU, where a pass
    over a block in cache is several times as fast per element as one streaming the whole tensor from memory
    (2-core Xeon: exp over [1030, 16384] fp32 20 ms, the same rows in blocks of 32 1.7 ms); one block on a GPU."""
    n = x.shape[0]
    rows = max(1, ROW_BLOCK_BYTES // (4 * x.shape[-1])) if x.device.type == "cpu" else max(n, 1)
    return [slice(start, start + rows) for start in range(0, n, rows)]


def kl_to_target(logits: Tensor, target_logits: Tensor) -> Tensor:
    """KL(p_target || q) per position, [..., V] -> [...] (fp32), from the target's logits (see
    TargetDistribution; build one instead when several losses share the same target)."""
    return TargetDistribution(target_logits).kl(logits)


def feature_regression(predicted: Tensor, target: Tensor) -> Tensor:
    """EAGLE's feature loss: SmoothL1 between predicted and true hidden states, per position, [..., h] -> [...]."""
    return F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1)


def top_k_cross_entropy(logits: Tensor, target_logits: Tensor, k: int) -> Tensor:
    """-sum over the target's k most probable tokens of p log q, per position, [..., V] -> [...] (fp32).
    The soft cross-entropy restricted to the head of the target's distribution (HASS's "harmonized objective
    distillation"): added to the full one, it weighs the tokens a draft tree can actually propose (its top
    few) more than the tail. Tokens with p = 0 (-inf target logits) add nothing."""
    log_p = target_logits.float().log_softmax(-1)
    top_log_p, top_ids = log_p.topk(min(k, log_p.shape[-1]), dim=-1)  # [..., k]
    p = top_log_p.exp().nan_to_num(0.0)  # a row without a finite target logit: p = 0
    log_q = logits.float().log_softmax(-1).gather(-1, top_ids)  # [..., k]
    return -torch.where(p > 0, p * log_q, torch.zeros_like(log_q)).sum(-1)


def in_top_k(logits: Tensor, labels: Tensor, k: int) -> Tensor:
    """[n, V] logits, [n] label indices (any index outside [0, V) never matches) -> [n] bool: the label is
    among the k highest logits, i.e. a draft tree that expands the top k children would hold it."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # [n, k]
    return (top == labels[:, None]).any(-1)


def chain_reachable(hits: list[Tensor]) -> Tensor:
    """Query-indexed [B, T] hits of steps 0..j-1 -> [B, T] bool for step j: every earlier draft of the same
    chain (step i at query t - (j - i)) held its true token in its top k, so a tree could reach this draft at
    all (GRIFFIN's loss mask). A chain position left of the sequence counts as reached. `hits` is not empty."""
    j = len(hits)
    reached = torch.ones_like(hits[0])
    for i, hit in enumerate(hits):
        shift = j - i
        reached[:, shift:] &= hit[:, :-shift]
    return reached


def head_loss(loss: Tensor, correct: Tensor, count: Tensor, **metrics: Tensor) -> HeadLoss:
    return HeadLoss(loss, correct.detach(), count.detach(), {k: float(v) for k, v in metrics.items()})


# ------------------------------------------------------------------- drafting with one attention layer

def context_begin(context: ContextKV, step, emb: Tensor, hidden: Tensor, positions: Tensor, valid: Tensor,
                  gap: int = 0) -> Tensor:
    """Run `step(emb, hidden, positions, kv, mask)` on newly committed entries [B, n] against the stored
    context, then store their keys/values; returns the step's output [B, n, h]."""
    ctx = context.view()
    kv = JoinKV(context_prefix(ctx))
    out = step(emb, hidden, positions, kv, begin_mask(ctx, positions, valid, gap))
    context.append(kv.key, kv.value, positions, valid)
    return out


def tree_expand(state: ContextDraftState, step, depth: int, emb: Tensor, parent_hidden: Tensor,
                parents: Tensor) -> Tensor:
    """Run `step` on one tree level [B, n]: each node sees the committed context, its ancestors and itself.
    Node positions are m - 1 + depth (the committed feature m - 1 is the root's)."""
    q_pos = (state.last_pos[:, None] + depth).expand_as(parents)
    ctx = state.context.view()
    anc = state.tree.ancestors_of_new(parents)
    kv = JoinKV(context_prefix(ctx, state.tree))
    out = step(emb, parent_hidden, q_pos, kv, expand_mask(ctx, state.tree, anc, q_pos))
    state.tree.add(kv.key, kv.value, anc)
    return out


def unroll_steps(step, emb: Tensor, first_hidden: Tensor, steps: int) -> list[Tensor]:
    """Training-time test over a whole sequence [B, T]: step 1 reads the true features, step j > 1 reads at
    position t the output step j - 1 produced at t - 1, with the chain attention of `UnrollKV`."""
    B, T = emb.shape[:2]
    positions = torch.arange(T, device=emb.device)[None].expand(B, T)
    keys, outs, hidden = UnrollKV(), [], first_hidden
    for _ in range(steps):
        kv, mask = keys.step_kv_and_mask(T)
        out = step(emb, hidden, positions, kv, mask)
        keys.keep(kv)
        outs.append(out)
        hidden = shift_right(out)
    return outs


def by_anchor(step_values: list[Tensor]) -> list[Tensor]:
    """Step j's values at query t belong to the draft from anchor c = t - j + 1: re-index by anchor."""
    return [shift_left(v, j) for j, v in enumerate(step_values)]


def unrolled_accuracy(preds_by_step: list[Tensor], num_depths: int, input_ids: Tensor, loss_mask: Tensor):
    """Chain accuracies from the steps that were unrolled (query-indexed argmax ids); deeper depths get
    count 0 (training mode runs only the trained steps)."""
    steps = len(preds_by_step)
    preds = by_anchor(preds_by_step) + [torch.zeros_like(input_ids)] * (num_depths - steps)
    computed = [torch.full_like(loss_mask, d < steps, dtype=torch.bool) for d in range(num_depths)]
    return chain_accuracy(preds, input_ids, loss_mask, computed)


class OneLayerDrafting:
    """Inference hooks and teacher-forced drafts for heads whose one step (one attention layer, or a few whose
    keys JoinKV keeps side by side) attends over the committed context and the tree (EAGLE, EAGLE-3). The head
    provides `step(emb, hidden, positions, kv, mask)`, `begin_hidden(feats)` (its input hidden from target
    features) and `vocab_logits(out)` ([..., V])."""

    def anchor_logits(self, input_ids: Tensor, feats: TargetFeatures, steps: int | None = None) -> list[Tensor]:
        """Teacher-forced drafts: [d-1] = logits [B, T, V] of the depth-d draft from each anchor c."""
        outs = self.unroll(input_ids, self.begin_hidden(feats), steps or self.num_depths)
        return by_anchor([self.vocab_logits(o) for o in outs])

    def unroll(self, input_ids: Tensor, first_hidden: Tensor, steps: int) -> list[Tensor]:
        """Outputs [B, T, h] of each unrolled step by query position t (the step drafts x_{t+2})."""
        return unroll_steps(self.step, self.embed(shift_left(input_ids, 1)), first_hidden, steps)

    def draft_state(self, batch_size: int, max_len: int) -> ContextDraftState:
        return ContextDraftState(ContextKV(batch_size, max_len))

    def draft_begin(self, state: ContextDraftState, tokens, feats: TargetFeatures, positions, num_valid):
        valid = valid_slots(num_valid, tokens.shape[1])
        out = context_begin(state.context, self.step, self.embed(tokens), self.begin_hidden(feats), positions,
                            valid)
        state.tree, state.last_pos = DraftTree(), last_valid(positions, num_valid)
        hidden = last_valid(out, num_valid)  # [B, h] the root: drafts x_{m+1}
        return self.vocab_logits(hidden), hidden

    def draft_expand(self, state: ContextDraftState, depth: int, tokens, parent_hidden, parents, positions):
        out = tree_expand(state, self.step, depth, self.embed(tokens), parent_hidden, parents)
        return self.vocab_logits(out), out

    def draft_end(self, state: ContextDraftState) -> None:
        state.tree = DraftTree()
