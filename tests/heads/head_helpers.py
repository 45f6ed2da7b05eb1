"""Helpers shared by the head tests: head YAML options, the fixed batch, target features."""

from pathlib import Path

import torch
import yaml

from heads.base import build_head, compute_features

CONF = Path(__file__).resolve().parents[2] / "conf" / "head"
KINDS = sorted(p.stem for p in CONF.glob("*.yaml"))  # every head config is tested

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
