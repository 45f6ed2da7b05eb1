"""Hidden-state cache entries written while the data is generated: data and features from one pass.

When training reads features offline from the automatic cache (data.hidden_states=offline, no
data.hidden_cache, logits recomputed from the last hidden state), the default dataset's generation keeps the
target's hidden states of every conversation it writes and stores them in that very cache, keyed exactly
as training will look them up: the hash of the conversation's training token ids (its chat-template
rendering, split at the assistant spans, truncated to train.max_length). The cache pass that follows in
training finds them there and computes only what is missing (rows whose reply re-tokenises differently,
multi-turn rows whose earlier rounds were not captured, entries of a killed run not yet flushed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from headway.train.data.conversations import BadRow, end_of_turn_markers, tokenize_conversation
from headway.train.data.decode import Tap

SHARD_TOKENS = 1 << 15  # small shards: a killed generation loses little of its capture


@dataclass
class FeatureCapture:
    """Where and what to capture: a hidden-state cache directory, its hidden-state indices (the last one
    included), the training sequence length, and the loaded target the cache is for."""

    directory: Path
    layers: list[int]
    max_length: int
    target: object = None
    dtype: object = None  # the cache's dtype (the target's); None: the generating model's


def capture_plan(data_cfg, target, layers: list[int], max_length: int) -> FeatureCapture | None:
    """The capture that makes training's automatic offline cache complete, or None when training will not
    read one (online features, a cache of the user's own, or stored logits, which generation does not keep)."""
    if data_cfg.hidden_states != "offline" or data_cfg.hidden_cache or data_cfg.cache_logits != "none":
        return None
    from headway.train.data.hidden_cache import auto_cache_dir

    wanted = sorted(set(layers) | {target.config.num_hidden_layers})
    return FeatureCapture(auto_cache_dir(target, wanted), wanted, max_length, target,
                          next(target.model.parameters()).dtype)


class CaptureSession:
    """A cache writer on a target, and the taps that feed it from decoding."""

    def __init__(self, capture: FeatureCapture, target):
        from headway.train.data.hidden_cache import CacheWriter

        self.tokenizer = target.tokenizer
        self.max_length = capture.max_length
        self.markers = end_of_turn_markers(self.tokenizer)
        computed = next(target.model.parameters()).dtype  # a bf16 copy's while data is generated in bf16
        dtype = capture.dtype or computed
        self.writer = CacheWriter(capture.directory, target, capture.layers, dtype, SHARD_TOKENS,
                                  {"source": "captured during data generation", "max_length": capture.max_length})
        if computed != dtype:
            self.writer.computed_in = str(computed).removeprefix("torch.")
        self.layers = self.writer.layers
        self.captured = 0

    def tap(self, histories: list[list[dict] | None]) -> Tap:
        """A tap for one decode call; histories[b]: row b's conversation before its reply (None: skip)."""
        from headway.train.data.hidden_cache import row_key

        def training_ids(b: int, new_ids: list[int], finished: bool) -> list[int] | None:
            if histories[b] is None:
                return None
            reply = self.tokenizer.decode(new_ids, skip_special_tokens=True).strip()
            try:
                ids, _ = tokenize_conversation(self.tokenizer, histories[b] + [{"role": "assistant", "content": reply}],
                                               self.max_length, self.markers)
            except BadRow:
                return None
            return None if row_key(ids) in self.writer else ids

        def done(b: int, ids, hidden) -> None:
            key = row_key(ids)
            if key not in self.writer:
                self.writer.add(key, ids, hidden)
                self.captured += 1

        return Tap(self.layers, training_ids, done)

    def flush(self) -> None:
        self.writer.flush()
