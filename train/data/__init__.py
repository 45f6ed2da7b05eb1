"""headway's data pipeline: conversations -> assistant-masked token batches -> target features.

Public API (used by the training loop and scripts/):
  DataConfig, DataError                      schema of the `data` config group, the pipeline's error
  build_datasets(cfg, tokenizer, max_length, seed, main_process_first=None, return_stats=False)
                                             -> (train_ds, val_ds[, DataStats]); items {input_ids, loss_mask}
  collate_fn(pad_id)                         -> collate(items) -> {input_ids, attention_mask, loss_mask}
  token_counts(train_ds, vocab_size)         -> LongTensor [V] over loss-masked tokens
  make_feature_source(cfg, target, layers, with_logits) -> callable(batch) -> TargetFeatures

Modules: conversations (rendering + loss mask), build (datasets), batching (collate, counts), features
(online/offline source), hidden_cache (offline cache), regenerate (self-distillation), default_set
(data=default), stdlib_prompts. Scripts: scripts/prepare_data.py, scripts/cache_hidden_states.py.
Held-out evaluation prompts belong to evaluation: infer.prompt_sets.
"""

from headway.train.data.batching import collate_fn, token_counts
from headway.train.data.build import DataStats, build_datasets
from headway.train.data.config import DataConfig, DataError, RegenConfig
from headway.train.data.features import make_feature_source

__all__ = ["DataConfig", "DataError", "DataStats", "RegenConfig", "build_datasets", "collate_fn",
           "make_feature_source", "token_counts"]
