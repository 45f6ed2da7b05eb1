"""The training vocabulary: heads that read out through a [V, h] matrix train over the `train_vocab` most
frequent training tokens only (the target's distribution renormalised there), at Vt/V of the cost."""

import pytest
import torch

from head_helpers import features, make_head
from headway.heads.layers import kl_to_target, masked_mean, shift_left

READOUT_KINDS = ["eagle", "medusa", "mtp"]


def counts_favouring(ids, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    counts[ids] = torch.arange(len(ids), 0, -1) + 10
    return counts


def loss_of(head, target, batch):
    head.train()
    return head(batch["input_ids"], batch["loss_mask"], features(head, target, batch))


@pytest.mark.parametrize("kind", READOUT_KINDS)
def test_a_training_vocabulary_as_large_as_the_target_vocabulary_changes_nothing(kind, target, batch):
    V = target.config.vocab_size
    counts = torch.randint(0, 50, (V,))
    whole = make_head(kind, target, train_vocab=None, **({"noise": 0.0} if kind == "eagle" else {}))
    capped = make_head(kind, target, train_vocab=V, **({"noise": 0.0} if kind == "eagle" else {}))
    for head in (whole, capped):
        head.init_from_data(counts)
    assert capped.train_ids is None
    torch.testing.assert_close(loss_of(capped, target, batch).loss, loss_of(whole, target, batch).loss,
                               rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_eagle_loss_is_the_renormalised_kl_on_the_kept_rows(target, batch, temperature):
    """Independent path: full-vocabulary logits of head and target, then keep the columns of the ids; the
    target's logits divided by target_temperature."""
    V = target.config.vocab_size
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:37]
    head = make_head("eagle", target, train_vocab=37, noise=0.0, feature_weight=0.0, token_weight=1.0,
                     ttt_steps=1, target_temperature=temperature)  # one step: the loss below is that step's
    head.init_from_data(counts_favouring(keep, V))
    assert torch.equal(head.train_ids, keep.sort().values)
    out = loss_of(head, target, batch)

    ids, mask = batch["input_ids"], batch["loss_mask"]
    feats = features(head, target, batch)
    with torch.no_grad():
        step1 = head.unroll(ids, feats.last_hidden, 1)[0]
        q = head.target_logits(step1)[..., head.train_ids]  # [B, T, Vt]
        p = shift_left(head.target_logits(feats.last_hidden)[..., head.train_ids], 1) / temperature
        expected = masked_mean(kl_to_target(q, p), shift_left(mask.bool(), 2, fill=False))
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", READOUT_KINDS)
def test_labels_outside_the_training_vocabulary_are_misses(kind, target, batch):
    """With only tokens that never occur as labels kept, no draft can be right, and the loss stays finite."""
    V = target.config.vocab_size
    labels = set(batch["input_ids"][batch["loss_mask"]].tolist())
    absent = torch.tensor([t for t in range(V) if t not in labels][:16])
    head = make_head(kind, target, train_vocab=16)
    head.init_from_data(counts_favouring(absent, V))
    out = loss_of(head, target, batch)
    assert torch.isfinite(out.loss)
    assert int(out.depth_count[0]) > 0 and int(out.depth_correct.sum()) == 0


def test_medusa_learns_only_the_rows_it_reads(target, batch):
    V = target.config.vocab_size
    keep = torch.arange(5, 45)
    head = make_head("medusa", target, train_vocab=40)
    head.init_from_data(counts_favouring(keep, V))
    loss_of(head, target, batch).loss.backward()
    grad = head.lm_heads[0].weight.grad  # [V, h]
    outside = torch.ones(V, dtype=torch.bool)
    outside[keep] = False
    assert grad[outside].abs().max() == 0
    assert grad[keep].abs().max() > 0


def test_labels_map_to_training_slots_and_back(target):
    V = target.config.vocab_size
    head = make_head("mtp", target, train_vocab=10)
    keep = torch.tensor([3, 7, 11, 50, 51, 52, 60, 61, 90, 99])
    head.init_from_data(counts_favouring(keep, V))
    labels = torch.tensor([[3, 4, 99, 0, 61]])
    slots = head.train_labels(labels)
    assert slots.tolist() == [[0, -100, 9, -100, 7]]
    assert head.train_token_ids(slots.clamp(min=0)).tolist() == [[3, 3, 99, 3, 61]]


@pytest.mark.parametrize("kind, layer", [("eagle", "layers.0"), ("mtp", "layers.1.mtp_block"),
                                         ("eagle3", "midlayer")])
def test_init_layer_last_starts_from_the_targets_last_decoder_layer(kind, layer, target):
    last = dict(target.model.model.layers[-1].named_parameters())
    head = make_head(kind, target, init_layer="last")
    own = {n: p for n, p in head.named_parameters() if n.startswith(layer + ".")}
    mlp = own[f"{layer}.mlp.down_proj.weight"]
    assert torch.equal(mlp, last["mlp.down_proj.weight"])
    q = own[f"{layer}.self_attn.q_proj.weight"]
    assert torch.equal(q[:, -last["self_attn.q_proj.weight"].shape[1]:], last["self_attn.q_proj.weight"])
    fresh = make_head(kind, target, init_layer="random")
    assert not torch.equal(dict(fresh.named_parameters())[f"{layer}.mlp.down_proj.weight"], mlp)


def test_top_k_cross_entropy_is_the_soft_ce_over_the_targets_top_k():
    from headway.heads.layers import top_k_cross_entropy

    torch.manual_seed(0)
    q, p = torch.randn(2, 3, 9), torch.randn(2, 3, 9)
    log_q, log_p = q.log_softmax(-1), p.log_softmax(-1)
    full = -(log_p.exp() * log_q).sum(-1)
    torch.testing.assert_close(top_k_cross_entropy(q, p, 9), full)  # k = V: the whole soft CE
    top = log_p.topk(2, -1)
    expected = -(top.values.exp() * log_q.gather(-1, top.indices)).sum(-1)
    torch.testing.assert_close(top_k_cross_entropy(q, p, 2), expected)  # only the target's two likeliest tokens
    p[0, 0] = float("-inf")  # no support in that row: adds 0, and no NaN
    q.requires_grad_(True)
    loss = top_k_cross_entropy(q, p, 2)
    assert loss[0, 0] == 0
    loss.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_top_k_weight_adds_the_top_k_loss(kind, target, batch):
    torch.manual_seed(0)
    plain = loss_of(make_head(kind, target, ttt_steps=1), target, batch)
    torch.manual_seed(0)
    weighted = loss_of(make_head(kind, target, ttt_steps=1, top_k_weight=1.0, top_k=4), target, batch)
    assert weighted.loss > plain.loss  # a soft CE is > 0, so the weighted loss is strictly larger


def test_eagle3_feature_weight_adds_the_feature_regression(target, batch):
    torch.manual_seed(0)
    plain = loss_of(make_head("eagle3", target, ttt_steps=1), target, batch)
    torch.manual_seed(0)
    weighted = loss_of(make_head("eagle3", target, ttt_steps=1, feature_weight=1.0), target, batch)
    assert "feature_loss0" not in plain.metrics and weighted.metrics["feature_loss0"] > 0
    torch.testing.assert_close(weighted.loss, plain.loss + weighted.metrics["feature_loss0"])


def test_eagle3_noise_changes_training_only(target, batch):
    head = make_head("eagle3", target, ttt_steps=1, noise=0.5)
    quiet = make_head("eagle3", target, ttt_steps=1)
    quiet.load_state_dict(head.state_dict())
    feats = features(head, target, batch)
    torch.manual_seed(0)
    noisy_loss = loss_of(head, target, batch).loss
    assert not torch.allclose(noisy_loss, loss_of(quiet, target, batch).loss)
    head.eval(), quiet.eval()
    with torch.no_grad():
        drafted = head(batch["input_ids"], batch["loss_mask"], feats)
        plain = quiet(batch["input_ids"], batch["loss_mask"], feats)
    torch.testing.assert_close(drafted.loss, plain.loss)  # inference never sees the noise


def test_a_frozen_readout_reads_its_training_rows_from_a_cache_that_follows_the_ids_and_autocast(target):
    """The frozen LM head's training rows are gathered once (not per step): the logits equal the gathered rows'
    exactly, in fp32 and under bf16 autocast, a new training vocabulary is read at once, and the gradient still
    reaches the head's hidden state."""
    V, h = target.config.vocab_size, target.config.hidden_size
    head = make_head("eagle", target, train_vocab=41)
    lm_head = head.frozen["lm_head"]
    hidden = torch.randn(6, h, requires_grad=True)
    for seed in (1, 2):  # a second init_from_data picks other ids
        head.init_from_data(torch.randint(0, 100, (V,), generator=torch.Generator().manual_seed(seed)))
        rows = lm_head.weight[head.train_ids]  # [Vt, h]
        torch.testing.assert_close(head.train_readout(hidden, lm_head), hidden @ rows.T, rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head.train_readout(hidden, lm_head)
            expected = hidden @ rows.T
        assert logits.dtype == torch.bfloat16
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    head.train_readout(hidden, lm_head).sum().backward()
    torch.testing.assert_close(hidden.grad, rows.sum(0).expand(6, -1), rtol=1e-5, atol=1e-5)
    assert lm_head.weight.grad is None
    head.train_ids.copy_(head.train_ids.flip(0))  # ids changed in place (as a loaded EAGLE-3 d2t is): same address
    torch.testing.assert_close(head.train_readout(hidden, lm_head).detach(), hidden.detach() @ rows.flip(0).T,
                               rtol=0, atol=0)
