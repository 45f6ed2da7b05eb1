"""Paged KV cache (vLLM's PagedAttention, Kwon et al. 2023) as a transformers `Cache`.

Storage: one pool per cache for keys and one for values, shaped [layers, kv_heads, slots, head_dim],
where slot = block * block_size + offset. A row (sequence) owns a block table (logical block -> physical
block); its token at storage position t lives in slot `table[t // bs] * bs + t % bs`. One extra block at
the end of the pool is scratch: padded query positions write there and unused table entries point there,
so every index is valid and nothing real is ever overwritten by padding.

Protocol for one forward of the target (the engine drives it; all rows at once, tensor ops only):

    plan = cache.prepare(num_new)          # num_new [B]: tokens each row appends (<= the input width)
    mask = <4D additive mask over plan.read_len keys>   (infer.tree.attention_mask)
    model(input_ids [B, Q], position_ids=..., attention_mask=mask, cache=cache)
        -> each attention layer calls cache.update(k, v, layer_idx): the new keys/values are written into
           their slots and the keys/values of storage positions 0..read_len-1 of every row come back
    cache.compact(start, path, keep)       # tree step: keep only the accepted path, at consecutive slots
    cache.truncate(lengths)                # or plain O(1) rollback

`prepare` checks capacity *before* touching anything: when the pool or a row is full it raises
CacheFullError and the cache is unchanged. Blocks are reference counted: `fork` shares a row's blocks
with another row without copying; appending into a shared, partly filled last block copies it first
(copy-on-write). Bookkeeping (tables, lengths, refcounts, free list) lives on the host as small tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache


class CacheFullError(RuntimeError):
    """The KV pool or a row's table cannot hold the requested tokens; the cache is left unchanged."""


@dataclass
class StepPlan:
    """Where one forward writes and what it reads (see module docstring)."""

    start: Tensor  # [B] storage position of each row's first new token (= its length before the step)
    num_new: Tensor  # [B] tokens appended per row
    width: int  # Q: input tokens per row in the forward (rows with num_new < Q are padded)
    read_len: int  # L: keys returned per row = max(start + num_new)
    write_slots: Tensor  # [B * Q] on the pool's device; padded positions -> scratch
    read_slots: Tensor | None  # [B * L] on the pool's device; None: read the contiguous range below
    read_from: int  # first slot of the contiguous range (batch 1 whose blocks happen to be consecutive)


class PagedKVCache(Cache):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, batch_size: int,
                 num_blocks: int, block_size: int = 16, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(layers=[])
        if block_size < 1 or num_blocks < 1 or batch_size < 1:
            raise ValueError("block_size, num_blocks and batch_size must all be >= 1")
        self.num_layers, self.block_size, self.num_blocks = num_layers, block_size, num_blocks
        self.rows = batch_size
        self.max_seq_len = max_seq_len or num_blocks * block_size
        self.max_blocks = -(-self.max_seq_len // block_size)  # table width
        self.device = torch.device(device)
        self.scratch = num_blocks  # the extra block
        slots = (num_blocks + 1) * block_size
        self.keys = torch.zeros(num_layers, num_kv_heads, slots, head_dim, dtype=dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.tables = torch.full((batch_size, self.max_blocks), self.scratch, dtype=torch.long)  # host
        self.num_table = torch.zeros(batch_size, dtype=torch.long)  # blocks in each row's table
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # tokens stored per row
        self.refcount = torch.zeros(num_blocks + 1, dtype=torch.long)
        self.free = torch.arange(num_blocks - 1, -1, -1)  # a stack: free[:num_free], lowest id on top
        self.num_free = num_blocks
        self.plan: StepPlan | None = None
        self.shared = False  # set by fork: only then can a write hit a block another row holds

    @classmethod
    def for_model(cls, config, *, batch_size: int, max_seq_len: int, block_size: int = 16,
                  num_blocks: int | None = None, dtype=torch.float32, device="cpu") -> "PagedKVCache":
        """Size a cache for an HF config; by default every row can reach max_seq_len (plus one block of
        slack per row for tree nodes written past a block boundary)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        per_row = -(-max_seq_len // block_size)
        return cls(config.num_hidden_layers, kv_heads, head_dim, batch_size=batch_size,
                   num_blocks=num_blocks or batch_size * per_row, block_size=block_size,
                   max_seq_len=max_seq_len, dtype=dtype, device=device)

    # ------------------------------------------------------------------------------ block allocation
    def _take(self, count: int) -> Tensor:
        taken = self.free[self.num_free - count:self.num_free].flip(0)
        self.num_free -= count
        self.refcount[taken] = 1
        return taken

    def _release(self, blocks: Tensor) -> None:
        """Drop one reference to each of `blocks` (may repeat); blocks nobody holds go back on the stack."""
        blocks = blocks[blocks != self.scratch]
        if blocks.numel() == 0:
            return
        self.refcount.index_add_(0, blocks, torch.full_like(blocks, -1))
        freed = blocks.unique()
        freed = freed[self.refcount[freed] == 0]
        # pushed in descending order so the next _take hands them out ascending (consecutive for batch 1)
        freed = freed.flip(0)
        self.free[self.num_free:self.num_free + freed.numel()] = freed
        self.num_free += freed.numel()

    def _block_slots(self, blocks: Tensor) -> Tensor:  # [n] -> [n * bs] slots of those blocks
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()

    # ------------------------------------------------------------------------------------- one step
    def prepare(self, num_new: Tensor | int, width: int | None = None) -> StepPlan:
        """Reserve room for `num_new[b]` tokens after each row's current length and plan the writes/reads
        of the next forward (input width `width`, default max(num_new))."""
        num_new = torch.as_tensor(num_new, dtype=torch.long).expand(self.rows).clone()
        width = int(num_new.max()) if width is None else width
        start = self.lengths.clone()
        new_len = start + num_new
        self._reserve(new_len, num_new)
        self.lengths = new_len

        offs = torch.arange(width)
        pos = start[:, None] + offs  # [B, Q]
        valid = offs < num_new[:, None]
        write = self._slots(pos.clamp(max=self.max_seq_len - 1))
        write = torch.where(valid, write, self.scratch * self.block_size)  # padding -> scratch

        read_len = int(new_len.max())
        read_slots, read_from = None, 0
        used = -(-read_len // self.block_size)
        first = self.tables[0, 0]
        if self.rows == 1 and bool((self.tables[0, :used] == first + torch.arange(used)).all()):
            read_from = int(first) * self.block_size  # consecutive blocks: read a view, copy nothing
        else:
            read_slots = self._slots(torch.arange(read_len).expand(self.rows, read_len)).flatten()
            read_slots = read_slots.to(self.device)
        self.plan = StepPlan(start, num_new, width, read_len, write.flatten().to(self.device),
                             read_slots, read_from)
        return self.plan

    def _slots(self, pos: Tensor) -> Tensor:  # storage positions [B, n] -> slots [B, n]
        blocks = self.tables.gather(1, (pos // self.block_size).clamp(max=self.max_blocks - 1))
        return blocks * self.block_size + pos % self.block_size

    def _reserve(self, new_len: Tensor, num_new: Tensor) -> None:
        """Allocate the blocks `new_len` needs (and copy shared last blocks that will be written)."""
        if int(new_len.max()) > self.max_seq_len:
            row = int(new_len.argmax())
            raise CacheFullError(f"row {row} would hold {int(new_len[row])} tokens but the cache holds at most "
                                 f"{self.max_seq_len} per row: shorten the prompt or max_new_tokens, or "
                                 f"build the cache with a larger max_seq_len")
        need = (-(-new_len // self.block_size) - self.num_table).clamp(min=0)  # [B]
        num_cow, cow, last = 0, None, None
        if self.shared:
            last = self.tables.gather(1, (self.num_table - 1).clamp(min=0)[:, None])[:, 0]  # [B]
            cow = (num_new > 0) & (self.lengths % self.block_size != 0) & (self.refcount[last] > 1)
            num_cow = int(cow.sum())
        num_fresh = int(need.sum())
        total = num_fresh + num_cow
        if total == 0:
            return
        if total > self.num_free:
            raise CacheFullError(f"KV cache pool exhausted: this step needs {total} more blocks of "
                                 f"{self.block_size} tokens but only {self.num_free} of {self.num_blocks} "
                                 f"are free: give the pool more blocks (Engine max_cache_tokens) or run fewer or "
                                 f"shorter rows")
        if num_cow:
            self._copy_on_write(cow.nonzero()[:, 0], last[cow])
        if num_fresh:
            rows = torch.repeat_interleave(torch.arange(self.rows), need)  # [n] row of each new block
            first_new = torch.cumsum(need, 0) - need  # [B] offset of each row's first new block in `rows`
            cols = self.num_table[rows] + torch.arange(rows.numel()) - first_new[rows]
            self.tables[rows, cols] = self._take(rows.numel())
            self.num_table += need

    def _copy_on_write(self, rows: Tensor, shared: Tensor) -> None:
        fresh = self._take(rows.numel())
        src, dst = self._block_slots(shared).to(self.device), self._block_slots(fresh).to(self.device)
        for pool in (self.keys, self.values):
            pool.index_copy_(2, dst, pool.index_select(2, src))
        self.tables[rows, self.num_table[rows] - 1] = fresh
        self._release(shared)

    # ------------------------------------------------------------------- the transformers Cache API
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Write this forward's keys/values [B, H, Q, D] and return those of positions 0..L-1 [B, H, L, D]."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("PagedKVCache.update called without prepare(): the engine plans each forward")
        out = []
        for pool, new in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            heads, dim = new.shape[1], new.shape[-1]
            pool.index_copy_(1, plan.write_slots, new.transpose(0, 1).reshape(heads, -1, dim))
            if plan.read_slots is None:
                out.append(pool[None, :, plan.read_from:plan.read_from + plan.read_len])  # a view
            else:
                read = pool.index_select(1, plan.read_slots)  # [H, B * L, D]
                out.append(read.view(heads, self.rows, plan.read_len, dim).transpose(0, 1))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max())

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self.plan.read_len if self.plan is not None else int(self.lengths.max()) + query_length), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_seq_len

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return self.rows

    def crop(self, tokens_to_remove: int) -> None:
        self.truncate((self.lengths - tokens_to_remove).clamp(min=0))

    def reset(self) -> None:
        self.release(torch.arange(self.rows))

    # --------------------------------------------------------------------- rollback, sharing, reading
    def truncate(self, lengths: Tensor) -> None:
        """O(1) rollback: keep the first `lengths[b]` tokens of each row; trailing blocks are released."""
        lengths = torch.as_tensor(lengths, dtype=torch.long).expand(self.rows)
        if bool((lengths > self.lengths).any()) or bool((lengths < 0).any()):
            raise ValueError(f"truncate to {lengths.tolist()} but rows hold {self.lengths.tolist()}")
        keep = -(-lengths // self.block_size)  # [B]
        drop = torch.arange(self.max_blocks) >= keep[:, None]
        drop &= torch.arange(self.max_blocks) < self.num_table[:, None]
        self._release(self.tables[drop])
        self.tables[drop] = self.scratch
        self.num_table = torch.minimum(self.num_table, keep)
        self.lengths = lengths.clone()

    def release(self, rows: Tensor) -> None:
        """Forget rows entirely (their blocks go back to the free list unless shared)."""
        lengths = self.lengths.clone()
        lengths[rows] = 0
        self.truncate(lengths)

    def fork(self, src: Tensor | int, dst: Tensor | int) -> None:
        """Make rows `dst` share the stored prefix of rows `src` without copying (reference counts)."""
        dst = torch.as_tensor(dst).reshape(-1)
        src = torch.as_tensor(src).reshape(-1).expand(dst.shape)  # one source may feed many rows
        if bool(torch.isin(src, dst).any()):
            raise ValueError(f"fork: source rows {src.tolist()} and destination rows {dst.tolist()} overlap")
        self.release(dst)
        self.tables[dst] = self.tables[src]
        self.num_table[dst] = self.num_table[src]
        self.lengths[dst] = self.lengths[src]
        shared = self.tables[src][torch.arange(self.max_blocks) < self.num_table[src][:, None]]
        self.refcount.index_add_(0, shared, torch.ones_like(shared))
        self.shared = True

    def compact(self, start: Tensor, path: Tensor, keep: Tensor) -> None:
        """After a tree step: row b keeps tokens start[b] + path[b, i] (i < keep[b]) at storage positions
        start[b] + i, then everything from start[b] + keep[b] on is dropped. path is increasing (parents
        come before children), so each entry moves backwards and one gather-then-scatter is safe."""
        width = path.shape[1]
        offs = torch.arange(width)
        live = (offs < keep[:, None]) & (path != offs)  # entries that actually move
        if bool(live.any()):
            src = self._slots(start[:, None] + path.clamp(min=0))[live].to(self.device)
            dst = self._slots(start[:, None] + offs)[live].to(self.device)
            for pool in (self.keys, self.values):
                pool.index_copy_(2, dst, pool.index_select(2, src))
        self.truncate(start + keep)

    def gather(self, layer_idx: int, row: int) -> tuple[Tensor, Tensor]:
        """The stored keys/values of one row [H, length, D] (for tests and debugging)."""
        length = int(self.lengths[row])
        slots = self._slots(torch.arange(length)[None].expand(self.rows, length))[row].to(self.device)
        return self.keys[layer_idx].index_select(1, slots), self.values[layer_idx].index_select(1, slots)

    def blocks_in_use(self) -> int:
        return self.num_blocks - self.num_free


class PagedContextKV:
    """Drop-in for heads.layers.ContextKV (a head's committed-context KV for one attention layer) backed by
    a one-layer PagedKVCache: memory grows a block at a time instead of [B, H, max_len, d] up front.

    append(k, v [B, H, n, d], positions [B, n], valid [B, n]) stores the valid entries after each row's last;
    view() -> (k, v [B, H, L, d], positions [B, L], valid [B, L]) with L the longest row (None if empty)."""

    def __init__(self, batch_size: int, max_len: int, block_size: int = 16):
        self.batch_size, self.max_len, self.block_size = batch_size, max_len, block_size
        self.cache: PagedKVCache | None = None
        self.pos = torch.zeros(batch_size, max_len, dtype=torch.long)

    def append(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        if self.cache is None:
            B, H, _, d = k.shape
            self.cache = PagedKVCache(1, H, d, batch_size=B, num_blocks=B * -(-self.max_len // self.block_size),
                                      block_size=self.block_size, max_seq_len=self.max_len, dtype=k.dtype,
                                      device=k.device)
        valid = valid.cpu()
        order = (~valid).long().argsort(dim=1, stable=True)  # valid entries first, in order
        num = valid.sum(1)
        start = self.cache.lengths.clone()
        self.cache.prepare(num, k.shape[2])
        idx = order.to(k.device)[:, None, :, None].expand_as(k)
        self.cache.update(k.gather(2, idx), v.gather(2, idx), 0)
        cols = start[:, None] + torch.arange(k.shape[2])
        keep = torch.arange(k.shape[2]) < num[:, None]
        self.pos[torch.arange(self.batch_size)[:, None].expand_as(cols)[keep], cols[keep]] = \
            positions.cpu().gather(1, order)[keep]

    def view(self):
        if self.cache is None:
            return None
        L = max(int(self.cache.lengths.max()), 1)
        cache = self.cache
        slots = cache._slots(torch.arange(L).expand(self.batch_size, L)).flatten().to(cache.device)
        heads, dim = cache.keys.shape[1], cache.keys.shape[-1]
        k, v = (pool[0].index_select(1, slots).view(heads, self.batch_size, L, dim).transpose(0, 1)
                for pool in (cache.keys, cache.values))
        valid = torch.arange(L)[None] < cache.lengths[:, None]
        dev = cache.device
        return k, v, self.pos[:, :L].to(dev), valid.to(dev)
