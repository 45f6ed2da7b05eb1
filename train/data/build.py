"""Conversations on disk (or on the Hub) -> tokenised train/validation `datasets.Dataset`s.

Each item is {"input_ids": list[int], "loss_mask": list[bool]}. Tokenisation runs through `datasets.map`
with an explicit fingerprint (source rows + tokenizer + template + max_length), so a second run, or the
other ranks of a distributed job (inside `main_process_first`), reuse the cached result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from headway.train.data.batching import token_totals
from headway.train.data.config import DataConfig, DataError, as_data_config, check_data_config
from headway.train.data.conversations import BadRow, detect_format, end_of_turn_markers, normalize, tokenize_conversation
from headway.heads.files import check_text_file, first_json_error

log = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).parent / "builtin"
PIPELINE_VERSION = "1"  # bump when tokenisation or masking changes, to invalidate cached maps
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class DataStats:
    """What happened to the rows: reported in the log and returned to the caller."""

    rows: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    train_examples: int = 0
    val_examples: int = 0
    train_tokens: int = 0
    train_loss_tokens: int = 0

    def summary(self) -> str:
        why = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return (f"data: {self.rows} rows, {self.kept} kept, {self.rows - self.kept} skipped ({why}); "
                f"train {self.train_examples} examples / {self.train_tokens} tokens "
                f"({self.train_loss_tokens} assistant), val {self.val_examples} examples")


# ---------------------------------------------------------------------------------------- loading

def resolve_source(cfg: DataConfig, capture=None) -> str:
    """builtin:* names -> a local file (building the default set on first use, with the hidden states of
    `capture` (train.data.capture.FeatureCapture) stored on the way)."""
    if cfg.source == "builtin:tiny":
        return str(BUILTIN_DIR / "tiny.jsonl")
    if cfg.source == "builtin:default":
        from headway.train.data.default_set import ensure_default_dataset

        device = next(capture.target.model.parameters()).device if capture and capture.target else "cpu"
        return str(ensure_default_dataset(cfg.regen, device, capture))
    if cfg.source.startswith("builtin:"):
        raise DataError(f"unknown built-in dataset {cfg.source!r}: use builtin:tiny or builtin:default")
    return cfg.source


def load_raw(cfg: DataConfig, source: str):
    """A `datasets.Dataset` of raw rows from a local file/directory or a hub dataset name."""
    import datasets

    path = Path(source).expanduser()
    try:
        if path.is_file() or path.is_dir():
            files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in LOCAL_BUILDERS)
            builders = {LOCAL_BUILDERS.get(p.suffix) for p in files}
            if not files or None in builders or len(builders) > 1:
                raise DataError(f"data.source {source!r}: expected .json, .jsonl or .parquet files of one kind")
            text_files = [p for p in files if p.suffix != ".parquet"]
            for p in text_files:
                check_text_file(p, DataError)  # not UTF-8, or empty: with the file and line
            try:
                return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train",
                                             cache_dir=cfg.cache_dir)
            except Exception:
                where = next(filter(None, map(first_json_error, text_files)), None)
                if where:
                    raise DataError(f"data.source: {where}") from None
                raise
        if source.startswith((".", "/", "~")):
            raise DataError(f"data.source {source!r} does not exist: pass an existing file or directory")
        return datasets.load_dataset(source, cfg.subset, split=cfg.split, data_files=cfg.data_files,
                                     cache_dir=cfg.cache_dir)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"cannot load data.source {source!r}: {first}") from exc


# ------------------------------------------------------------------------------------ tokenising

def _tokenize_batch(batch: dict, tokenizer, fmt: str, max_length: int, markers) -> dict:
    """datasets.map function (batched): raw rows -> ids, mask and a skip reason ("" = kept)."""
    n = len(next(iter(batch.values())))
    out = {"input_ids": [], "loss_mask": [], "skip": []}
    for i in range(n):
        row = {k: v[i] for k, v in batch.items()}
        try:
            ids, mask = tokenize_conversation(tokenizer, normalize(row, fmt), max_length, markers)
            reason = ""
        except BadRow as bad:
            ids, mask, reason = [], [], bad.reason
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["skip"].append(reason)
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """Identifies what tokenisation produces: vocab, specials and chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    h.update(json.dumps([str(t) for t in getattr(tokenizer, "all_special_tokens", [])]).encode())
    h.update(type(tokenizer).__name__.encode())
    return h.hexdigest()[:16]


def tokenize_dataset(raw, tokenizer, cfg: DataConfig, max_length: int):
    """Raw rows -> (tokenised rows kept, Counter of skip reasons)."""
    try:
        fmt = cfg.format if cfg.format != "auto" else detect_format(raw.column_names)
    except BadRow:
        raise DataError(f"data.source {cfg.source!r} has columns {raw.column_names}: expected a 'messages' "
                        f"(role/content) or 'conversations' (from/value) column") from None
    key = "|".join([raw._fingerprint, tokenizer_fingerprint(tokenizer), fmt, str(max_length), PIPELINE_VERSION])
    tokenized = raw.map(
        _tokenize_batch, batched=True, batch_size=256, remove_columns=raw.column_names,
        fn_kwargs=dict(tokenizer=tokenizer, fmt=fmt, max_length=max_length, markers=end_of_turn_markers(tokenizer)),
        num_proc=cfg.num_proc, new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16],
        desc="tokenising conversations")
    reasons = Counter(r for r in tokenized["skip"] if r)
    kept = tokenized.filter(lambda skip: [s == "" for s in skip], input_columns="skip", batched=True,
                            new_fingerprint=hashlib.sha256((key + "|kept").encode()).hexdigest()[:16])
    return kept.remove_columns("skip"), reasons


# -------------------------------------------------------------------------------------- packing

def _pack_batch(batch: dict, max_length: int) -> dict:
    """Greedily concatenate consecutive examples into rows of at most max_length tokens."""
    out = {"input_ids": [], "loss_mask": []}
    ids, mask = [], []
    for row_ids, row_mask in zip(batch["input_ids"], batch["loss_mask"]):
        if ids and len(ids) + len(row_ids) > max_length:
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            ids, mask = [], []
        ids, mask = ids + row_ids, mask + row_mask
    if ids:
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
    return out


def pack(ds, max_length: int):
    """Packing saves padding; the target then attends across the packed conversations (as in the
    anchors' packed training), so use it only when conversations are much shorter than max_length."""
    return ds.map(_pack_batch, batched=True, batch_size=1000, fn_kwargs={"max_length": max_length},
                  desc="packing")


# ---------------------------------------------------------------------------------------- public

def split_sizes(n: int, cfg: DataConfig) -> int:
    n_val = cfg.val_size if cfg.val_size is not None else round(n * cfg.val_fraction)
    if cfg.val_size is None and cfg.val_fraction > 0 and n >= 2:
        n_val = max(n_val, 1)
    if n_val >= n:
        raise DataError(f"validation split of {n_val} leaves no training data out of {n} conversations: "
                        f"lower data.val_size / data.val_fraction")
    return n_val


def build_datasets(data_cfg, tokenizer, max_length: int, seed: int = 0, main_process_first=None,
                   return_stats: bool = False, capture=None):
    """Build (train_ds, val_ds) [+ DataStats]. `main_process_first` is `accelerator.main_process_first`
    (or any context manager / factory of one): rank 0 tokenises first, the other ranks reuse its cache.
    `capture` (train.data.capture.capture_plan): where a dataset generated here stores its hidden states."""
    cfg = as_data_config(data_cfg)
    check_data_config(cfg)
    seed = seed if cfg.split_seed is None else cfg.split_seed
    if max_length < 2:
        raise DataError(f"max_length={max_length} must be >= 2")
    guard = main_process_first() if callable(main_process_first) else main_process_first
    with guard or contextlib.nullcontext():
        raw = load_raw(cfg, resolve_source(cfg, capture))
        if cfg.max_conversations is not None and cfg.max_conversations < len(raw):
            raw = raw.shuffle(seed=seed).select(range(cfg.max_conversations))
        kept, reasons = tokenize_dataset(raw, tokenizer, cfg, max_length)
        stats = DataStats(rows=len(raw), kept=len(kept), skipped=dict(reasons))
        if len(kept) == 0:
            raise DataError(f"data.source {cfg.source!r} has no usable conversation ({stats.summary()}): "
                            f"check its schema (data.format) and content")
        n_val = split_sizes(len(kept), cfg)
        if n_val:
            parts = kept.train_test_split(test_size=n_val, seed=seed, shuffle=True)
            train_ds, val_ds = parts["train"], parts["test"]
        else:
            train_ds, val_ds = kept, kept.select([])
        if cfg.packing:
            train_ds, val_ds = pack(train_ds, max_length), pack(val_ds, max_length)
    stats.train_examples, stats.val_examples = len(train_ds), len(val_ds)
    stats.train_tokens, stats.train_loss_tokens = token_totals(train_ds)
    log.info(stats.summary())
    return (train_ds, val_ds, stats) if return_stats else (train_ds, val_ds)
