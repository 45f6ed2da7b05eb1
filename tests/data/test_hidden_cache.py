"""Offline hidden-state cache: same features and losses as online; resumable; mismatches are errors."""

import dataclasses
import json

import pytest
import torch
import yaml

from heads.base import build_head
from heads.target import load_target
from train.data import DataConfig, build_datasets, collate_fn, make_feature_source, token_counts
from train.data.hidden_cache import HiddenCacheError, HiddenStateCache, build_cache, read_index

LAYERS = [1, 2, 3]  # plus the last (4) always: what every head reads from the tiny target


@pytest.fixture(scope="module")
def target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    cfg = DataConfig(name="tiny", source="builtin:tiny", cache_dir=str(tmp_path_factory.mktemp("hf")), val_size=8)
    return build_datasets(cfg, target.tokenizer, 96, seed=0)


@pytest.fixture(scope="module")
def cache_dir(target, data, tmp_path_factory):
    directory = tmp_path_factory.mktemp("cache")
    build_cache(directory, target, list(data), LAYERS, batch_size=8, shard_tokens=1500, progress=False)
    return directory


def offline_cfg(directory):
    return DataConfig(name="tiny", hidden_states="offline", hidden_cache=str(directory))


def batches(ds, pad_id, size=5):
    collate = collate_fn(pad_id)
    return [collate([ds[i] for i in range(s, min(s + size, len(ds)))]) for s in range(0, len(ds), size)]


def test_offline_features_equal_online(target, data, cache_dir):
    online = make_feature_source(DataConfig(), target, LAYERS, with_logits=True)
    offline = make_feature_source(offline_cfg(cache_dir), target, LAYERS, with_logits=True)
    for batch in batches(data[0], target.tokenizer.pad_token_id)[:4] + batches(data[1], 0):
        a, b = online(batch), offline(batch)
        real = batch["attention_mask"].bool()
        assert sorted(a.hidden_states) == sorted(b.hidden_states) == [1, 2, 3, 4]
        for i in a.hidden_states:
            torch.testing.assert_close(b.hidden_states[i][real], a.hidden_states[i][real], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.logits[real], a.logits[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mtp"])
def test_offline_training_losses_equal_online(kind, target, data, cache_dir):
    options = yaml.safe_load(open(f"conf/head/{kind}.yaml"))["options"] or {}
    torch.manual_seed(0)
    head = build_head(kind, target, **options)
    head.init_from_data(token_counts(data[0], target.config.vocab_size))
    layers = head.feature_layers()
    assert set(layers) <= {1, 2, 3, 4}
    online = make_feature_source(DataConfig(), target, layers, with_logits=True)
    offline = make_feature_source(offline_cfg(cache_dir), target, layers, with_logits=True)
    for batch in batches(data[0], target.tokenizer.pad_token_id)[:3]:
        torch.manual_seed(1)  # same feature noise in both
        a = head(batch["input_ids"], batch["loss_mask"], online(batch))
        torch.manual_seed(1)
        b = head(batch["input_ids"], batch["loss_mask"], offline(batch))
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
        assert torch.equal(a.depth_correct, b.depth_correct)


def test_cache_is_sharded_indexed_and_resumable(target, data, cache_dir, tmp_path):
    index = read_index(cache_dir)
    assert len(index["shards"]) > 1 and index["layers"] == [1, 2, 3, 4] and index["dtype"] == "float32"
    assert sum(s["entries"] for s in index["shards"]) == len(data[0]) + len(data[1])
    # a killed run: only the validation split got cached, plus a half-written shard left behind
    partial = tmp_path / "c"
    build_cache(partial, target, [data[1]], LAYERS, shard_tokens=1500, progress=False)
    (partial / ".shard-00009.safetensors.tmp").write_bytes(b"torn")
    stats = build_cache(partial, target, list(data), LAYERS, shard_tokens=1500, progress=False)
    assert stats["new_entries"] == len(data[0]) and stats["entries"] == len(data[0]) + len(data[1])
    assert stats["bytes_per_token"] > 4 * 64 * 4  # 4 layers x hidden 64 x fp32, + ids and offsets
    assert build_cache(partial, target, list(data), LAYERS, progress=False)["new_entries"] == 0


def test_wrong_target_or_layers_is_an_error(target, cache_dir):
    other = load_target({"path": "tiny-random", "name": "tiny-random", "seed": 1})
    with pytest.raises(HiddenCacheError, match="was built for target"):
        make_feature_source(offline_cfg(cache_dir), other, LAYERS)
    # same spec, other weights: caught by recomputing a sample of entries
    impostor = dataclasses.replace(other, spec=target.spec)
    with pytest.raises(HiddenCacheError, match="differ from target"):
        make_feature_source(offline_cfg(cache_dir), impostor, LAYERS)
    with pytest.raises(HiddenCacheError, match=r"needs \[0\]"):
        make_feature_source(offline_cfg(cache_dir), target, [0])
    with pytest.raises(HiddenCacheError, match="missing index.json"):
        make_feature_source(offline_cfg(cache_dir / "nope"), target, LAYERS)


def test_corrupted_or_missing_data_is_an_error(target, data, cache_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(cache_dir, bad)
    shard = bad / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x40  # one flipped bit inside the hidden-state data
    shard.write_bytes(bytes(raw))
    cache = HiddenStateCache(bad, target, LAYERS)
    key = next(k for k, (n, _) in cache.entries.items() if n == 0)
    with pytest.raises(HiddenCacheError, match="corrupted"):
        cache.entry(key)
    shard.write_bytes(bytes(raw[:1000]))
    with pytest.raises(HiddenCacheError, match="truncated"):
        HiddenStateCache(bad, target, LAYERS)
    unknown = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    with pytest.raises(HiddenCacheError, match="not in the hidden-state cache"):
        HiddenStateCache(cache_dir, target, LAYERS).features(unknown["input_ids"], unknown["attention_mask"],
                                                             torch.float32)


def test_cache_hidden_states_cli(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cache"
    cmd = [sys.executable, "scripts/cache_hidden_states.py", "--out", str(out), "--validate", "2",
           "head=eagle", "experiment=smoke"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report["entries"] == 64 and report["layers"] == [4] and report["max_relative_error"] < 1e-4
    assert report["bytes_per_token"] >= 64 * 4 and report["read_tokens_per_s"] > 0
    assert read_index(out)["meta"]["head"] == "eagle"
    bad = subprocess.run(cmd[:2] + ["head=eagle", "experiment=smoke"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: say where the cache goes")
