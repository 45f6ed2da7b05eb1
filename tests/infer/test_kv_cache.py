"""Paged KV cache: what it stores equals plain concatenation, and rollback/sharing/compaction keep it so."""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from headway.infer.kv_cache import CacheFullError, PagedKVCache

H, D, LAYERS = 2, 4, 3


def make(batch=2, blocks=16, bs=4, max_len=None):
    return PagedKVCache(LAYERS, H, D, batch_size=batch, num_blocks=blocks, block_size=bs, max_seq_len=max_len)


def append(cache, kv, num_new):
    """Append kv [B, H, Q, D] (row b: first num_new[b] tokens) through the HF update path, every layer."""
    num_new = torch.as_tensor(num_new)
    cache.prepare(num_new, kv.shape[2])
    outs = [cache.update(kv + layer, -kv - layer, layer) for layer in range(LAYERS)]
    return outs


def stored(cache, row, layer=0):
    return cache.gather(layer, row)


def test_appends_equal_dynamic_cache_concatenation():
    torch.manual_seed(0)
    cache, ref = make(batch=1), DynamicCache()
    for q in (5, 1, 1, 7, 3, 1):  # crosses block boundaries at odd offsets
        kv = torch.randn(1, H, q, D)
        keys, values = append(cache, kv, [q])[1]
        ref_k, ref_v = ref.update(kv + 1, -kv - 1, 0)
        torch.testing.assert_close(keys, ref_k, rtol=0, atol=0)
        torch.testing.assert_close(values, ref_v, rtol=0, atol=0)
    assert cache.get_seq_length() == 18


def test_ragged_rows_read_their_own_tokens():
    torch.manual_seed(0)
    cache = make(batch=3)
    kv = torch.randn(3, H, 6, D)
    keys, _ = append(cache, kv, [6, 2, 4])[0]
    assert keys.shape == (3, H, 6, D)
    for row, n in enumerate([6, 2, 4]):
        torch.testing.assert_close(keys[row, :, :n], kv[row, :, :n])
        torch.testing.assert_close(stored(cache, row)[0], kv[row, :, :n])
    assert cache.lengths.tolist() == [6, 2, 4]


def test_rollback_frees_trailing_blocks_and_reuses_them():
    torch.manual_seed(0)
    cache = make(batch=1, bs=4)
    kv = torch.randn(1, H, 10, D)
    append(cache, kv, [10])
    assert cache.blocks_in_use() == 3
    cache.truncate(torch.tensor([5]))
    assert cache.blocks_in_use() == 2 and cache.lengths.tolist() == [5]
    torch.testing.assert_close(stored(cache, 0)[0], kv[0, :, :5])
    more = torch.randn(1, H, 6, D)
    append(cache, more, [6])
    torch.testing.assert_close(stored(cache, 0)[0], torch.cat([kv[0, :, :5], more[0]], 1))
    assert cache.blocks_in_use() == 3


def test_fork_shares_blocks_and_copies_on_write():
    torch.manual_seed(0)
    cache = make(batch=3, bs=4)
    prefix = torch.randn(3, H, 6, D)
    append(cache, prefix, [6, 0, 0])
    used = cache.blocks_in_use()
    cache.fork(0, torch.tensor([1, 2]))
    assert cache.blocks_in_use() == used  # nothing copied
    assert cache.lengths.tolist() == [6, 6, 6]
    tails = torch.randn(3, H, 3, D)
    append(cache, tails, [3, 3, 0])  # rows 0 and 1 write into the shared, half-full last block
    for row in range(3):
        want = torch.cat([prefix[0], tails[row]], 1) if row < 2 else prefix[0]
        torch.testing.assert_close(stored(cache, row)[0], want)
    cache.release(torch.arange(3))
    assert cache.blocks_in_use() == 0 and cache.num_free == cache.num_blocks


def test_exhaustion_raises_and_leaves_the_cache_intact():
    torch.manual_seed(0)
    cache = make(batch=2, blocks=3, bs=4)
    kv = torch.randn(2, H, 5, D)
    append(cache, kv, [5, 4])  # 2 + 1 blocks: the pool is full
    before = (cache.tables.clone(), cache.lengths.clone(), cache.refcount.clone(), cache.num_free,
              cache.keys.clone())
    with pytest.raises(CacheFullError, match="pool exhausted"):
        cache.prepare(torch.tensor([1, 1]))  # row 1 needs a new block, none free
    after = (cache.tables, cache.lengths, cache.refcount, cache.num_free, cache.keys)
    for a, b in zip(before, after):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    append(cache, torch.randn(2, H, 1, D), [1, 0])  # row 0 still fits in its block
    assert cache.lengths.tolist() == [6, 4]


def test_row_longer_than_the_cache_is_a_clear_error():
    cache = make(batch=1, blocks=8, bs=4, max_len=10)
    with pytest.raises(CacheFullError, match="at most 10 per row"):
        cache.prepare(torch.tensor([11]))
    assert cache.lengths.tolist() == [0] and cache.blocks_in_use() == 0


def test_compact_keeps_the_accepted_path_at_consecutive_positions():
    torch.manual_seed(0)
    cache = make(batch=2, bs=4)
    ctx = torch.randn(2, H, 3, D)
    append(cache, ctx, [3, 3])
    tree = torch.randn(2, H, 7, D)  # 7 tree nodes per row, stored at 3..9
    append(cache, tree, [7, 7])
    path = torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1]])
    keep = torch.tensor([3, 2])
    cache.compact(torch.tensor([3, 3]), path, keep)
    assert cache.lengths.tolist() == [6, 5]
    for row in range(2):
        nodes = path[row, :keep[row]]
        torch.testing.assert_close(stored(cache, row)[0], torch.cat([ctx[row], tree[row][:, nodes]], 1))
        torch.testing.assert_close(stored(cache, row, layer=2)[1], -torch.cat([ctx[row], tree[row][:, nodes]], 1) - 2)
    assert cache.blocks_in_use() == 4  # ceil(6/4) + ceil(5/4): the tree's extra blocks were freed


def test_paged_context_kv_is_a_drop_in_for_the_heads_context_kv():
    from headway.heads.layers import ContextKV

    from headway.infer.kv_cache import PagedContextKV

    torch.manual_seed(0)
    dense, paged = ContextKV(3, 40), PagedContextKV(3, 40, block_size=4)
    for n in (5, 1, 3, 7):
        k, v = torch.randn(3, H, n, D), torch.randn(3, H, n, D)
        pos, valid = torch.randint(0, 100, (3, n)), torch.rand(3, n) < 0.7
        dense.append(k, v, pos, valid)
        paged.append(k, v, pos, valid)
        want, got = dense.view(), paged.view()
        assert torch.equal(want[3], got[3])
        seen = want[3]
        for a, b in zip(want[:3], got[:3]):  # stored entries agree (beyond a row's length: don't care)
            m = seen[:, None, :, None] if a.dim() == 4 else seen
            assert torch.equal(torch.where(m, a, 0), torch.where(m, b, 0))
