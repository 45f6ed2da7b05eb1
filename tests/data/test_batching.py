"""Length-grouped batches: every example once per epoch, little padding, reproducible per (seed, epoch)."""

import torch

from headway.train.data.batching import LengthGroupedBatches


def lengths(n: int = 403) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def padded_tokens(batches, lens) -> int:
    return sum(len(b) * max(lens[i] for i in b) for b in batches)


def test_every_example_once_per_epoch_in_batches_of_the_given_size():
    lens = lengths()
    batches = list(LengthGroupedBatches(lens, batch_size=4, seed=0))
    assert sorted(i for b in batches for i in b) == list(range(len(lens)))
    assert len(batches) == len(LengthGroupedBatches(lens, 4, 0)) == 101
    assert sum(len(b) < 4 for b in batches) <= 1  # one short batch at most (403 = 100 x 4 + 3)


def test_grouping_pads_far_less_than_random_batches():
    lens = lengths()
    grouped = list(LengthGroupedBatches(lens, batch_size=4, seed=0))
    order = torch.randperm(len(lens), generator=torch.Generator().manual_seed(0)).tolist()
    random = [order[i:i + 4] for i in range(0, len(order), 4)]
    real = sum(lens)
    assert padded_tokens(grouped, lens) - real < 0.3 * (padded_tokens(random, lens) - real)


def test_order_is_a_function_of_seed_and_epoch():
    lens = lengths()
    a, b = LengthGroupedBatches(lens, 4, seed=0), LengthGroupedBatches(lens, 4, seed=0)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first  # a new shuffle every epoch
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(LengthGroupedBatches(lens, 4, seed=1)) != first
