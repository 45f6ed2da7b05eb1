"""Helpers shared by the head tests: head YAML options, the fixed batch, target features."""

from pathlib import Path

import pytest
import torch
import yaml

from headway.heads.base import TargetFeatures, build_head, compute_features

CONF = Path(__file__).resolve().parents[2] / "conf" / "head"
KINDS = sorted(p.stem for p in CONF.glob("*.yaml"))  # every head config is tested
# every head config, and the option variants that change how a head drafts (kind, its YAML overrides)
VARIANTS = [pytest.param(kind, {}, id=kind) for kind in KINDS] + [
    pytest.param("eagle3", {"num_layers": 2}, id="eagle3-2layers")]

CONVERSATIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a primary color.", "Red is a primary color, and so are blue and yellow."),
    ("Say hello.", "Hello! How can I help you today?"),
    ("Count to five.", "One, two, three, four, five."),
]


def yaml_options(kind: str) -> dict:
    cfg = yaml.safe_load((CONF / f"{kind}.yaml").read_text())
    assert cfg["kind"] == kind
    return dict(cfg["options"] or {})


def make_head(kind: str, target, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_head(kind, target, **dict(yaml_options(kind), **overrides))


def chat_batch(tokenizer):
    """Right-padded ChatML conversations: input_ids/attention_mask [B, T], loss_mask on assistant tokens."""
    rows, masks = [], []
    for user, assistant in CONVERSATIONS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                               add_generation_prompt=True)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(assistant + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append(p_ids + a_ids)
        masks.append([False] * len(p_ids) + [True] * len(a_ids))
    T = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    loss_mask = torch.tensor([m + [False] * (T - len(m)) for m in masks])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def features(head, target, batch, with_logits=False):
    return compute_features(target.model, batch["input_ids"], batch["attention_mask"], head.feature_layers(),
                            with_logits=with_logits)


def gather_feats(feats: TargetFeatures, index: torch.Tensor) -> TargetFeatures:
    """Per-row time gather: feats at positions index [B, n]."""
    def take(x):
        return torch.gather(x, 1, index[:, :, None].expand(-1, -1, x.shape[-1]))
    return TargetFeatures({k: take(v) for k, v in feats.hidden_states.items()}, feats.num_layers)


def begin(head, state, input_ids, feats, start, stop):
    """Commit features at positions start..stop-1 (and tokens start+1..stop) for each row."""
    n = int((stop - start).max())
    pos = (start[:, None] + torch.arange(n)[None]).clamp(max=input_ids.shape[1] - 2)
    tokens = torch.gather(input_ids, 1, pos + 1)
    return head.draft_begin(state, tokens, gather_feats(feats, pos), pos, stop - start)


def chain(head, state, input_ids, root_hidden, m, depths):
    """Expand a one-node-per-depth chain along the true tokens x_{m+1}, x_{m+2}, ...; logits per depth."""
    out, hidden = [], root_hidden[:, None]
    for d in range(1, depths):
        tokens = torch.gather(input_ids, 1, (m + d)[:, None])  # x_{m+d}
        parents = torch.full_like(tokens, d - 2)  # the previous chain node (-1: the root)
        logits, hidden = head.draft_expand(state, d, tokens, hidden, parents, (m - 1 + d)[:, None])
        out.append(logits[:, 0])
    return out


def at_anchor(logits: torch.Tensor, m: torch.Tensor) -> torch.Tensor:  # [B, T, V] at anchor m-1 -> [B, V]
    return logits[torch.arange(logits.shape[0]), m - 1]


def check_cached_chain(head, target, batch, depths=3):
    """Three rounds of draft_begin (ragged num_valid) + a chain of draft_expand along the true tokens give
    the logits of the head's teacher-forced forward at each anchor and depth."""
    ids = batch["input_ids"]
    feats = features(head, target, batch)
    depths = min(depths, head.max_draft_depth or depths)
    with torch.no_grad():
        reference = head.anchor_logits(ids, feats)  # [d-1]: depth-d logits [B, T, V] by anchor
        state = head.draft_state(ids.shape[0], ids.shape[1])
        start = torch.zeros(ids.shape[0], dtype=torch.long)
        for m in (torch.tensor([5, 9, 6, 7]), torch.tensor([8, 10, 12, 9]), torch.tensor([9, 13, 15, 10])):
            logits, hidden = begin(head, state, ids, feats, start, m)
            drafted = [logits] + chain(head, state, ids, hidden, m, depths)
            for d, got in enumerate(drafted):
                torch.testing.assert_close(got, at_anchor(reference[d], m), rtol=1e-4, atol=1e-4,
                                           msg=lambda s: f"depth {d + 1}, committed {m.tolist()}: {s}")
            head.draft_end(state)
            start = m


def train_briefly(head, batch, feats, steps: int, lr: float = 3e-3):
    """`steps` Adam steps on one fixed batch; returns (losses, the last HeadLoss)."""
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        out = head(batch["input_ids"], batch["loss_mask"], feats)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses, out
