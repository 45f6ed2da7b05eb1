"""Batched decoding for data generation, capturing the target's hidden states on the way.

A prefill, then one token per row per step through the HF model's own KV cache. The prefill computes each
prompt token once: the tokens every prompt starts with (the chat template's system turn, a category's hint)
in one row, then the rest of each distinct prompt in groups of rows of similar length, each group padded only
to its own longest (see prefill_groups), rows with the same prompt sharing one; the cache then holds, per row,
[shared prefix][pads][its own tokens]. A
batch of self-written prompts with examples (28-180 tokens, ~100 on average) spent about 65% of its writing
time in one prefill padded to its longest row; grouped, the writing stage is 1.15-1.3x as fast
(docs/data-generation.md). Complete rows
leave the batch (their KV rows are dropped) once they are an eighth of it: dropping rows copies the whole KV
cache (~2 GB at batch 128 and a few hundred tokens on SmolLM2-135M), so finished rows ride along for a few
steps rather than cost one copy each. With a `Tap`, the hidden states of every position fed to the target are kept; when a row stops
(stop token or max_new_tokens), the tap says which token ids the training pipeline will see for it (its
chat-template rendering, tokenised as train/data/conversations does); the tokens of that sequence not fed
yet (the stop token, the template's glue after it) are then teacher-forced through the same loop, and the
tap receives the ids with their hidden states: the features of a teacher-forced forward over those ids, up
to float rounding (incremental attention sums in another order). A row whose training ids do not extend
what was fed (a reply that re-tokenises differently) is not captured: the cache pass computes it later.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from headway.heads.kernels.attention import NAME as GROUPED_SDPA, grouped_sdpa_forward
from headway.heads.kernels.decode_attention import decode_attention
from headway.heads.sampling import argmax, sample, warp_probs
from headway.heads.kernels.weight_layout import apply_layout, current_layout
from headway.train.data.config import DataError, check_precision

GROWTH = 64  # tokens of room a cache buffer gains at least when it grows
MAX_TAIL = 8  # tokens teacher-forced after a row stops (stop token + template glue: 1-3 in practice)
COMPACT_AT = 1 / 8  # complete rows leave the batch once they are this share of it (see _Decoder.retire)
FORWARD_COST = 32  # a prefill forward's fixed cost, in prompt tokens (prefill_groups, shared_prefix)
GROUPED_DECODE_ATTENTION = True  # bf16_copy's attention on a CPU: sdpa_packed_at_decode (False: HF's own)
DECODE_ATTENTION_KERNEL = True  # a CPU decode step through heads/kernels/decode_attention, fp32 or bf16 (False: SDPA)


@dataclass
class Tap:
    """What to capture: hidden-state indices, and two callbacks per row (its index in the call)."""

    layers: list[int]
    training_ids: Callable[[int, list[int], bool], list[int] | None]  # (row, new ids, finished) -> ids
    done: Callable[[int, Tensor, dict[int, Tensor]], None]  # (row, ids [T], {layer: [T, h]})


@dataclass
class Decoded:
    tokens: list[list[int]]  # new tokens per row, the stop token included when it came
    finished: list[bool]  # stopped on a stop token (not on max_new_tokens)
    captured: int = 0  # rows handed to the tap


@torch.no_grad()
def decode(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int,
           temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
           tap: Tap | None = None) -> Decoded:
    """Greedy (temperature 0) or sampled continuation of every prompt (token-id lists of any lengths)."""
    return _Decoder(model, prompts, max_new_tokens, stop_ids, pad_id, temperature, top_p, generator, tap).run()


def decode_with(target, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], temperature: float,
                top_p: float, seed: int, tap: Tap | None = None, decoder=None) -> Decoded:
    """decode() on the target here, or on `decoder` (train.data.vllm_decode.VllmDecoder: no tap; one seed
    per row, since vLLM samples each request on its own generator)."""
    if decoder is not None:
        return decoder(prompts, max_new_tokens, stop_ids, temperature, top_p, [seed + i for i in range(len(prompts))])
    return decode(target.model, prompts, max_new_tokens, stop_ids, target.tokenizer.pad_token_id, temperature,
                  top_p, torch.Generator(target.model.device).manual_seed(seed), tap)


@contextmanager
def generation_layout(target, layout: str | None):
    """The target's Linear layers in weight layout `layout` (heads.kernels.weight_layout) while it generates, as
    they were after; None: as they are. The tiles layout's AMX kernel takes a whole decoding batch of up to 128
    rows (data generation 1.2x faster at batch 128: docs/data-generation.md)."""
    if layout is None:
        yield
        return
    before = current_layout(target.model)
    try:
        apply_layout(target.model, layout, target)
    except ValueError as exc:  # an unknown layout, or one this target or machine cannot run
        raise DataError(f"weight_layout={layout}: {exc}") from None
    try:
        with decode_steps_through_kernel(target.model):
            yield
    finally:
        apply_layout(target.model, before)


@contextmanager
def decode_steps_through_kernel(model):
    """A CPU model with transformers' SDPA attention (or the layouts' grouped form of it) runs its decode steps
    through heads/kernels/decode_attention while it generates, as the bf16 copy does; as it was after."""
    config = model.config
    before = config._attn_implementation
    on_cpu = next(model.parameters()).device.type == "cpu"
    if not (DECODE_ATTENTION_KERNEL and on_cpu and before in ("sdpa", GROUPED_SDPA)):
        yield
        return
    register_packed_attention()
    config._attn_implementation = PACKED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before


@contextmanager
def generating(target, layout: str | None, precision: str = "fp32"):
    """The target set up to generate data: in weight layout `layout` (fp32; see generation_layout), or with
    precision="bf16" as a bf16 copy of its model in place of `target.model` (the stock layout: the layouts'
    kernels are fp32; a target already in bf16 as it is), as it was after; "auto": resolve_precision. bf16
    decodes ~1.6-1.8x as fast on a CPU with AVX512-BF16 (2-core AMD EPYC, batch 128) and writes other text:
    greedy replies part from the fp32 ones at near ties, and captured hidden states carry bf16's rounding
    (docs/data-generation.md)."""
    if resolve_precision(precision, str(next(target.model.parameters()).device)) == "fp32":
        with generation_layout(target, layout):
            yield
        return
    model = target.model
    if next(model.parameters()).dtype == torch.bfloat16:  # a GPU target loads in bf16: no second copy
        yield
        return
    target.model = bf16_copy(model)
    try:
        yield
    finally:
        target.model = model


def resolve_precision(precision: str, device: str) -> str:
    """fp32 or bf16 for `precision` on `device`: auto takes bf16 where it is multiplied in hardware (a GPU that
    has it, a CPU with AMX or AVX512-BF16: decoding ~1.6-1.8x as fast there, docs/data-generation.md), else fp32
    (an emulated bf16 product is far slower than fp32's)."""
    check_precision(precision)
    if precision != "auto":
        return precision
    if str(device).startswith("cuda"):
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    from headway.heads.kernels.machine_choice import cpu_multiplies_bf16

    return "bf16" if str(device) == "cpu" and cpu_multiplies_bf16() else "fp32"


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of an HF causal LM whose read-out takes a contiguous input: the model hands it the last
    position of [B, T, h] as a strided view, which a bf16 matmul on a CPU would multiply as a batched product
    over an expanded weight (~70 s for one prefill of 128 rows on SmolLM2-135M, against milliseconds)."""
    twin = copy.deepcopy(model).to(torch.bfloat16)
    head = twin.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and "forward" not in vars(head):
        head.forward = ContiguousLinear(head)
    if next(twin.parameters()).device.type == "cpu" and twin.config._attn_implementation == "sdpa" \
            and GROUPED_DECODE_ATTENTION:
        register_packed_attention()
        twin.set_attn_implementation(PACKED_SDPA)
    return twin


PACKED_SDPA = "headway_sdpa_packed"


def register_packed_attention() -> None:
    AttentionInterface.register(PACKED_SDPA, sdpa_packed_at_decode)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # the masks of "sdpa" (else HF builds none)


def sdpa_packed_at_decode(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """HF's SDPA attention for data generation on a CPU: a decode step through heads/kernels/decode_attention
    (3-4x SDPA's time per layer at batch 128; 1.2-1.3x the tokens/s of the whole build, docs/data-generation.md)
    where it applies, else with the query heads always grouped per key head; an fp32 prefill as the weight
    layouts attend (heads/kernels/attention.py).

    At one query token HF groups the H query heads [B, H, 1, D] as [B, Hkv, H/Hkv, D] when a mask is given
    (left-padded rows), and hands SDPA the ungrouped heads with enable_gqa when none is (rows of one length:
    the self-written prompts' shared prefix). PyTorch's bf16 SDPA on a CPU runs the second form several
    times slower than the first (batch 128, 64-300 cached tokens); grouping always made that stage 1.3-1.5x
    as fast on SmolLM2-135M (docs/data-generation.md)."""
    groups = query.shape[1] // key.shape[1]
    if query.shape[2] == 1 and DECODE_ATTENTION_KERNEL and not kwargs.get("dropout"):
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        out = decode_attention(query, key, value, attention_mask, scale)  # None where the kernel does not apply
        if out is not None:
            return out, None
    if query.shape[2] != 1 and query.dtype == torch.float32:  # an fp32 prefill: as the weight layouts attend
        return grouped_sdpa_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[2] != 1 or groups == 1 or kwargs.get("dropout"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return grouped_decode_sdpa(query, key, value, attention_mask, kwargs.get("scaling")), None


def grouped_decode_sdpa(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float | None) -> Tensor:
    """A decode step through PyTorch's SDPA, query [B, H, 1, D] grouped per key head -> [B, 1, H, D]."""
    B, H, _, D = query.shape
    grouped = query.reshape(B, key.shape[1], H // key.shape[1], D)  # [B, Hkv, H/Hkv, D]: a key head's queries
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)  # mask [B, 1, 1, T]
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous()  # [B, 1, H, D], as HF's attention returns


class ContiguousLinear:
    """linear.forward on a contiguous input (a plain object: the model still deep-copies)."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x.contiguous(), self.linear.weight, self.linear.bias)


def growing_cache() -> Cache:
    """An HF cache whose layers append in place (GrowingLayer): what DynamicCache does, without its copies."""
    return Cache(layer_class_to_replicate=GrowingLayer)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values [B, H, T, D] are views into buffers with spare room along T.

    DynamicLayer appends a token with torch.cat, copying the whole layer cache every step: at batch 128
    and a few hundred tokens that moves ~1 GB per decode step on SmolLM2-135M. Here a step writes its
    token in place; a full buffer doubles (amortised O(1) copies per token)."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self.key_buffer = self.value_buffer = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self.key_buffer = self._grown(self.key_buffer, key_states, end)
            self.value_buffer = self._grown(self.value_buffer, value_states, end)
        self.key_buffer[..., self.length:end, :] = key_states
        self.value_buffer[..., self.length:end, :] = value_states
        self.length = end
        return self._views()

    def _grown(self, buffer: Tensor | None, new: Tensor, needed: int) -> Tensor:
        room = max(needed + GROWTH, 2 * (0 if buffer is None else buffer.shape[-2]))
        grown = new.new_empty(*new.shape[:-2], room, new.shape[-1])  # [B, H, room, D]
        if buffer is not None:
            grown[..., :self.length, :] = buffer[..., :self.length, :]
        return grown

    def _views(self) -> tuple[Tensor, Tensor]:
        self.keys = self.key_buffer[..., :self.length, :]
        self.values = self.value_buffer[..., :self.length, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized and self.length:  # copy what is written (+ GROWTH of room), not the spare room
            room = min(self.key_buffer.shape[-2], self.length + GROWTH)
            self.key_buffer = self.key_buffer[..., :room, :].index_select(0, indices)
            self.value_buffer = self.value_buffer[..., :room, :].index_select(0, indices)
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self.length:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._views()


def first_rows(prompts: list[list[int]]) -> Tensor:
    """[B] for each row, the first row with the same prompt (itself where it is the first): rows that share a
    prompt (candidates shown the same examples) are prefilled once and sample on their own."""
    first = {}
    return torch.tensor([first.setdefault(tuple(p), b) for b, p in enumerate(prompts)], dtype=torch.long)


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares and feeds once (0 where that saves less than a forward
    costs); each row keeps at least its last token, whose logits it needs."""
    shortest = min(map(len, prompts))
    ids = torch.tensor([p[:shortest] for p in prompts])  # [B, shortest]
    same = (ids == ids[:1]).all(0)  # [shortest]
    n = min(int(same.long().cumprod(0).sum()), shortest - 1)
    return n if (len(prompts) - 1) * n > FORWARD_COST else 0


def prefill_groups(lengths: Tensor) -> list[Tensor]:
    """Rows grouped by length [B] so that their prefill pads least: each group is padded to its own longest,
    and each forward costs FORWARD_COST tokens more. Exact (dynamic programming over the sorted lengths).
    -> row indices per group."""
    order = lengths.argsort()
    ranked = lengths[order].double()  # [B] ascending
    n = len(ranked)
    best = torch.zeros(n + 1, dtype=torch.double)  # best[j]: cost of the j shortest rows
    cut = torch.zeros(n + 1, dtype=torch.long)  # where the last group of those j rows starts
    for j in range(1, n + 1):  # a group i..j-1 pads to ranked[j - 1]
        starts = torch.arange(j)
        costs = best[:j] + (j - starts) * ranked[j - 1] + FORWARD_COST
        cut[j] = int(costs.argmin())
        best[j] = costs[cut[j]]
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = int(cut[j])
    return groups[::-1]


class _Decoder:
    def __init__(self, model, prompts, max_new, stop_ids, pad_id, temperature, top_p, generator, tap):
        self.model, self.prompts, self.max_new, self.tap = model, prompts, max_new, tap
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.device = next(model.parameters()).device
        self.stop = torch.tensor(stop_ids or [-1], dtype=torch.long)
        B = len(prompts)
        self.lens = torch.tensor([len(p) for p in prompts])  # [B]
        width = int(self.lens.max())
        self.ids = torch.full((B, width), pad_id, dtype=torch.long)  # left-padded prompts
        for b, p in enumerate(prompts):  # once per call, not per token
            self.ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        self.mask = (torch.arange(width) >= width - self.lens[:, None]).long()  # [B, width]
        self.cache = growing_cache()
        self.alive = torch.arange(B)  # original row of each batch row
        self.fed = self.lens.clone()  # [B] tokens fed so far = next position
        self.out = torch.full((B, max_new), -1, dtype=torch.long)
        self.count = torch.zeros(B, dtype=torch.long)
        self.stopped = torch.zeros(B, dtype=torch.bool)  # generation over (tail may still be fed)
        self.finished = torch.zeros(B, dtype=torch.bool)
        self.tail = torch.full((B, MAX_TAIL), pad_id, dtype=torch.long)  # tokens to teacher-force
        self.tail_len = torch.zeros(B, dtype=torch.long)
        self.tail_fed = torch.zeros(B, dtype=torch.long)
        self.wanted: dict[int, list[int]] = {}  # row -> its training ids, while its tail is fed
        self.done = torch.zeros(B, dtype=torch.bool)  # complete and handed over; may still ride in the batch
        self.captured = 0
        self.dump = width + max_new + MAX_TAIL  # where the states of pads and done rows go: never captured
        if tap:
            h = model.config.hidden_size
            dtype = next(model.parameters()).dtype
            self.hidden = {i: torch.zeros(B, self.dump + 1, h, dtype=dtype) for i in tap.layers}

    def run(self) -> Decoded:
        logits = self.prefill()
        while True:
            new = self.pick(logits)  # [A]
            self.emit(new)
            keep = self.retire()
            if not len(self.alive):
                break
            logits = self.step(new[keep])
        tokens = [self.out[b, :int(n)].tolist() for b, n in enumerate(self.count)]
        return Decoded(tokens, self.finished.tolist(), self.captured)

    def forward(self, ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        """Feed ids [A, Q] at positions [A, Q]; keep the tap's hidden states at sequence positions `slots`
        [A, Q]; -> last logits [A, V]."""
        out = self.model(input_ids=ids.to(self.device), attention_mask=self.mask.to(self.device),
                         position_ids=positions.to(self.device), cache=self.cache, use_cache=True,
                         output_hidden_states=self.tap is not None, logits_to_keep=1)
        self.keep_states(out, self.alive[:, None], slots)
        return out.logits[:, -1].float()

    def keep_states(self, out, rows: Tensor, slots: Tensor) -> None:
        """The tap's hidden states of positions [A, Q] into rows [A, 1] at sequence positions slots [A, Q]."""
        if self.tap:
            for i in self.tap.layers:
                self.hidden[i][rows, slots] = out.hidden_states[i].to(self.hidden[i].dtype).cpu()

    def prefill(self) -> Tensor:
        """Feed every distinct prompt once; -> each row's last logits [B, V]."""
        first = first_rows(self.prompts)  # [B] the row whose prefill each row shares
        fed_itself = first == torch.arange(len(first))  # [B]
        distinct = fed_itself.nonzero().squeeze(1)  # [U]
        shared = shared_prefix([self.prompts[u] for u in distinct])
        own = self.lens - shared  # [B] tokens of each prompt after the shared prefix
        groups = [distinct[g] for g in prefill_groups(own[distinct])]
        if shared == 0 and len(groups) == 1 and len(distinct) == len(first):  # one left-padded forward saves as much
            positions = (self.mask.cumsum(1) - 1).clamp(min=0)  # [B, width]; left pads at 0
            slots = torch.where(self.mask.bool(), positions, self.dump)
            return self.forward(self.ids, positions, slots)
        width = self.ids.shape[1]
        cols = torch.arange(width)
        self.mask = ((cols < shared) | (cols >= width - own[:, None])).long()  # [B, width] prefix, pads, own
        prefix = self.prefill_prefix(shared)
        logits = None
        slot = torch.empty(len(first), dtype=torch.long)  # a fed row's place in its group
        for rows in groups:
            w = int(own[rows].max())
            group_cache, group_logits = self.prefill_group(rows, own[rows], w, shared, prefix)
            if logits is None:
                logits = group_logits.new_empty(len(self.prompts), group_logits.shape[-1])
                self.start_cache(group_cache, width)
            slot[rows] = torch.arange(len(rows))
            members = torch.isin(first, rows).nonzero().squeeze(1)  # [M] the rows that share these prompts
            src = slot[first[members]]  # [M] where each one's prompt sits in the group
            logits[members.to(logits.device)] = group_logits[src.to(logits.device)]
            for main, layer in zip(self.cache.layers, group_cache.layers):  # the group's own tokens, right-aligned
                at, of = members.to(main.keys.device), src.to(main.keys.device)
                main.keys[at, :, width - w:] = layer.keys[of, :, shared:]
                main.values[at, :, width - w:] = layer.values[of, :, shared:]
        for main, (k, v) in zip(self.cache.layers, prefix):
            main.keys[:, :, :shared], main.values[:, :, :shared] = k, v
        copies = (~fed_itself).nonzero().squeeze(1)
        if self.tap and len(copies):  # the prompt states of a row that shared another's prefill
            for i in self.tap.layers:
                self.hidden[i][copies] = self.hidden[i][first[copies]]
        return logits

    def start_cache(self, like: Cache, width: int) -> None:
        """The batch's cache: per layer, keys and values [B, Hkv, width, D] of zeros (masked until written)."""
        for i, layer in enumerate(like.layers):
            zeros = layer.keys.new_zeros(len(self.prompts), layer.keys.shape[1], width, layer.keys.shape[-1])
            self.cache.update(zeros, zeros, i)

    def prefill_prefix(self, shared: int) -> list[tuple[Tensor, Tensor]]:
        """Feed the shared prefix once (one row); -> its keys and values [1, Hkv, shared, D] per layer."""
        if not shared:
            return []
        cache = growing_cache()
        ids = torch.tensor([self.prompts[0][:shared]], device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=self.tap is not None,
                         logits_to_keep=1)
        if self.tap:  # every row's states at the prefix positions
            for i in self.tap.layers:
                self.hidden[i][:, :shared] = out.hidden_states[i][0].to(self.hidden[i].dtype).cpu()
        return [(layer.keys, layer.values) for layer in cache.layers]

    def prefill_group(self, rows: Tensor, own: Tensor, w: int, shared: int, prefix):
        """Feed rows' own tokens [b, w] (left-padded to the group's longest) after the shared prefix;
        -> (the group's cache, its last logits [b, V])."""
        cache = growing_cache()
        for i, (k, v) in enumerate(prefix):
            cache.update(k.expand(len(rows), -1, -1, -1), v.expand(len(rows), -1, -1, -1), i)
        own_mask = (torch.arange(w) >= w - own[:, None]).long()  # [b, w]
        positions = shared + (own_mask.cumsum(1) - 1).clamp(min=0)
        mask = torch.cat([torch.ones(len(rows), shared, dtype=torch.long), own_mask], 1)  # [b, shared + w]
        out = self.model(input_ids=self.ids[rows, -w:].to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), cache=cache, use_cache=True,
                         output_hidden_states=self.tap is not None, logits_to_keep=1)
        self.keep_states(out, rows[:, None], torch.where(own_mask.bool(), positions, self.dump))
        return cache, out.logits[:, -1].float()

    def step(self, new: Tensor) -> Tensor:
        """Feed each live row its next token: the one just generated, or the next teacher-forced one."""
        a = self.alive
        forced = self.stopped[a]
        feed = torch.where(forced, self.tail[a, self.tail_fed[a].clamp(max=MAX_TAIL - 1)], new)  # [A]
        self.tail_fed[a] += forced.long()
        self.mask = torch.cat([self.mask, torch.ones(len(a), 1, dtype=torch.long)], 1)
        slots = torch.where(self.done[a], self.dump, self.fed[a])  # [A]
        logits = self.forward(feed[:, None], self.fed[a][:, None], slots[:, None])
        self.fed[a] += 1
        return logits

    def pick(self, logits: Tensor) -> Tensor:  # [A, V] -> [A]
        if self.temperature == 0:
            return argmax(logits).cpu()

        return sample(warp_probs(logits, self.temperature, None, self.top_p), self.generator).cpu()

    def emit(self, new: Tensor) -> None:
        """Append new tokens to the rows still generating; stop rows at a stop token or the limit."""
        a = self.alive
        live = ~self.stopped[a]
        rows = a[live]
        self.out[rows, self.count[rows]] = new[live]
        self.count[rows] += 1
        is_stop = torch.isin(new[live], self.stop)
        self.finished[rows] |= is_stop
        now = rows[is_stop | (self.count[rows] >= self.max_new)]
        self.stopped[now] = True
        if self.tap:
            for b in now.tolist():  # once per row, when it stops
                self.plan_tail(b)

    def plan_tail(self, b: int) -> None:
        """Ask the tap for row b's training ids; queue the ones not fed yet (or give up on capturing it)."""
        gen = self.out[b, :int(self.count[b])].tolist()
        want = self.tap.training_ids(b, gen, bool(self.finished[b]))
        fed = int(self.fed[b])
        if want is None or want[:fed] != (self.prompts[b] + gen)[:min(fed, len(want))] \
                or len(want) - fed > MAX_TAIL:
            return
        rest = want[fed:]
        self.tail[b, :len(rest)] = torch.tensor(rest, dtype=torch.long)
        self.tail_len[b] = len(rest)
        self.wanted[b] = want

    def retire(self) -> Tensor:
        """Hand the rows that became complete (stopped and their tail fed) to the tap; drop the complete rows
        from the batch once they are COMPACT_AT of it, or all of it. -> the batch rows kept [A']."""
        a = self.alive
        complete = self.stopped[a] & (self.tail_fed[a] >= self.tail_len[a])  # [A]
        for b in a[complete & ~self.done[a]].tolist():
            want = self.wanted.pop(b, None)
            if want is not None:
                n = len(want)
                self.tap.done(b, torch.tensor(want), {i: h[b, :n].clone() for i, h in self.hidden.items()})
                self.captured += 1
            self.done[b] = True
        if int(complete.sum()) < max(1.0, COMPACT_AT * len(a)) and not bool(complete.all()):
            return torch.arange(len(a))
        keep = (~complete).nonzero()[:, 0]
        self.alive, self.mask = a[keep], self.mask[keep]
        if len(keep):
            self.cache.batch_select_indices(keep.to(self.device))
        return keep
