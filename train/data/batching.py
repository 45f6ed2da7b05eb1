"""Tokenised examples -> padded batches, and token statistics over a tokenised dataset."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


def collate_fn(pad_id: int):
    """A DataLoader collate: right-pads to the longest example of the batch.

    -> {"input_ids": Long[B, T], "attention_mask": Long[B, T], "loss_mask": Bool[B, T]}"""

    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        lengths = torch.tensor([len(x["input_ids"]) for x in items])  # [B]
        T = int(lengths.max())
        attention_mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
        input_ids = torch.full((len(items), T), pad_id, dtype=torch.long)
        loss_mask = torch.zeros((len(items), T), dtype=torch.bool)
        input_ids[attention_mask] = torch.tensor([t for x in items for t in x["input_ids"]], dtype=torch.long)
        loss_mask[attention_mask] = torch.tensor([m for x in items for m in x["loss_mask"]], dtype=torch.bool)
        return {"input_ids": input_ids, "attention_mask": attention_mask.long(), "loss_mask": loss_mask}

    return collate


def _arrow_batches(ds, columns, batch_size: int = 4096):
    """Iterate a dataset as pyarrow tables (respects select/shuffle index mappings)."""
    yield from ds.select_columns(columns).with_format("arrow").iter(batch_size=batch_size)


def token_counts(train_ds, vocab_size: int) -> torch.Tensor:
    """How often each target token is a loss-masked (assistant) token: LongTensor [V]. EAGLE-3 builds
    its reduced draft vocabulary from it."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for table in _arrow_batches(train_ds, ["input_ids", "loss_mask"]):
        ids = pc.list_flatten(table["input_ids"]).to_numpy(zero_copy_only=False)  # [N]
        mask = pc.list_flatten(table["loss_mask"]).to_numpy(zero_copy_only=False).astype(bool)  # [N]
        if ids.size and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary of size {vocab_size}: "
                             f"the dataset was tokenised for another target")
        counts += torch.from_numpy(np.bincount(ids[mask].astype(np.int64), minlength=vocab_size))
    return counts


def token_totals(ds) -> tuple[int, int]:
    """(tokens, loss-masked tokens) in a tokenised dataset."""
    tokens = learn = 0
    for table in _arrow_batches(ds, ["input_ids", "loss_mask"]):
        tokens += int(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)
        learn += int(pc.sum(pc.cast(pc.list_flatten(table["loss_mask"]), pa.int64())).as_py() or 0)
    return tokens, learn
