"""Where a training step gets the frozen target's features: computed online in the step, or read back
from the offline hidden-state cache (scripts/cache_hidden_states.py). Both return the same
heads.base.TargetFeatures for the same batch."""

from __future__ import annotations

from typing import Callable

from headway.heads.base import TargetFeatures, check_layer_ids, compute_features
from headway.train.data.config import DataError, as_data_config, check_data_config

FeatureSource = Callable[[dict], TargetFeatures]


def make_feature_source(data_cfg, target, layers: list[int], with_logits: bool = False) -> FeatureSource:
    """-> callable(batch) -> TargetFeatures for hidden-state indices `layers` (+ the last one always);
    with the target's logits when `with_logits` or when the cache stores them (data.cache_logits).

    `target` is a heads.target.Target (or its HF model for online mode). `batch` is a collated batch
    (input_ids, attention_mask, loss_mask) already on the target's device."""
    cfg = as_data_config(data_cfg)
    check_data_config(cfg)
    model = getattr(target, "model", target)
    check_layer_ids(layers, model.config.num_hidden_layers)
    if cfg.hidden_states == "offline":
        if not cfg.hidden_cache:
            raise DataError("data.hidden_states=offline needs data.hidden_cache=<dir> "
                            "(build it with scripts/cache_hidden_states.py)")
        from headway.train.data.hidden_cache import OfflineFeatureSource

        return OfflineFeatureSource(cfg.hidden_cache, target, layers, with_logits,
                                    logits=cfg.cache_logits, topk=cfg.logits_topk)

    def online(batch: dict) -> TargetFeatures:
        return compute_features(model, batch["input_ids"], batch["attention_mask"], layers, with_logits)

    return online
