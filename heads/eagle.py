"""EAGLE-1/2 (Li et al. 2024): autoregression at the feature level.

f_t is the target's final-normed last hidden state (`hidden_states[N]`, what its LM head reads). At position
t the head reads `fc(cat(embed(x_{t+1}), f_t))` (`fc` = Linear(2h, h), no bias) through one decoder layer
of the target's architecture whose input layernorm is dropped (as in EAGLE-1), predicts f_{t+1}, and the
frozen target LM head turns it into the distribution of x_{t+2}. Drafting deeper feeds the predicted
feature back in: `draft_expand` at depth d runs at position m - 1 + d on its parent's predicted feature.

Loss: feature_weight x SmoothL1(f^_{t+1}, f_{t+1}) + token_weight x soft CE to the target's distribution of
x_{t+2} (reported as KL: the soft CE minus the target's entropy), with uniform noise U(-noise/2, noise/2)
added to the input features while training (EAGLE's "std 0.2" uniform noise), plus top_k_weight x the soft
CE over the target's `top_k` most probable tokens (HASS; 0: off). `target_temperature` divides the target's
logits in the token losses (< 1 sharpens the distribution toward its argmax, what greedy verification
accepts). `ttt_steps` > 1 also trains on its own predicted features (EAGLE-3-style training-time test, step
weights step_decay^i); EAGLE-1 uses 1.

Depth accuracies: in eval mode the forward unrolls `eval_depths` steps open-loop on its own predicted
features (true tokens, so depth d is scored where depths < d were right: the chain's conditional
acceptance); in training mode only the `ttt_steps` trained steps are scored and deeper depths have count 0.

Parameter names follow vLLM/SGLang EAGLE-1: `fc.weight` [h, 2h], `layers.0.*` (no `input_layernorm`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from headway.heads.base import DraftHead, TargetFeatures, register_head
from headway.heads.layers import (INIT_LAYER, OneLayerDrafting, TargetDistribution, copy_target_layer,
                                  feature_regression, head_loss, learnt_queries, masked_mean, new_decoder_layer,
                                  positive_int, require, resolve_options, rotary, scatter_rows, top_k_cross_entropy,
                                  unrolled_accuracy)
from headway.heads.sampling import argmax  # torch.argmax's first-max index, ~6x faster on bf16 rows

DEFAULTS = dict(feature_weight=1.0, token_weight=0.1, noise=0.2, ttt_steps=1, step_decay=0.8, eval_depths=4,
                train_vocab=None, init_layer="random", top_k_weight=0.0, top_k=10, target_temperature=1.0)


@register_head("eagle")
class EagleHead(OneLayerDrafting, DraftHead):
    def __init__(self, target_config, **options):
        opts = resolve_options("eagle", DEFAULTS, options, {"init_layer": INIT_LAYER})
        positive_int("eagle", opts, "ttt_steps", "eval_depths", "top_k")
        require(opts["noise"] >= 0, f"head 'eagle': noise must be >= 0, got {opts['noise']}")
        require(opts["top_k_weight"] >= 0, f"head 'eagle': top_k_weight must be >= 0, got {opts['top_k_weight']}")
        require(opts["target_temperature"] > 0,
                f"head 'eagle': target_temperature must be > 0, got {opts['target_temperature']}")
        super().__init__(target_config, **opts)
        h = target_config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([new_decoder_layer(target_config)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: fc's output goes straight into attention

    def init_from_target(self) -> None:
        if self.options["init_layer"] == "last":
            copy_target_layer(self.layers[0], self.frozen["last_layer"])

    @property
    def num_depths(self) -> int:
        return max(self.options["ttt_steps"], self.options["eval_depths"])

    @property
    def max_draft_depth(self) -> int | None:
        return None  # feature autoregression drafts as deep as asked

    def step(self, emb: Tensor, feature: Tensor, positions: Tensor, kv, mask) -> Tensor:
        """(embed(x_{t+1}), f_t) at `positions` -> predicted f_{t+1}; all [B, n, h]."""
        x = self.fc(torch.cat([emb, feature], -1))
        return self.layers[0](x, attention_mask=mask, position_embeddings=rotary(self.frozen, x, positions),
                              cache=kv)

    def begin_hidden(self, feats: TargetFeatures) -> Tensor:
        return feats.last_hidden

    def vocab_logits(self, out: Tensor) -> Tensor:
        return self.readout(out, self.frozen["lm_head"])

    # ----------------------------------------------------------------------------------- training
    def forward(self, input_ids: Tensor, loss_mask: Tensor, feats: TargetFeatures):
        o = self.options
        f = feats.last_hidden  # [B, T, h]
        trained = o["ttt_steps"]
        steps = trained if self.training else self.num_depths
        noisy = f + (torch.rand_like(f) - 0.5) * o["noise"] if self.training and o["noise"] else f
        outs = self.unroll(input_ids, noisy, steps)  # [B, T, h] per step: query t predicts f_{t+1}
        queries, at_next = learnt_queries(loss_mask)  # [B, T]: read out only where x_{t+2} is learnt
        f_next = f[at_next]  # [n, h]
        # target's x_{t+2} logits [n, Vt], sharpened (< 1) or flattened (> 1) by target_temperature
        t_next = self.target_train_logits(feats, at_next)
        target = TargetDistribution(t_next, o["target_temperature"])  # [n, Vt] once, shared by every step's loss
        query_pos = queries.nonzero()[:, 1]  # [n]
        loss, preds, metrics = 0.0, [], {}
        for j, out in enumerate(outs):
            out = out[queries]  # [n, h]
            logits = self.train_readout(out, self.frozen["lm_head"])  # [n, Vt]
            preds.append(scatter_rows(queries, self.train_token_ids(argmax(logits.detach()))))
            if j >= trained:
                continue
            scored = query_pos >= j  # [n]: the draft's anchor t - j is a real position
            feat_loss = masked_mean(feature_regression(out, f_next), scored)
            token_loss = masked_mean(target.kl(logits), scored)
            step_loss = o["feature_weight"] * feat_loss + o["token_weight"] * token_loss
            if o["top_k_weight"]:
                tempered = t_next.float() / o["target_temperature"]
                top_k_loss = masked_mean(top_k_cross_entropy(logits, tempered, o["top_k"]), scored)
                step_loss = step_loss + o["top_k_weight"] * top_k_loss
            loss = loss + o["step_decay"] ** j * step_loss
            metrics[f"feature_loss{j}"], metrics[f"token_loss{j}"] = feat_loss.detach(), token_loss.detach()
        correct, count = unrolled_accuracy(preds, self.num_depths, input_ids, loss_mask)
        return head_loss(loss, correct, count, **metrics)
