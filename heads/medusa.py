"""Medusa (Cai et al. 2024): K heads on the target's last hidden state f_t; head k predicts x_{t+k+2}.

Head k = L separate residual blocks `x + SiLU(Linear(x))` (weights and biases zero-initialised, so a fresh
head reproduces the target's feature) and its own LM head, initialised from the target's. The target itself
predicts x_{t+1} from f_t, so at inference (features known up to m - 1, bonus token x_m committed) head k
drafts x_{m+k+1}: the tree's depth d uses head d - 1, whatever the path (Medusa trees are path independent).

Parameter names follow vLLM's MedusaModel: `blocks.{i}.layers.{j}.{weight,bias}`, `lm_heads.{i}.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headway.heads.base import DraftHead, HeadError, TargetFeatures, register_head
from headway.heads.layers import (chain_accuracy, head_loss, kl_to_target, labels_at_depth, last_valid, masked_mean,
                                  positive_int, resolve_options, scatter_rows)
from headway.heads.sampling import argmax  # torch.argmax's first-max index, ~6x faster on bf16 rows

DEFAULTS = dict(num_heads=4, num_layers=1, decay=0.8, loss="ce", train_vocab=None)
CHOICES = dict(loss=("ce", "kl"))


class ResidualStack(nn.Module):
    """L residual blocks x <- x + SiLU(W x + b), each with its own weights."""

    def __init__(self, hidden: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        for layer in self.layers:  # zero init: a fresh block is the identity
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


@dataclass
class MedusaState:
    feature: Tensor | None = None  # [B, h] the newest target feature f_{m-1}


@register_head("medusa")
class MedusaHead(DraftHead):
    def __init__(self, target_config, **options):
        opts = resolve_options("medusa", DEFAULTS, options, CHOICES)
        positive_int("medusa", opts, "num_heads", "num_layers")
        super().__init__(target_config, **opts)
        h, V = target_config.hidden_size, target_config.vocab_size
        self.blocks = nn.ModuleList(ResidualStack(h, opts["num_layers"]) for _ in range(opts["num_heads"]))
        self.lm_heads = nn.ModuleList(nn.Linear(h, V, bias=False) for _ in range(opts["num_heads"]))

    def init_from_target(self) -> None:
        with torch.no_grad():
            for lm_head in self.lm_heads:
                lm_head.weight.copy_(self.frozen["lm_head"].weight)

    @property
    def num_depths(self) -> int:
        return len(self.blocks)

    def draft_level_params(self) -> int:  # one residual stack and its own LM head rows per depth
        h, V = self.target_config.hidden_size, self.target_config.vocab_size
        return sum(p.numel() for p in self.blocks[0].parameters()) + self.readout_rows(V) * h

    def head_logits(self, k: int, feature: Tensor) -> Tensor:  # [..., h] -> [..., V]
        return self.readout(self.blocks[k](feature), self.lm_heads[k])

    def anchor_logits(self, input_ids: Tensor, feats: TargetFeatures) -> list[Tensor]:
        """Teacher-forced drafts: [d-1] = logits [B, T, V] of the depth-d draft from each anchor c."""
        return [self.head_logits(k, feats.last_hidden) for k in range(self.num_depths)]

    # ----------------------------------------------------------------------------------- training
    def forward(self, input_ids: Tensor, loss_mask: Tensor, feats: TargetFeatures):
        decay, kl = self.options["decay"], self.options["loss"] == "kl"
        # self-distillation: the target's distribution for x_{t+k+2} is its logits at position t+k+1
        target = self.target_train_logits(feats) if kl else None  # [B, T, Vt]
        loss, preds, per_head = 0.0, [], {}
        for k in range(self.num_depths):
            labels, scored = labels_at_depth(input_ids, loss_mask, k + 1)  # t -> x_{t+k+2}, [B, T]
            # read out only where the label is learnt: a prompt or padding position is never scored
            logits = self.train_readout(self.blocks[k](feats.last_hidden[scored]), self.lm_heads[k])  # [n, Vt]
            if kl:
                p_logits = torch.cat([target[:, k + 1:], target[:, -1:].expand(-1, k + 1, -1)], 1)[scored]
                per_pos = kl_to_target(logits, p_logits)  # [n]
                learnt = torch.ones_like(per_pos, dtype=torch.bool)
            else:
                compact = self.train_labels(labels[scored])  # [n], -100 outside the training vocabulary: no loss
                per_pos = F.cross_entropy(logits.float(), compact, reduction="none")
                learnt = compact >= 0
            head_k = masked_mean(per_pos, learnt)
            loss = loss + decay ** k * head_k
            per_head[f"loss_head{k}"] = head_k.detach()
            preds.append(scatter_rows(scored, self.train_token_ids(argmax(logits.detach()))))
        correct, count = chain_accuracy(preds, input_ids, loss_mask)
        return head_loss(loss, correct, count, **per_head)

    # ---------------------------------------------------------------------------------- inference
    def draft_state(self, batch_size: int, max_len: int) -> MedusaState:
        return MedusaState()

    def draft_begin(self, state: MedusaState, tokens, feats: TargetFeatures, positions, num_valid):
        state.feature = last_valid(feats.last_hidden, num_valid)  # [B, h]: only the newest feature matters
        return self.head_logits(0, state.feature), state.feature

    def draft_expand(self, state: MedusaState, depth: int, tokens, parent_hidden, parents, positions):
        if depth >= self.num_depths:
            raise HeadError(f"medusa has {self.num_depths} heads: it cannot draft beyond depth {self.num_depths}")
        logits = self.head_logits(depth, state.feature)  # [B, V]: the same for every node at this depth
        return logits[:, None].expand(-1, tokens.shape[1], -1), parent_hidden

    def draft_end(self, state: MedusaState) -> None:
        pass
