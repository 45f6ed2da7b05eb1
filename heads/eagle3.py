"""EAGLE-3 (Li et al. 2025): fused multi-layer features, a reduced draft vocabulary, training-time test.

g_t = fc(cat(hidden_states[a] for a in aux_layers)) fuses a low, a middle and a high layer of the target
(`aux_layers` are hidden_states indices, i.e. the *inputs* of those decoder layers; default
[2, N//2, N-3] sorted, as EAGLE-3's code and vLLM's `eagle_aux_hidden_state_layer_ids` count them). One
decoder layer (`midlayer`) attends over cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t)) (q/k/v read
2h) with g_t as the residual; its output o_t (pre-norm) is the next step's hidden, and lm_head(norm(o_t))
gives logits over the draft vocabulary for x_{t+2}.

Draft vocabulary: the `draft_vocab_size` most frequent loss-masked training tokens (ties: lower id first),
chosen by `init_from_data(token_counts)`; stored as buffers `d2t` (int64 [Vd], target_id = draft_id +
d2t[draft_id], ids ascending) and `t2d` (bool [V]). Without data it is the first Vd ids. `lm_head` starts
from the target's rows for the draft vocabulary and `norm` from the target's final norm. Inference hooks
return logits over the *target* vocabulary (-inf outside the draft vocabulary).

Training-time test: the drafter is unrolled `ttt_steps` times on its own outputs (step j at position t reads
the output of step j-1 at t-1 and sees the true context up to its anchor plus its chain ancestors: exactly
what tree drafting sees), loss = sum_j step_decay^j x soft CE to the target's distribution restricted to the
draft vocabulary (renormalised; reported as KL) over the drafts a tree could reach (`reach_top_k` > 0, GRIFFIN's
loss mask: step j is scored only where each earlier draft of its chain held the true token in its top
`reach_top_k`; 0: every draft), plus top_k_weight x the soft CE over the target's `top_k` most
probable tokens (HASS; 0: off), plus feature_weight x SmoothL1 between what lm_head reads and the target's
final-normed hidden state it should match (EAGLE-1's feature regression; 0: off). `target_temperature`
divides the target's logits in the token losses (< 1 sharpens toward the argmax). `noise` adds EAGLE's uniform
noise U(-noise/2, noise/2) to the (normed) aux states while training (0: off). Anchors use 3 to 7 steps; 3
keeps CPU runs cheap. The per-step (chain-conditional) accuracies are the depth accuracies; eval mode
unrolls max(ttt_steps, eval_depths) steps.

Three optional norms (the "EAGLE 3.1" variants that speculators trains by default and vLLM serves, each a
config key of the same name): `norm_before_fc` adds `input_norm`, an RMSNorm over the concatenated aux
states [A*h] before fc (the target's layers differ in scale by orders of magnitude); `norm_before_residual`
makes hidden_norm(g) rather than g the residual; `norm_output` feeds norm(o_t) (not o_t) to the next step, so
lm_head reads it directly.

`train_lm_head=false` keeps `lm_head` at the target's rows (frozen), as speculators trains it.

`num_layers` > 1 stacks standard decoder layers `layers.{1..}` on top of `midlayer` (the target's class, attending
over their own keys under the same mask), as vLLM's EAGLE-3 drafter does for `num_hidden_layers` > 1: midlayer's
output o_t goes through them before `norm`; `init_layer=last` starts `midlayer` only.

Parameter names follow the EAGLE-3 serving layout: `fc`, `midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm, self_attn.*, mlp.*}`, `layers.{i}.*` (i >= 1, num_layers > 1), `norm`, `lm_head`, `d2t`,
`t2d` (no embedding).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from headway.heads.base import DraftHead, TargetFeatures, check_layer_ids, most_frequent, register_head
from headway.heads.layers import (INIT_LAYER, OneLayerDrafting, TargetDistribution, chain_reachable,
                                  copy_target_layer, feature_regression, head_loss, in_top_k, learnt_queries,
                                  masked_mean, new_decoder_layer, new_rms_norm, positive_int, require,
                                  resolve_options, rotary, scatter_rows, shift_left, top_k_cross_entropy,
                                  unrolled_accuracy)
from headway.heads.sampling import argmax  # torch.argmax's first-max index, ~6x faster on bf16 rows

DEFAULTS = dict(aux_layers=None, draft_vocab_size=32000, ttt_steps=3, step_decay=0.8, eval_depths=4,
                num_layers=1, init_layer="random", norm_before_fc=False, norm_before_residual=False, norm_output=False,
                train_lm_head=True, top_k_weight=0.0, top_k=10, feature_weight=0.0, noise=0.0,
                target_temperature=1.0, reach_top_k=0)
FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output", "train_lm_head")


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high choice; on very shallow targets (tests) it would repeat a layer, which no
    serving engine can capture, so spread three distinct layer inputs over [1, N-1] instead."""
    if num_layers >= 8:
        return [2, num_layers // 2, num_layers - 3]
    return [1, max(num_layers // 2, 1), max(num_layers - 1, 1)] if num_layers >= 4 else [num_layers - 1] * 1


@register_head("eagle3")
class Eagle3Head(OneLayerDrafting, DraftHead):
    own_draft_vocab = True  # drafts never leave it; by default they use all of it (infer.drafters.build_drafter)

    def __init__(self, target_config, **options):
        opts = resolve_options("eagle3", DEFAULTS, options, {"init_layer": INIT_LAYER})
        positive_int("eagle3", opts, "draft_vocab_size", "ttt_steps", "eval_depths", "top_k", "num_layers")
        require(isinstance(opts["reach_top_k"], int) and not isinstance(opts["reach_top_k"], bool)
                and opts["reach_top_k"] >= 0,
                f"head 'eagle3': reach_top_k must be an integer >= 0 (0: off), got {opts['reach_top_k']!r}")
        for weight in ("top_k_weight", "feature_weight", "noise"):
            require(opts[weight] >= 0, f"head 'eagle3': {weight} must be >= 0, got {opts[weight]}")
        require(opts["target_temperature"] > 0,
                f"head 'eagle3': target_temperature must be > 0, got {opts['target_temperature']}")
        for flag in FLAGS:
            require(isinstance(opts[flag], bool), f"head 'eagle3': {flag} must be true or false, got {opts[flag]!r}")
        N, h, V = target_config.num_hidden_layers, target_config.hidden_size, target_config.vocab_size
        aux = opts["aux_layers"]
        aux = default_aux_layers(N) if aux is None else [int(i) for i in aux]
        require(len(aux) >= 1, "head 'eagle3': aux_layers must name at least one hidden-state index")
        check_layer_ids(aux, N)
        super().__init__(target_config, **opts)
        self.aux_layers = aux
        self.draft_vocab_size = min(opts["draft_vocab_size"], V)

        self.fc = nn.Linear(len(aux) * h, h, bias=False)
        self.midlayer = new_decoder_layer(target_config)
        self.midlayer.hidden_norm = new_rms_norm(self.midlayer, target_config)
        attn = self.midlayer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads cat(embedding, fused feature): 2h wide
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.norm = new_rms_norm(self.midlayer, target_config)
        if opts["norm_before_fc"]:  # made after the layers so the default head's random init is unchanged
            self.input_norm = new_rms_norm(self.midlayer, target_config, len(aux) * h)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        # frozen: the read-out stays the target's own rows, so the drafter must land in the target's
        # final-hidden space (speculators trains it so)
        self.lm_head.weight.requires_grad_(opts["train_lm_head"])
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(V) < self.draft_vocab_size)
        # decoder layers 1.. (vLLM's `layers.{i}`): standard layers over the stream midlayer leaves, made last so
        # that a one-layer head's random initialisation is what it always was
        self.layers = nn.ModuleDict({str(i): new_decoder_layer(target_config, layer_idx=i)
                                     for i in range(1, opts["num_layers"])})

    # ------------------------------------------------------------------------- draft vocabulary
    @property
    def draft_ids(self) -> Tensor:  # [Vd] target id of each draft id
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    @property
    def train_ids(self) -> Tensor:  # the read-out is trained over the draft vocabulary itself
        return self.draft_ids

    def init_from_target(self) -> None:
        with torch.no_grad():
            self.lm_head.weight.copy_(self.frozen["lm_head"].weight[self.draft_ids])
            self.norm.weight.copy_(self.frozen["norm"].weight)
        if self.options["init_layer"] == "last":
            copy_target_layer(self.midlayer, self.frozen["last_layer"])

    def init_from_data(self, token_counts: Tensor) -> None:
        """Keep the Vd most frequent target tokens (ties: lower id first) as the draft vocabulary."""
        V = self.target_config.vocab_size
        require(token_counts.shape == (V,), f"token_counts must have shape [{V}], got {tuple(token_counts.shape)}")
        ids = most_frequent(token_counts, self.draft_vocab_size).to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(self.draft_vocab_size, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        if self.frozen:
            self.init_from_target()

    def draftable(self) -> Tensor:  # its own read-out scores the draft_vocab_size rows only
        return super().draftable() & self.t2d.cpu()

    def carry_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A saved EAGLE-3 state with another draft vocabulary, on this head's (chosen first, by
        init_from_data): a token both vocabularies hold keeps its trained read-out row. A token new here
        starts from the target's row carried into the trained read-out's space: training moves the rows
        away from the target's (cosine 0.67 after 8,000 steps on SmolLM2), so raw target rows give new
        tokens logits far off the trained ones (a 16,384-token vocabulary grown from 8,192 that way started
        at a KL of ~21 nats per step against ~0.8); the least-squares map from the target's rows to the
        trained ones over the shared tokens predicts held-out trained rows at cosine ~0.94."""
        saved_d2t = state["d2t"]
        saved_ids = torch.arange(len(saved_d2t)) + saved_d2t  # [Vs] target id of each saved row
        saved_row = torch.full((self.target_config.vocab_size,), -1, dtype=torch.long)
        saved_row[saved_ids] = torch.arange(len(saved_ids))
        source = saved_row[self.draft_ids.cpu()]  # [Vd] saved row of each draft token; -1: a new token
        kept = source >= 0
        target_rows = self.lm_head.weight.detach().cpu().float()  # [Vd, h] as init_from_target left them
        weight = target_rows.clone()
        weight[kept] = state["lm_head.weight"][source[kept]].float()
        if kept.sum() > weight.shape[1] and not kept.all():  # enough shared rows for a well-posed [h, h] fit
            to_trained = torch.linalg.lstsq(target_rows[kept], weight[kept]).solution
            weight[~kept] = target_rows[~kept] @ to_trained
        return {**state, "lm_head.weight": weight.to(state["lm_head.weight"].dtype),
                "d2t": self.d2t.cpu(), "t2d": self.t2d.cpu()}

    # ------------------------------------------------------------------------------------ network
    def feature_layers(self) -> list[int]:
        return sorted(set(self.aux_layers) | {self.target_config.num_hidden_layers})

    @property
    def num_depths(self) -> int:
        return max(self.options["ttt_steps"], self.options["eval_depths"])

    @property
    def max_draft_depth(self) -> int | None:
        return None

    def fuse(self, feats: TargetFeatures) -> Tensor:  # -> g [B, T, h]
        stacked = torch.cat([feats.hidden_states[i] for i in self.aux_layers], -1)  # [B, T, A*h]
        if self.options["norm_before_fc"]:
            stacked = self.input_norm(stacked)
        if self.training and self.options["noise"]:  # EAGLE's U(-noise/2, noise/2) on the input features
            stacked = stacked + (torch.rand_like(stacked) - 0.5) * self.options["noise"]
        return self.fc(stacked)

    def step(self, emb: Tensor, hidden: Tensor, positions: Tensor, kv, mask) -> Tensor:
        """(embed(x_{t+1}), hidden_t) -> o_t, the next step's hidden: pre-norm, or norm(o_t) with norm_output."""
        layer, o = self.midlayer, self.options
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(emb), normed], -1)  # [B, n, 2h]
        cos_sin = rotary(self.frozen, x, positions)
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=mask, cache=kv)
        h = (normed if o["norm_before_residual"] else hidden) + attn
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        for upper in self.layers.values():  # [B, n, h] -> [B, n, h], same mask, own keys in kv
            out = upper(out, attention_mask=mask, cache=kv, position_embeddings=cos_sin)
        return self.norm(out) if o["norm_output"] else out

    def readout_input(self, out: Tensor) -> Tensor:  # a step's output, normed once before lm_head
        return out if self.options["norm_output"] else self.norm(out)

    def draft_logits(self, out: Tensor) -> Tensor:  # [..., h] -> [..., Vd]
        return self.lm_head(self.readout_input(out))

    def begin_hidden(self, feats: TargetFeatures) -> Tensor:
        return self.fuse(feats)

    def draft_level_params(self) -> int:  # the decoder layers + the read-out rows (fc runs on commit only)
        h = self.target_config.hidden_size
        layers = sum(p.numel() for p in self.midlayer.parameters()) + sum(p.numel() for p in self.layers.parameters())
        return layers + self.readout_rows(self.draft_vocab_size, self.draft_ids) * h

    def vocab_logits(self, out: Tensor) -> Tensor:  # [..., h] -> [..., V] over the target vocabulary
        return self.readout(self.readout_input(out), self.lm_head, self.draft_ids)

    # ----------------------------------------------------------------------------------- training
    def forward(self, input_ids: Tensor, loss_mask: Tensor, feats: TargetFeatures):
        o = self.options
        trained = o["ttt_steps"]
        steps = trained if self.training else self.num_depths
        outs = self.unroll(input_ids, self.fuse(feats), steps)  # [B, T, h] per step, query t drafts x_{t+2}
        queries, at_next = learnt_queries(loss_mask)  # [B, T]: read out only where x_{t+2} is learnt
        # target's x_{t+2} logits [n, Vd] on the draft vocab, sharpened (< 1) or flattened (> 1) by
        # target_temperature
        t_next = self.target_train_logits(feats, at_next)
        target = TargetDistribution(t_next, o["target_temperature"])  # [n, Vd] once, shared by every step's loss
        # [n, h] what the target's lm_head reads for x_{t+2}; only the feature regression needs it
        f_next = feats.last_hidden[at_next] if o["feature_weight"] else None
        query_pos = queries.nonzero()[:, 1]  # [n]
        if o["reach_top_k"]:  # [n] x_{t+2} on the draft vocab (-100 outside): what a reachable draft must hold
            labels = self.train_labels(shift_left(input_ids, 2)[queries])
        loss, preds, hits, metrics = 0.0, [], [], {}
        for j, out in enumerate(outs):
            out = out[queries]  # [n, h]
            logits = self.draft_logits(out)  # [n, Vd]
            preds.append(scatter_rows(queries, self.train_token_ids(argmax(logits.detach()))))
            if j >= trained:
                continue
            scored = query_pos >= j  # [n]: the draft's anchor t - j is a real position
            if o["reach_top_k"]:  # GRIFFIN: no loss on drafts no top-k tree could reach
                if hits:
                    scored = scored & chain_reachable(hits)[queries]
                    metrics[f"reached_step{j}"] = scored.float().mean()
                if j + 1 < trained:  # what the next step's mask reads (the last step's hits would go unread)
                    hits.append(scatter_rows(queries, in_top_k(logits.detach(), labels, o["reach_top_k"]), fill=True))
            step_loss = masked_mean(target.kl(logits), scored)
            metrics[f"loss_step{j}"] = step_loss.detach()
            if o["top_k_weight"]:
                tempered = t_next.float() / o["target_temperature"]
                top_k_loss = masked_mean(top_k_cross_entropy(logits, tempered, o["top_k"]), scored)
                step_loss = step_loss + o["top_k_weight"] * top_k_loss
            if o["feature_weight"]:  # EAGLE-1's regression, on what lm_head reads: a dense signal per token
                feat_loss = masked_mean(feature_regression(self.readout_input(out), f_next), scored)
                metrics[f"feature_loss{j}"] = feat_loss.detach()
                step_loss = step_loss + o["feature_weight"] * feat_loss
            loss = loss + o["step_decay"] ** j * step_loss
        correct, count = unrolled_accuracy(preds, self.num_depths, input_ids, loss_mask)
        return head_loss(loss, correct, count, **metrics)

