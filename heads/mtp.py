"""DeepSeek-V3 multi-token prediction (MTP): D sequential modules.

Module k (1..D) at position i reads h^{k-1}_i and the token x_{i+k}:
    h^k_i = block_k(eh_proj_k(cat(enorm_k(embed(x_{i+k})), hnorm_k(h^{k-1}_i))))
and its shared head (norm_k + the target's frozen LM head) predicts x_{i+k+1}. h^0 is the target's last
hidden state *after* its final norm (`hidden_states[N]`): that is what transformers exposes and what vLLM and
SGLang feed their MTP layers (hnorm renormalises it either way). Loss: CE to the data token at each depth,
averaged over depths (or weighted by `loss_weights`).

Attention mask: module k at position i sees its own entries at positions <= i - (k - 1) and itself. Those
are exactly the entries computable from committed tokens when module k drafts depth k from anchor i, so
KV-cached drafting equals the training forward (DeepSeek's plain causal mask would need the entries in
between, which depend on draft tokens: a triangle of recomputation per depth). For k = 1 it is the causal
mask.

Inference: draft_begin runs every module on the newly committed entries (module k lags k - 1 positions
behind and keeps its own context KV); draft_expand at depth d runs module d + 1 at the anchor position
m - 1 on each node's parent output, so tree nodes never attend to each other. max_draft_depth = D.

Parameter names: `layers.{k}.{enorm, hnorm, eh_proj, shared_head.norm, mtp_block.*}` (k from 0), the module
tree of vLLM's DeepSeekMultiTokenPredictorLayer; `shared_head.head` is the target's LM head (not saved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headway.heads.base import DraftHead, HeadError, TargetFeatures, register_head
from headway.heads.layers import (INIT_LAYER, ContextKV, JoinKV, attend_mask, chain_accuracy, context_begin,
                          copy_target_layer, head_loss, labels_at_depth, last_valid, masked_mean,
                          new_decoder_layer, new_rms_norm, positive_int, require, resolve_options, rotary,
                          scatter_rows, self_mask, shift_left, valid_slots)
from headway.heads.sampling import argmax  # torch.argmax's first-max index, ~6x faster on bf16 rows

DEFAULTS = dict(num_modules=3, loss_weights=None, train_vocab=None, init_layer="random")


class MTPModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.mtp_block = new_decoder_layer(config)
        self.enorm = new_rms_norm(self.mtp_block, config)
        self.hnorm = new_rms_norm(self.mtp_block, config)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = new_rms_norm(self.mtp_block, config)


@dataclass
class MTPState:
    contexts: list[ContextKV]  # per module: its entries at committed positions <= m - k
    carry: list[Tensor | None]  # per module: its output at its newest committed position (next module's input)
    last_pos: Tensor | None = None  # [B] m - 1


@register_head("mtp")
class MTPHead(DraftHead):
    def __init__(self, target_config, **options):
        opts = resolve_options("mtp", DEFAULTS, options, {"init_layer": INIT_LAYER})
        positive_int("mtp", opts, "num_modules")
        D, weights = opts["num_modules"], opts["loss_weights"]
        require(weights is None or len(weights) == D,
                f"head 'mtp': loss_weights needs {D} values (one per module), got {weights}")
        super().__init__(target_config, **opts)
        self.layers = nn.ModuleList(MTPModule(target_config) for _ in range(D))

    def init_from_target(self) -> None:
        with torch.no_grad():
            for module in self.layers:
                module.shared_head.norm.weight.copy_(self.frozen["norm"].weight)
                if self.options["init_layer"] == "last":
                    copy_target_layer(module.mtp_block, self.frozen["last_layer"])

    @property
    def num_depths(self) -> int:
        return len(self.layers)

    def step(self, k: int):
        """Module k (0-based) as `step(emb, hidden, positions, kv, mask) -> h^{k+1}` [B, n, h]."""
        module = self.layers[k]

        def run(emb: Tensor, hidden: Tensor, positions: Tensor, kv, mask) -> Tensor:
            x = module.eh_proj(torch.cat([module.enorm(emb), module.hnorm(hidden)], -1))
            return module.mtp_block(x, attention_mask=mask, position_embeddings=rotary(self.frozen, x, positions),
                                    cache=kv)

        return run

    def draft_level_params(self) -> int:  # one MTP module and the shared LM head rows per depth
        h, V = self.target_config.hidden_size, self.target_config.vocab_size
        return sum(p.numel() for p in self.layers[0].parameters()) + self.readout_rows(V) * h

    def logits(self, k: int, out: Tensor) -> Tensor:  # [..., h] -> [..., V]
        return self.readout(self.layers[k].shared_head.norm(out), self.frozen["lm_head"])

    def anchor_logits(self, input_ids: Tensor, feats: TargetFeatures) -> list[Tensor]:
        """Teacher-forced drafts: [d-1] = logits [B, T, V] of the depth-d draft (module d at anchor c)."""
        return [self.logits(k, out) for k, out in enumerate(self.anchor_outputs(input_ids, feats))]

    def anchor_outputs(self, input_ids: Tensor, feats: TargetFeatures) -> list[Tensor]:
        """[d-1] = module d's output h^d [B, T, h] at each anchor (teacher-forced tokens)."""
        B, T = input_ids.shape
        pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
        everyone = torch.ones_like(pos, dtype=torch.bool)
        hidden, outs = feats.last_hidden, []
        for k in range(self.num_depths):
            mask = attend_mask(pos, pos, everyone, gap=k) | self_mask(T, pos.device)
            hidden = self.step(k)(self.embed(shift_left(input_ids, k + 1)), hidden, pos, JoinKV(), mask)
            outs.append(hidden)
        return outs

    # ----------------------------------------------------------------------------------- training
    def forward(self, input_ids: Tensor, loss_mask: Tensor, feats: TargetFeatures):
        weights = self.options["loss_weights"] or [1.0 / self.num_depths] * self.num_depths
        loss, preds, metrics = 0.0, [], {}
        for k, out in enumerate(self.anchor_outputs(input_ids, feats)):  # i -> x_{i+k+2}
            labels, scored = labels_at_depth(input_ids, loss_mask, k + 1)  # [B, T]
            # read out only where the label is learnt: a prompt or padding position is never scored
            readout_input = self.layers[k].shared_head.norm(out[scored])  # [n, h]
            logits = self.train_readout(readout_input, self.frozen["lm_head"])  # [n, Vt]
            compact = self.train_labels(labels[scored])  # [n], -100 outside the training vocabulary: no loss there
            ce = F.cross_entropy(logits.float(), compact, reduction="none")
            depth_loss = masked_mean(ce, compact >= 0)
            loss = loss + weights[k] * depth_loss
            metrics[f"loss_depth{k + 1}"] = depth_loss.detach()
            preds.append(scatter_rows(scored, self.train_token_ids(argmax(logits.detach()))))
        correct, count = chain_accuracy(preds, input_ids, loss_mask)
        return head_loss(loss, correct, count, **metrics)

    # ---------------------------------------------------------------------------------- inference
    def draft_state(self, batch_size: int, max_len: int) -> MTPState:
        D = self.num_depths
        return MTPState([ContextKV(batch_size, max_len) for _ in range(D)], [None] * D)

    def draft_begin(self, state: MTPState, tokens, feats: TargetFeatures, positions, num_valid):
        valid = valid_slots(num_valid, tokens.shape[1])
        emb = self.embed(tokens)  # slot i holds x_{p+k+1} for module k at its position p = pos_i - k
        hidden, first, previous = feats.last_hidden, None, list(state.carry)
        for k in range(self.num_depths):
            pos_k = positions - k  # module k lags k positions: it needs the token k further on
            valid_k = valid & (pos_k >= 0)
            if k > 0:  # module k at p reads module k-1's output at p: one slot back (or last round's newest)
                hidden = torch.cat([self.carried(previous[k - 1], hidden), hidden[:, :-1]], 1)
            hidden = context_begin(state.contexts[k], self.step(k), emb, hidden, pos_k, valid_k, gap=k)
            has_new = last_valid(valid_k, num_valid)[:, None]  # [B, 1]
            newest = last_valid(hidden, num_valid)
            state.carry[k] = newest if state.carry[k] is None else torch.where(has_new, newest, state.carry[k])
            first = hidden if k == 0 else first
        state.last_pos = last_valid(positions, num_valid)
        root = last_valid(first, num_valid)  # h^1_{m-1}
        return self.logits(0, root), root

    @staticmethod
    def carried(carry: Tensor | None, like: Tensor) -> Tensor:  # [B, 1, h]
        return like.new_zeros(like.shape[0], 1, like.shape[2]) if carry is None else carry[:, None]

    def draft_expand(self, state: MTPState, depth: int, tokens, parent_hidden, parents, positions):
        if depth >= self.num_depths:
            raise HeadError(f"mtp has {self.num_depths} modules: it cannot draft beyond depth {self.num_depths}")
        q_pos = state.last_pos[:, None].expand_as(tokens)  # module depth+1 runs at the anchor m - 1
        ctx = state.contexts[depth].view()
        mask = self_mask(tokens.shape[1], tokens.device).expand(tokens.shape[0], -1, -1, -1)
        prefix = None
        if ctx is not None:
            mask = torch.cat([attend_mask(q_pos, ctx[2], ctx[3], gap=depth), mask], -1)
            prefix = (ctx[0], ctx[1])
        out = self.step(depth)(self.embed(tokens), parent_hidden, q_pos, JoinKV(prefix), mask)
        return self.logits(depth, out), out

    def draft_end(self, state: MTPState) -> None:
        pass  # tree nodes are never stored: each depth is a different module
