"""Offline hidden-state cache: run the frozen target once, read its features back every epoch.

Layout of a cache directory:
  index.json                 target spec and shape, cached hidden-state indices, dtype, and the shards
                             with their sha256, byte size, entry and token counts
  shard-00000.safetensors    "input_ids" int32 [N], "offsets" int64 [n+1], "hidden.<i>" [N, h] per
                             cached hidden-state index i (rows concatenated along tokens), and with
                             data.cache_logits=topk "logits.values" [N, k] (cache dtype) + "logits.indices"
                             [N, k] int32, or with =full "logits" [N, V]; its metadata "keys" lists the
                             example keys of its rows (so index.json stays small)

An example's key is a hash of its token ids, so a batch finds its rows whatever the shuffling, split or
rank. Logits are optional (index "logits": {"mode", "k"}): by default (none) the target's logits are its
frozen LM head applied to the cached final-normed last hidden state, recomputed exactly in the step
(storing [T, V] costs V/h times more: 85x for SmolLM2). topk stores the target's distribution the way
distillation pipelines ship it when the target is not at hand: k logits per token, read back as dense
[T, V] with -inf elsewhere, so the head's soft target is the target's softmax renormalised over its top k.
The logit mode and k are part of a cache's identity: a cache is never read or extended with others.

Safety: the index names the target (spec, hidden size, layer count); opening checks it, the requested
layers, the shard sizes; each shard's sha256 is verified the first time it is read; and a sample of
entries is recomputed with the target and compared. A mismatch is a HiddenCacheError, never a silent
wrong feature.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch
from torch import Tensor

from headway.heads.base import TargetFeatures, compute_features
from headway.heads.files import atomic_path, file_sha256, write_json_atomic
from headway.train.data.batching import collate_fn
from headway.train.data.config import CACHE_LOGITS, DataError
from headway.train.data.decode import generating

INDEX = "index.json"
CACHE_FORMAT = 2  # 2: example keys live in the shard headers (1: in index.json "entries"; still read)
READABLE_FORMATS = (1, 2)
SPEC_KEYS = ("name", "path", "gguf_file", "revision", "seed", "tiny")  # what identifies the target's weights
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # recompute vs cache, relative L2
# states computed by a bf16 copy of an fp32 target (data generated with precision=bf16) against the fp32
# recompute: SmolLM2-135M's final-normed last state differs by 1.8-2.3% relative L2 over 72-246 tokens
COMPUTED_IN_TOL = {"bfloat16": 5e-2}


class HiddenCacheError(DataError):
    """A cache that does not match the target, the layers or itself; the message says how to fix it."""


def row_key(ids) -> str:
    """Identity of one example: hash of its token ids (int32)."""
    ids = torch.as_tensor(ids, dtype=torch.int32).cpu()
    return hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:24]


def batch_keys(input_ids: Tensor, attention_mask: Tensor) -> list[str]:
    """Keys of the rows of a right-padded batch [B, T]."""
    lengths = attention_mask.sum(1).tolist()
    return [row_key(input_ids[b, :n]) for b, n in enumerate(lengths)]


def unwritable_cache(directory: Path, exc: OSError) -> "HiddenCacheError":
    return HiddenCacheError(f"cannot write the hidden-state cache {directory}: {exc.strerror or exc}; free some "
                            f"space or point HEADWAY_CACHE (or data.hidden_cache) at a writable folder, then run "
                            f"again (finished shards are kept)")


def _spec_identity(spec: dict) -> dict:
    return {k: spec.get(k) for k in SPEC_KEYS}


def identity_differences(index: dict, fresh: dict) -> list[str]:
    """The identity fields (target spec, shape, layers, dtype) where a cache index and this run differ, as
    "field: cache X, this run Y", so the message names what to change instead of two equal-looking names."""
    cached = {**{f"target.{k}": v for k, v in _spec_identity(index["target"]).items()},
              **{k: index.get(k) for k in ("num_layers", "hidden_size", "layers", "dtype")}}
    wanted = {**{f"target.{k}": v for k, v in _spec_identity(fresh["target"]).items()},
              **{k: fresh.get(k) for k in ("num_layers", "hidden_size", "layers", "dtype")}}
    return [f"{k}: cache {cached[k]!r}, this run {wanted[k]!r}" for k in wanted
            if wanted[k] is not None and cached.get(k) != wanted[k]]


def auto_cache_dir(target, layers: list[int], logits: str = "none", topk: int = 64) -> Path:
    """Where training keeps the cache it builds itself (data.hidden_cache unset): one directory per target
    weights, dtype, hidden-state indices and logit mode, so two configurations never share one."""
    from headway.heads.target import cache_root

    dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    wanted = sorted(set(layers) | {target.config.num_hidden_layers})
    spec = hashlib.sha256(json.dumps(target.spec.to_dict(), sort_keys=True).encode()).hexdigest()[:8]
    suffix = {"none": "", "topk": f"-top{topk}", "full": "-logits"}[logits]
    return cache_root() / "hidden" / f"{target.spec.name}-{spec}-{dtype}-L{'_'.join(map(str, wanted))}{suffix}"


# ------------------------------------------------------------------------------------------ logits

def logits_identity(mode: str = "none", topk: int = 64) -> dict:
    """How a cache stores the target's logits (index.json "logits"); k only matters for topk."""
    if mode not in CACHE_LOGITS:
        raise HiddenCacheError(f"cache logits mode {mode!r} is unknown: use one of {', '.join(CACHE_LOGITS)}")
    if mode == "topk" and topk < 1:
        raise HiddenCacheError(f"logits_topk={topk} must be >= 1")
    return {"mode": mode, "k": int(topk)} if mode == "topk" else {"mode": mode}


def describe_logits(ident: dict) -> str:
    return f"cache_logits=topk logits_topk={ident['k']}" if ident["mode"] == "topk" else \
        f"cache_logits={ident['mode']}"


def logit_rows(logits: Tensor, ident: dict, dtype: torch.dtype) -> dict[str, Tensor]:
    """What a cache stores of logits [..., V]: {} | top-k values + ids [..., k] | all of them [..., V]."""
    if ident["mode"] == "topk":
        values, ids = logits.topk(ident["k"], dim=-1)  # sorted, largest first
        return {"logits.values": values.to(dtype), "logits.indices": ids.to(torch.int32)}
    return {"logits": logits.to(dtype)} if ident["mode"] == "full" else {}


def logit_fields(ident: dict, vocab_size: int) -> dict[str, tuple[int, torch.dtype]]:
    """The shard tensors of a logit mode: name -> (width, dtype as read back)."""
    if ident["mode"] == "topk":
        return {"logits.values": (ident["k"], torch.float32), "logits.indices": (ident["k"], torch.int64)}
    return {"logits": (vocab_size, torch.float32)} if ident["mode"] == "full" else {}


def dense_logits(rows: dict[str, Tensor], vocab_size: int) -> Tensor:
    """Stored rows [..., k or V] -> logits [..., V] fp32; top-k: -inf outside the stored ids, so the
    softmax renormalises over them (one scatter, on whichever device the rows are)."""
    if "logits" in rows:
        return rows["logits"].float()
    values = rows["logits.values"].float()  # [..., k]
    full = values.new_full(values.shape[:-1] + (vocab_size,), float("-inf"))
    return full.scatter_(-1, rows["logits.indices"].long(), values)


def logits_error(rows: dict[str, Tensor], fresh: Tensor) -> float:
    """Relative L2 error of stored logit rows against recomputed logits [n, V]. Top-k: the stored values
    against the fresh ones at the stored ids, and the fresh values at the stored ids (sorted) against the
    fresh top k, so a wrong id set counts but a near-tie swapped by float noise does not."""
    def rel(a: Tensor, b: Tensor) -> float:
        return float((a.float() - b).norm() / b.norm().clamp_min(1e-12))

    if "logits" in rows:
        return rel(rows["logits"], fresh)
    ids = rows["logits.indices"].long()  # [n, k]
    at_ids = fresh.gather(-1, ids)
    best = fresh.topk(ids.shape[-1], dim=-1).values
    return max(rel(rows["logits.values"], at_ids), rel(at_ids.sort(-1, descending=True).values, best))


# ------------------------------------------------------------------------------------------ writer

class CacheWriter:
    """Appends shards to a cache directory; a killed run loses at most the unflushed shard."""

    def __init__(self, directory, target, layers: list[int], dtype: torch.dtype, shard_tokens: int, meta: dict,
                 logits: dict | None = None):
        self.dir = Path(directory)
        cfg = target.config
        logits = logits or logits_identity()
        if logits.get("k", 0) > cfg.vocab_size:
            raise HiddenCacheError(f"logits_topk={logits['k']} exceeds the target's vocabulary ({cfg.vocab_size}): "
                                   f"use a smaller k or data.cache_logits=full")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise unwritable_cache(self.dir, exc) from None
        self.dtype, self.shard_tokens = dtype, shard_tokens
        self.computed_in: str | None = None  # the dtype the states were computed in, when not the cache's
        fresh = {"format": CACHE_FORMAT, "target": target.spec.to_dict(), "num_layers": cfg.num_hidden_layers,
                 "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                 "layers": sorted(set(layers) | {cfg.num_hidden_layers}),
                 "dtype": str(dtype).removeprefix("torch."), "logits": logits, "meta": meta, "shards": []}
        self.index = fresh
        if (self.dir / INDEX).is_file():
            self.index = read_index(self.dir)
            if stored_logits(self.index) != logits:
                raise HiddenCacheError(f"{self.dir} holds a cache built with "
                                       f"{describe_logits(stored_logits(self.index))}, not {describe_logits(logits)}: "
                                       f"use a new directory or delete it")
            different = identity_differences(self.index, fresh)
            if different:
                raise HiddenCacheError(f"{self.dir} holds a cache for another target, layers or dtype "
                                       f"({'; '.join(different)}): use a new directory or delete it")
        self.layers, self.logits = self.index["layers"], logits
        self.entries = read_entries(self.dir, self.index)  # key -> (shard, row)
        self.pending: list[tuple[str, Tensor, dict[str, Tensor]]] = []
        self.pending_tokens = 0

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def add(self, key: str, ids: Tensor, hidden: dict[int, Tensor], logits: Tensor | None = None) -> None:
        """ids [T]; hidden[i] [T, h] for every cached index i; logits [T, V] unless the mode is none."""
        rows = {f"hidden.{i}": hidden[i].to(self.dtype).cpu() for i in self.layers}
        if self.logits["mode"] != "none":
            rows.update((name, t.cpu()) for name, t in logit_rows(logits, self.logits, self.dtype).items())
        self.pending.append((key, ids.to(torch.int32).cpu(), rows))
        self.pending_tokens += len(ids)
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the pending examples as one shard (temp file, rename), then the index (same)."""
        if not self.pending:
            return
        try:
            self._write_shard()
        except OSError as exc:
            raise unwritable_cache(self.dir, exc) from None

    def _write_shard(self) -> None:
        from safetensors.torch import save_file

        n = len(self.index["shards"])
        name = f"shard-{n:05d}.safetensors"
        lengths = torch.tensor([len(ids) for _, ids, _ in self.pending])
        tensors = {"input_ids": torch.cat([ids for _, ids, _ in self.pending]),
                   "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])}
        for field in self.pending[0][2]:  # hidden.<i> [N, h], logits.* [N, k] or [N, V]
            tensors[field] = torch.cat([rows[field] for _, _, rows in self.pending])
        with atomic_path(self.dir / name) as tmp:
            save_file(tensors, str(tmp), metadata={"keys": json.dumps([key for key, _, _ in self.pending])})
        shard = {"file": name, "sha256": file_sha256(self.dir / name), "bytes": (self.dir / name).stat().st_size,
                 "entries": len(self.pending), "tokens": int(lengths.sum())}
        if self.computed_in:  # validation allows such shards the larger error of that precision
            shard["computed_in"] = self.computed_in
        self.index["shards"].append(shard)
        for row, (key, _, _) in enumerate(self.pending):
            self.entries[key] = (n, row)
            if "entries" in self.index:  # a format-1 cache keeps its index readable by format-1 code
                self.index["entries"][key] = [n, row]
        write_json_atomic(self.dir / INDEX, self.index, indent=None)
        self.pending, self.pending_tokens = [], 0

    def adopt_parts(self) -> None:
        """Move the shards of the part directories of a distributed build into this cache (shard by shard:
        move, this index, the part's index, so a kill at any point loses no entry and lists no missing file)."""
        for part in sorted(self.dir.glob(".part-*")):
            if (part / INDEX).is_file():
                index = read_index(part)
                while index["shards"]:
                    shard = index["shards"][0]
                    if (part / shard["file"]).is_file():
                        n = len(self.index["shards"])
                        name = f"shard-{n:05d}.safetensors"
                        os.replace(part / shard["file"], self.dir / name)
                        self.index["shards"].append(dict(shard, file=name))
                        write_json_atomic(self.dir / INDEX, self.index, indent=None)
                    index["shards"].pop(0)
                    write_json_atomic(part / INDEX, index, indent=None)
            for leftover in part.iterdir():  # an index with no shards left, temp files of a killed write
                leftover.unlink()
            part.rmdir()
        self.entries = read_entries(self.dir, self.index)


def build_cache(directory, target, datasets, layers: list[int], dtype: torch.dtype | None = None,
                batch_size: int = 8, shard_tokens: int = 1 << 18, meta: dict | None = None,
                progress: bool = True, logits: str = "none", topk: int = 64, rank: int = 0, world_size: int = 1,
                barrier=None, precision: str = "fp32") -> dict:
    """Run the target over every example of `datasets` (tokenised, items with input_ids/loss_mask) not yet
    cached and store its hidden states (and its logits: `logits` none | topk (`topk` per token) | full).
    `precision` (data.cache_precision): fp32 runs the target as it is (offline equals online); bf16 runs a bf16
    copy of an fp32 target (~1.6x as fast on a CPU that multiplies bf16; its shards record `computed_in`, and
    validation allows them bf16's error, as for states captured while a bf16 copy wrote the data); auto: bf16
    where the hardware multiplies it (train/data/decode.py resolve_precision).
    Distributed (world_size > 1; every rank calls it with the same datasets, `barrier` a collective wait):
    each rank computes every world_size-th missing example into its own part directory, then rank 0 moves
    the parts' shards into the cache under one index.
    Returns {"entries", "new_entries", "tokens", "bytes", "bytes_per_token", "logits",
    "hidden_bytes_per_token", "logits_bytes_per_token", "seconds", "tokens_per_s"}."""
    model = target.model
    dtype = dtype or next(model.parameters()).dtype
    ident = logits_identity(logits, topk)

    def writer_in(path: Path) -> CacheWriter:
        return CacheWriter(path, target, layers, dtype, shard_tokens, meta or {}, ident)

    if rank == 0:
        writer_in(directory).adopt_parts()  # parts a killed distributed build left behind
    if world_size > 1:
        barrier()
    main = writer_in(directory)
    todo = _uncached(datasets, main)[rank::world_size]  # (length, key, dataset, row), shortest first
    writer = writer_in(part_dir(directory, rank)) if world_size > 1 else main
    todo = [t for t in todo if t[1] not in writer]
    started = time.perf_counter()
    # target.model: a bf16 copy while it computes, where asked (and there is something to compute)
    with generating(target, None, precision if todo else "fp32"):
        computed = next(target.model.parameters()).dtype
        if computed != dtype:
            writer.computed_in = str(computed).removeprefix("torch.")
        new_tokens = _compute(writer, target, datasets, todo, batch_size, ident["mode"] != "none", progress)
    seconds = time.perf_counter() - started
    if world_size > 1:
        barrier()
        if rank == 0:
            main.adopt_parts()
        barrier()
        main = writer_in(directory)
    index = main.index
    tokens = sum(s["tokens"] for s in index["shards"])
    size = sum(s["bytes"] for s in index["shards"])
    return {"entries": len(main.entries), "new_entries": len(todo), "tokens": tokens, "bytes": size,
            "bytes_per_token": round(size / max(tokens, 1), 1), "logits": describe_logits(ident),
            **bytes_per_token(index), "seconds": round(seconds, 2),
            "tokens_per_s": round(new_tokens / seconds, 1) if todo else None}


def _compute(writer: CacheWriter, target, datasets, todo, batch_size: int, with_logits: bool,
             progress: bool) -> int:
    """Features of the `todo` examples into the writer, a batch at a time; -> tokens computed."""
    from tqdm.auto import tqdm

    model = target.model
    collate = collate_fn(target.tokenizer.pad_token_id or 0)
    device = next(model.parameters()).device
    new_tokens = 0
    bar = tqdm(total=sum(n for n, *_ in todo), desc="caching hidden states", unit="tok", disable=not progress)
    for start in range(0, len(todo), batch_size):
        chunk = todo[start:start + batch_size]
        items = [datasets[d][r] for _, _, d, r in chunk]
        batch = collate(items)
        feats = compute_features(model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                 writer.layers, with_logits)
        for b, ((n, key, _, _), item) in enumerate(zip(chunk, items)):
            writer.add(key, torch.tensor(item["input_ids"]), {i: feats.hidden_states[i][b, :n] for i in writer.layers},
                       feats.logits[b, :n] if with_logits else None)
            new_tokens += n
        bar.update(sum(n for n, *_ in chunk))
    writer.flush()
    bar.close()
    return new_tokens


def part_dir(directory, rank: int) -> Path:
    """Where rank `rank` of a distributed build writes its share (inside the cache, hidden)."""
    return Path(directory) / f".part-{rank}"


def bytes_per_token(index: dict) -> dict:
    """Payload bytes per token of the hidden states and of the logits (the rest: ids, offsets, headers)."""
    item = DTYPES[index["dtype"]].itemsize
    ident = stored_logits(index)
    per_logit = {"none": 0, "topk": ident.get("k", 0) * (item + 4), "full": index["vocab_size"] * item}
    return {"hidden_bytes_per_token": len(index["layers"]) * index["hidden_size"] * item,
            "logits_bytes_per_token": per_logit[ident["mode"]]}


def _uncached(datasets, writer: CacheWriter) -> list[tuple[int, str, int, int]]:
    """Examples not in the cache yet, each once, streamed (a big dataset never sits in memory)."""
    todo, seen = [], set()
    for d, ds in enumerate(datasets):
        row = 0
        for batch in ds.select_columns(["input_ids"]).iter(batch_size=1024):
            for ids in batch["input_ids"]:
                key = row_key(ids)
                if key not in seen and key not in writer:
                    seen.add(key)
                    todo.append((len(ids), key, d, row))
                row += 1
    return sorted(todo)


# ------------------------------------------------------------------------------------------ reader

def read_index(directory) -> dict:
    path = Path(directory) / INDEX
    if not path.is_file():
        raise HiddenCacheError(f"no hidden-state cache in {directory} (missing {INDEX}): build it with "
                               f"scripts/cache_hidden_states.py <training overrides> data.hidden_cache={directory}")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise HiddenCacheError(f"{path} is corrupted ({exc.msg}): rebuild the cache") from None
    if index.get("format") not in READABLE_FORMATS:
        raise HiddenCacheError(f"{path} has cache format {index.get('format')}, expected {CACHE_FORMAT}: delete "
                               f"{Path(directory)} and rebuild it")
    return index


def stored_logits(index: dict) -> dict:
    return index.get("logits", {"mode": "none"})  # caches from before logits could be stored hold none


def read_entries(directory: Path, index: dict) -> dict[str, tuple[int, int]]:
    """key -> (shard, row), from the shards' headers (a few bytes each)."""
    from safetensors import SafetensorError, safe_open

    entries = {key: tuple(where) for key, where in index.get("entries", {}).items()}  # format 1
    for n, shard in enumerate(index["shards"]):
        path = directory / shard["file"]
        try:
            with safe_open(str(path), framework="pt") as reader:
                keys = (reader.metadata() or {}).get("keys")
        except (SafetensorError, OSError) as exc:
            raise HiddenCacheError(f"{path} is missing or unreadable ({type(exc).__name__}): rebuild the cache "
                                   f"(scripts/cache_hidden_states.py resumes from what is intact)") from None
        if keys is None and "entries" not in index:
            raise HiddenCacheError(f"{path} lists no example keys: rebuild the cache")
        entries.update((key, (n, row)) for row, key in enumerate(json.loads(keys or "[]")))
    return entries


class HiddenStateCache:
    """Read access to a cache directory, checked against the target and the layers asked for."""

    def __init__(self, directory, target, layers: list[int], logits: str | None = None, topk: int = 64):
        """`logits`/`topk`: the logit mode the caller expects (None: whatever the cache holds)."""
        self.dir = Path(directory)
        self.index = read_index(self.dir)
        self.dtype = DTYPES[self.index["dtype"]]
        self._check_target(target, layers)
        self.logits = stored_logits(self.index)
        if logits is not None and logits_identity(logits, topk) != self.logits:
            raise HiddenCacheError(f"{self.dir} was built with {describe_logits(self.logits)}, but "
                                   f"{describe_logits(logits_identity(logits, topk))} was asked for: set data."
                                   f"{describe_logits(self.logits).replace(' ', ' data.')} to read it, or point "
                                   f"data.hidden_cache at a cache built with these settings")
        for shard in self.index["shards"]:
            path = self.dir / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["bytes"]:
                raise HiddenCacheError(f"{path} is missing or truncated: rebuild the cache "
                                       f"(scripts/cache_hidden_states.py resumes from what is intact)")
        self.entries = read_entries(self.dir, self.index)
        self._open: dict[int, object] = {}

    def _check_target(self, target, layers) -> None:
        idx, cfg = self.index, target.config
        different = identity_differences(idx, {"target": target.spec.to_dict(), "hidden_size": cfg.hidden_size,
                                               "num_layers": cfg.num_hidden_layers})
        if different:
            raise HiddenCacheError(f"{self.dir} was built for another target ({'; '.join(different)}): "
                                   f"point data.hidden_cache at this target's cache or rebuild it")
        self.layers = sorted(set(layers) | {cfg.num_hidden_layers})
        missing = sorted(set(self.layers) - set(idx["layers"]))
        if missing:
            raise HiddenCacheError(f"{self.dir} caches hidden-state indices {idx['layers']}, but the head needs "
                                   f"{missing} too: rebuild the cache for this head (scripts/cache_hidden_states.py "
                                   f"head=<kind>)")

    def __len__(self) -> int:
        return len(self.entries)

    def keys(self) -> list[str]:
        return list(self.entries)

    def _shard(self, n: int):
        """The shard's lazy reader; its checksum is verified on first use."""
        if n not in self._open:
            from safetensors import SafetensorError, safe_open

            shard = self.index["shards"][n]
            path = self.dir / shard["file"]
            if file_sha256(path) != shard["sha256"]:
                raise HiddenCacheError(f"{path} is corrupted (checksum mismatch): delete it and its entries by "
                                       f"rebuilding the cache into a new directory")
            try:
                self._open[n] = safe_open(str(path), framework="pt")
            except SafetensorError as exc:
                raise HiddenCacheError(f"{path} is unreadable ({exc}): rebuild the cache") from None
        return self._open[n]

    def _rows(self, key: str, names: list[str]) -> dict[str, Tensor]:
        """The example's rows of the shard tensors `names` ([T, ...] each)."""
        if key not in self.entries:
            raise HiddenCacheError(f"an example is not in the hidden-state cache {self.dir}: it was built for "
                                   f"other data or another max_length; rebuild it with the training overrides")
        n, row = self.entries[key]
        reader = self._shard(n)
        start, end = reader.get_slice("offsets")[row:row + 2].tolist()
        return {name: reader.get_slice(name)[start:end] for name in names}

    def entry(self, key: str) -> tuple[Tensor, dict[int, Tensor]]:
        """-> (ids [T] int32, {i: [T, h]})"""
        rows = self._rows(key, ["input_ids"] + [f"hidden.{i}" for i in self.layers])
        return rows["input_ids"], {i: rows[f"hidden.{i}"] for i in self.layers}

    def logit_rows(self, key: str) -> dict[str, Tensor]:
        """The example's stored logits: {} | {"logits.values", "logits.indices"} [T, k] | {"logits"} [T, V]."""
        names = list(logit_fields(self.logits, self.index["vocab_size"]))
        return self._rows(key, names) if names else {}

    def features(self, input_ids: Tensor, attention_mask: Tensor, dtype: torch.dtype) -> TargetFeatures:
        """The cached features of a right-padded batch [B, T] (zeros at padding), with the stored logits
        as dense [B, T, V] fp32 unless the mode is none (finite at padding, where no loss looks)."""
        B, T = input_ids.shape
        h, V = self.index["hidden_size"], self.index["vocab_size"]
        hidden = {i: torch.zeros(B, T, h, dtype=dtype) for i in self.layers}
        fields = logit_fields(self.logits, V)
        stored = {name: torch.zeros(B, T, width, dtype=kind) for name, (width, kind) in fields.items()}
        for b, key in enumerate(batch_keys(input_ids, attention_mask)):
            ids, rows = self.entry(key)
            for i in self.layers:
                hidden[i][b, :len(ids)] = rows[i]
            for name, rows in self.logit_rows(key).items():
                stored[name][b, :len(ids)] = rows
        device = input_ids.device
        # top-k goes to the device as [B, T, k] and is scattered there: V/k times less to move than dense
        logits = dense_logits({name: t.to(device) for name, t in stored.items()}, V) if stored else None
        return TargetFeatures({i: v.to(device) for i, v in hidden.items()}, self.index["num_layers"], logits)

    def validate(self, target, samples: int = 4, seed: int = 0) -> float:
        """Recompute `samples` random entries with the target; -> the worst relative L2 error of their
        hidden states and stored logits. Raises HiddenCacheError above an entry's tolerance (`tolerance`: wrong
        weights, corrupted data)."""
        keys = random.Random(seed).sample(self.keys(), min(samples, len(self)))
        model = target.model
        device = next(model.parameters()).device
        with_logits = self.logits["mode"] != "none"
        worst = {"hidden states": 0.0, "logits": 0.0}  # error / tolerance, and the error itself
        errors = {"hidden states": 0.0, "logits": 0.0}

        def record(what: str, err: float, tol: float) -> None:
            if err / tol > worst[what]:
                worst[what], errors[what] = err / tol, err

        for key in keys:
            ids, cached = self.entry(key)
            tol = self.tolerance(key)
            fresh = compute_features(model, ids.long()[None].to(device), None, self.layers, with_logits)
            for i in self.layers:
                ref = fresh.hidden_states[i][0].float().cpu()
                record("hidden states", float((cached[i].float() - ref).norm() / ref.norm().clamp_min(1e-12)), tol)
            if with_logits:
                record("logits", logits_error(self.logit_rows(key), fresh.logits[0].cpu()), tol)
        for what, ratio in worst.items():
            err = errors[what]
            if ratio > 1:
                tol = err / ratio
                raise HiddenCacheError(f"{self.dir}: cached {what} differ from target {target.spec.name!r} "
                                       f"(relative error {err:.3g} > {tol:g}): the cache was built with other "
                                       f"weights or is corrupted; rebuild it")
        return max(errors.values())

    def tolerance(self, key: str) -> float:
        """The relative L2 error allowed for an entry: the cache dtype's, or that of the precision its shard
        was computed in (a bf16 copy of the target generating the data) when larger."""
        shard = self.index["shards"][self.entries[key][0]]
        return max(REL_TOL[self.dtype], COMPUTED_IN_TOL.get(shard.get("computed_in"), 0.0))


class OfflineFeatureSource:
    """callable(batch) -> TargetFeatures read from the cache (what make_feature_source returns offline)."""

    def __init__(self, directory, target, layers: list[int], with_logits: bool = False, validate_samples: int = 2,
                 logits: str | None = None, topk: int = 64):
        self.cache = HiddenStateCache(directory, target, layers, logits, topk)
        self.cache.validate(target, validate_samples)
        self.with_logits = with_logits
        self.lm_head = target.model.get_output_embeddings()
        self.dtype = next(target.model.parameters()).dtype

    @torch.no_grad()
    def __call__(self, batch: dict) -> TargetFeatures:
        feats = self.cache.features(batch["input_ids"], batch["attention_mask"], self.dtype)  # + stored logits
        if self.with_logits and feats.logits is None:  # its LM head on the final-normed last hidden state
            feats.logits = self.lm_head(feats.last_hidden).float()  # [B, T, V]
        return feats
