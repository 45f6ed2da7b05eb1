"""Offline hidden-state cache: same features and losses as online; resumable; mismatches are errors."""

import dataclasses
import json

import pytest
import torch
import yaml

from headway.heads.base import build_head
from headway.heads.target import load_target
from headway.train.data import DataConfig, build_datasets, collate_fn, make_feature_source, token_counts
from headway.train.data.hidden_cache import HiddenCacheError, HiddenStateCache, build_cache, read_index

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
    # the message names the field that differs (the names and paths are the same)
    with pytest.raises(HiddenCacheError, match="another target \\(target.seed: cache 0, this run 1\\)"):
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
    script = [sys.executable, "scripts/cache_hidden_states.py", "head=eagle", "experiment=smoke"]
    done = subprocess.run(script + [f"data.hidden_cache={out}", "cache.validate=2"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report["entries"] == 64 and report["layers"] == [4] and report["max_relative_error"] < 1e-4
    assert report["bytes_per_token"] >= 64 * 4 and report["read_tokens_per_s"] > 0
    assert read_index(out)["meta"]["head"] == "eagle"
    for extra, named in ((["cache.valdate=2"], "valdate"),  # a misspelled key fails instead of being ignored
                         ([], "say where the cache goes")):
        bad = subprocess.run(script + extra, capture_output=True, text=True, timeout=600)
        errors = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: ") and named in errors[0]


# ------------------------------------------------------------------ stored target logits (cache_logits)

V = 259  # the tiny target's vocabulary


def logits_cache(target, data, directory, mode, k=64):
    return build_cache(directory, target, list(data), LAYERS, shard_tokens=1500, progress=False, logits=mode, topk=k)


@pytest.fixture(scope="module")
def logit_caches(target, data, tmp_path_factory):
    """mode name -> (directory, build report) for full, top-V (= full), top-8."""
    caches = {}
    for name, mode, k in [("full", "full", 64), ("topV", "topk", V), ("top8", "topk", 8)]:
        directory = tmp_path_factory.mktemp(name)
        caches[name] = directory, logits_cache(target, data, directory, mode, k)
    return caches


def stored_cfg(directory, mode, k=64):
    return DataConfig(name="tiny", hidden_states="offline", hidden_cache=str(directory), cache_logits=mode,
                      logits_topk=k)


def test_kl_to_target_over_the_support_of_a_top_k_target():
    from headway.heads.layers import kl_to_target

    torch.manual_seed(0)
    q = torch.randn(3, 5, 11, requires_grad=True)
    p = torch.randn(3, 5, 11)
    old = (p.log_softmax(-1).exp() * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1)
    torch.testing.assert_close(kl_to_target(q, p), old)  # finite targets: the textbook formula
    top = p.topk(4, -1)
    sparse = torch.full_like(p, float("-inf")).scatter(-1, top.indices, top.values)
    sparse[0, 0] = float("-inf")  # a row with no support (a draft vocabulary missing the whole top k)
    kl = kl_to_target(q, sparse)
    log_p = top.values.log_softmax(-1)
    ref = (log_p.exp() * (log_p - q.log_softmax(-1).gather(-1, top.indices))).sum(-1)
    torch.testing.assert_close(kl[0, 1:], ref[0, 1:])
    torch.testing.assert_close(kl[1:], ref[1:])
    assert kl[0, 0] == 0
    kl.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad[0, 0].abs().sum() == 0
    head_minus_inf = q.detach().clone()
    head_minus_inf[..., 0] = float("-inf")  # a head that cannot emit token 0 where the target never does
    sparse[..., 0] = float("-inf")
    assert torch.isfinite(kl_to_target(head_minus_inf, sparse)).all()


def test_stored_logits_read_back_as_dense_target_logits(target, data, logit_caches):
    online = make_feature_source(DataConfig(), target, LAYERS, with_logits=True)
    full = make_feature_source(stored_cfg(logit_caches["full"][0], "full"), target, LAYERS)
    top8 = make_feature_source(stored_cfg(logit_caches["top8"][0], "topk", 8), target, LAYERS)
    for batch in batches(data[0], target.tokenizer.pad_token_id)[:2]:
        ref, a, b = online(batch).logits, full(batch).logits, top8(batch).logits
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(a[real], ref[real], rtol=1e-5, atol=1e-5)
        for pad in a[~real], b[~real]:  # padding: no loss looks there, but no NaN may come from it either
            assert not pad.log_softmax(-1).isnan().any()
        kept = torch.isfinite(b[real])
        assert (kept.sum(-1) == 8).all()
        assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, ref[real].topk(8).indices, True))
        torch.testing.assert_close(b[real][kept], ref[real][kept], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,options", [("eagle", {}), ("eagle3", {}), ("medusa", {"loss": "kl"})])
def test_training_losses_from_stored_logits(kind, options, target, data, logit_caches):
    options = {**(yaml.safe_load(open(f"conf/head/{kind}.yaml"))["options"] or {}), **options}
    torch.manual_seed(0)
    head = build_head(kind, target, **options)
    head.init_from_data(token_counts(data[0], target.config.vocab_size))
    layers = head.feature_layers()
    sources = {"online": make_feature_source(DataConfig(), target, layers),  # logits from the LM head in the step
               "full": make_feature_source(stored_cfg(logit_caches["full"][0], "full"), target, layers),
               "topV": make_feature_source(stored_cfg(logit_caches["topV"][0], "topk", V), target, layers),
               "top8": make_feature_source(stored_cfg(logit_caches["top8"][0], "topk", 8), target, layers)}
    for batch in batches(data[0], target.tokenizer.pad_token_id)[:2]:
        loss = {}
        for name, source in sources.items():
            torch.manual_seed(1)  # same feature noise in all
            loss[name] = head(batch["input_ids"], batch["loss_mask"], source(batch)).loss
        torch.testing.assert_close(loss["full"], loss["online"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss["topV"], loss["full"], rtol=0, atol=0)
        assert torch.isfinite(loss["top8"]) and abs(float((loss["top8"] - loss["full"]).detach())) > 1e-4
        loss["top8"].backward()
        assert all(torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None)


def test_logit_mode_is_part_of_the_cache_identity(target, data, cache_dir, logit_caches, tmp_path):
    from headway.train.data.hidden_cache import auto_cache_dir

    top8 = logit_caches["top8"][0]
    with pytest.raises(HiddenCacheError, match="built with cache_logits=topk logits_topk=8, not cache_logits=full"):
        logits_cache(target, data, top8, "full")
    with pytest.raises(HiddenCacheError, match="logits_topk=8, not cache_logits=topk logits_topk=16"):
        logits_cache(target, data, top8, "topk", 16)
    with pytest.raises(HiddenCacheError, match="built with cache_logits=none"):
        logits_cache(target, data, cache_dir, "topk", 8)
    with pytest.raises(HiddenCacheError, match="set data.cache_logits=topk data.logits_topk=8 to read it"):
        make_feature_source(offline_cfg(top8), target, LAYERS)  # asks for none
    with pytest.raises(HiddenCacheError, match="but cache_logits=topk logits_topk=8 was asked for"):
        make_feature_source(stored_cfg(cache_dir, "topk", 8), target, LAYERS)
    with pytest.raises(HiddenCacheError, match="exceeds the target's vocabulary"):
        logits_cache(target, data, tmp_path / "big", "topk", V + 1)
    names = {auto_cache_dir(target, LAYERS, mode, k).name for mode, k in
             [("none", 8), ("none", 64), ("topk", 8), ("topk", 64), ("full", 8)]}
    assert len(names) == 4  # k only names top-k caches
    assert auto_cache_dir(target, LAYERS).name.endswith("-float32-L1_2_3_4")  # caches built before logits: reused


def test_bytes_per_token_by_logit_mode(logit_caches, cache_dir):
    none = read_index(cache_dir)
    reports = {name: report for name, (_, report) in logit_caches.items()}
    assert reports["full"]["logits"] == "cache_logits=full" and reports["full"]["logits_bytes_per_token"] == V * 4
    assert reports["top8"]["logits"] == "cache_logits=topk logits_topk=8"
    assert reports["top8"]["logits_bytes_per_token"] == 8 * (4 + 4)  # fp32 values + int32 ids
    none_bpt = sum(s["bytes"] for s in none["shards"]) / sum(s["tokens"] for s in none["shards"])
    for name in reports:  # the stored logits are what the extra bytes are
        extra = reports[name]["bytes_per_token"] - none_bpt
        assert abs(extra - reports[name]["logits_bytes_per_token"]) < 2, name


def rewrite_shard(directory, change):
    """Edit shard 0's tensors and re-sign it in the index: wrong data that checksums cannot catch."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from headway.heads.files import file_sha256

    path = directory / "shard-00000.safetensors"
    with safe_open(str(path), framework="pt") as reader:
        tensors, metadata = {k: reader.get_tensor(k) for k in reader.keys()}, reader.metadata()
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)
    index = read_index(directory)
    index["shards"][0].update(sha256=file_sha256(path), bytes=path.stat().st_size)
    (directory / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("name,field,change", [
    ("full", "logits", lambda t: t.roll(1, -1)),  # logits shifted by one token id
    ("top8", "logits.values", lambda t: t * 1.01),  # values off by 1%
    ("top8", "logits.indices", lambda t: (t + 1) % V),  # the wrong top-8 ids
])
def test_validation_catches_wrong_stored_logits(name, field, change, target, logit_caches, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(logit_caches[name][0], bad)
    cache = HiddenStateCache(bad, target, LAYERS)
    assert cache.validate(target, samples=len(cache)) < 1e-4  # intact: passes

    def edit(tensors):
        tensors[field] = change(tensors[field])

    rewrite_shard(bad, edit)
    cache = HiddenStateCache(bad, target, LAYERS)
    with pytest.raises(HiddenCacheError, match="cached logits differ from target"):
        cache.validate(target, samples=len(cache))


# ------------------------------------------------------------------ distributed build (gloo, 2 processes)

def test_two_process_build_equals_one_process_build(target, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2`: each rank caches its share, rank 0 writes one
    index; the result holds the same entries with the same features as the one-process cache."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file

    def run(launcher, out):
        cmd = launcher + ["scripts/cache_hidden_states.py", f"data.hidden_cache={out}", "cache.validate=2",
                          "cache.shard_tokens=700", "head=eagle3", "experiment=smoke"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stderr[-3000:]
        return read_index(out)

    accelerate = str(Path(sys.executable).with_name("accelerate"))
    one = run([sys.executable], tmp_path / "one")
    two = run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no"], tmp_path / "two")
    assert two["layers"] == one["layers"] and len(two["shards"]) > 1
    assert not list((tmp_path / "two").glob(".part-*"))  # the parts were moved into the one index

    def features(directory, index):
        out = {}
        for shard in index["shards"]:
            tensors = load_file(str(directory / shard["file"]))
            with safe_open(str(directory / shard["file"]), "pt") as f:
                keys = json.loads(f.metadata()["keys"])
            bounds = tensors["offsets"].tolist()
            for row, key in enumerate(keys):
                out[key] = {name: t[bounds[row]:bounds[row + 1]] for name, t in tensors.items() if name != "offsets"}
        return out

    a, b = features(tmp_path / "one", one), features(tmp_path / "two", two)
    assert set(a) == set(b) and len(a) == 64
    for key in a:
        assert torch.equal(a[key]["input_ids"], b[key]["input_ids"])
        for name in a[key]:  # batches differ (other rows, other padding): float rounding only
            x, y = a[key][name].double(), b[key][name].double()
            err = (x - y).norm() / x.norm().clamp(min=1e-30)
            assert err < 1e-5, (key, name, float(err))


def test_validation_allows_bf16_computed_shards_bf16_error_only(target, cache_dir, tmp_path):
    """States off by ~1% (what a bf16 copy of the target computes) fail the fp32 check unless their shard
    records that it was computed in bf16."""
    import shutil

    def perturb(tensors):
        gen = torch.Generator().manual_seed(0)
        for name in [n for n in tensors if n.startswith("hidden.")]:
            t = tensors[name]
            scale = t.norm(dim=-1, keepdim=True) / t.shape[-1] ** 0.5  # each row's RMS
            tensors[name] = t + 0.01 * scale * torch.randn(t.shape, generator=gen)

    for mark in (False, True):
        copy = tmp_path / f"marked-{mark}"
        shutil.copytree(cache_dir, copy)
        rewrite_shard(copy, perturb)
        if mark:
            index = read_index(copy)
            index["shards"][0]["computed_in"] = "bfloat16"
            (copy / "index.json").write_text(json.dumps(index))
        cache = HiddenStateCache(copy, target, LAYERS)
        if mark:
            assert 1e-3 < cache.validate(target, samples=len(cache)) < 5e-2
        else:
            with pytest.raises(HiddenCacheError, match=r"relative error .* > 0.0001"):
                cache.validate(target, samples=len(cache))


def test_cache_pass_in_bf16_is_marked_close_and_validated(target, data, cache_dir, tmp_path):
    """data.cache_precision=bf16: a bf16 copy of the fp32 target computes the states (stored in the cache's fp32),
    every shard says so, they sit within bf16's error of the fp32 pass, validation accepts them, and the target
    is its fp32 self again afterwards."""
    model = target.model
    build_cache(tmp_path, target, list(data), LAYERS, batch_size=8, shard_tokens=1500, progress=False,
                precision="bf16")
    assert target.model is model and next(model.parameters()).dtype == torch.float32
    index = read_index(tmp_path)
    assert index["dtype"] == "float32" and {s.get("computed_in") for s in index["shards"]} == {"bfloat16"}
    assert all("computed_in" not in s for s in read_index(cache_dir)["shards"])  # the fp32 pass: unmarked
    fp32, bf16 = HiddenStateCache(cache_dir, target, LAYERS), HiddenStateCache(tmp_path, target, LAYERS)
    assert sorted(bf16.keys()) == sorted(fp32.keys())
    errors = []
    for key in fp32.keys():
        ids, want = fp32.entry(key)
        got_ids, got = bf16.entry(key)
        assert torch.equal(got_ids, ids)
        errors += [float((got[i] - want[i]).norm() / want[i].norm()) for i in want]
    assert 1e-4 < max(errors) < 5e-2  # bf16's rounding, not fp32's, and not more
    assert bf16.validate(target, samples=len(bf16)) < 5e-2
