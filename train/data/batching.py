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


class LengthGroupedBatches:
    """Batches of similar-length examples, so little of a right-padded batch is padding.

    Every epoch: shuffle all examples (a function of seed and epoch only, so a resumed run sees the same
    batches), cut the order into windows of `window` batches, sort each window by length, cut it into
    batches and shuffle the batches. Batches stay random in content and order; only their lengths are
    alike. A batch sampler for `DataLoader(batch_sampler=...)`; accelerate reaches `set_epoch` through
    `.sampler` when it shards the batches over processes."""

    def __init__(self, lengths, batch_size: int, seed: int, window: int = 32):
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.long)  # [N]
        self.batch_size, self.seed, self.window = batch_size, seed, window
        self.epoch = 0
        self.sampler = self  # where accelerate's DataLoaderShard looks for set_epoch under sharding

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g)  # [N]
        span = self.batch_size * self.window
        batches = []
        for start in range(0, len(order), span):  # a few windows per epoch, not a loop over examples
            chunk = order[start:start + span]
            chunk = chunk[torch.argsort(self.lengths[chunk], descending=True, stable=True)]
            batches += list(chunk.split(self.batch_size))
        for i in torch.randperm(len(batches), generator=g).tolist():
            yield batches[i].tolist()


def example_lengths(ds) -> list[int]:
    """Token count of every example of a tokenised dataset."""
    out = []
    for table in _arrow_batches(ds, ["input_ids"]):
        out += pc.list_value_length(table["input_ids"]).to_pylist()
    return out


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
