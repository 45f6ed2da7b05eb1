"""The many-row GEMM choice (heads/kernels/gemm.py): both libraries compute the same x . W^T, autograd keeps
F.linear, the measured choice is cached per CPU and thread count, and a cache from another CPU is measured again."""

import json

import pytest
import torch
import torch.nn.functional as F

from headway.heads.kernels import gemm
from headway.heads.kernels.machine_choice import cpu_name

NEEDS_ONEDNN = pytest.mark.skipif(not gemm.onednn_available(), reason="torch built without oneDNN")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    gemm._chosen.cache_clear()
    yield tmp_path
    gemm._chosen.cache_clear()


@pytest.mark.parametrize("backend", ["mkl", pytest.param("onednn", marks=NEEDS_ONEDNN)])
def test_both_backends_compute_the_linear(backend):
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 70, 96, generator=gen), torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    with torch.inference_mode(), gemm.forced_backend(backend):
        out = gemm.many_rows_linear(x, w, b)
        no_bias = gemm.many_rows_linear(x[:, ::2], w, None)  # a non-contiguous input
    assert out.shape == (3, 70, 200)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(no_bias, F.linear(x[:, ::2], w), rtol=1e-5, atol=1e-4)


@NEEDS_ONEDNN
def test_autograd_takes_f_linear():
    x, w = torch.randn(40, 8), torch.randn(16, 8, requires_grad=True)
    with gemm.forced_backend("onednn"):
        gemm.many_rows_linear(x, w, None).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(16, 40) @ x)  # d sum(x W^T) / dW


def test_unknown_backend_is_one_error():
    with pytest.raises(ValueError, match="must be one of mkl, onednn"):
        with gemm.forced_backend("blas"):
            pass


def test_choice_is_cached_and_remeasured_on_another_cpu(cache, monkeypatch):
    calls = []
    real = gemm.measure
    monkeypatch.setattr(gemm, "measure", lambda: calls.append(1) or real(shapes=((8, 16, 16),), repeats=1))
    first = gemm.choose_backend()
    assert first in gemm.BACKENDS and len(calls) >= 1
    record = json.loads(gemm.choice_path().read_text()) if gemm.choice_path().exists() else None
    if record is None:  # the machine was busy: used, not cached; force caches it
        gemm.choose_backend(force=True)
        record = json.loads(gemm.choice_path().read_text())
    assert record["cpu"] == cpu_name() and record["choice"] in gemm.BACKENDS and "quality" in record
    calls.clear()
    gemm._chosen.cache_clear()
    assert gemm.choose_backend() == record["choice"] and not calls  # read back, not measured
    record["cpu"] = "another CPU"
    gemm.choice_path().write_text(json.dumps(record))
    gemm._chosen.cache_clear()
    gemm.choose_backend()
    assert calls  # a choice made on another CPU is measured again


def test_choice_follows_the_measured_times(cache, monkeypatch):
    if not gemm.onednn_available():
        pytest.skip("torch built without oneDNN")
    fast_onednn = {"mkl": [[2.0] * 3], "onednn": [[1.0] * 3]}
    monkeypatch.setattr(gemm, "measure", lambda: fast_onednn)
    assert gemm.choose_backend(force=True) == "onednn"
    close = {"mkl": [[1.05] * 3], "onednn": [[1.0] * 3]}  # within MIN_GAIN: the stock library stays
    monkeypatch.setattr(gemm, "measure", lambda: close)
    assert gemm.choose_backend(force=True) == "mkl"


def test_many_rows_routes_stock_linears_for_the_block_only():
    from headway.heads.base import compute_features
    from headway.heads.target import load_target

    model = load_target({"path": "tiny-random", "name": "tiny-random"}).model
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model(input_ids=ids, output_hidden_states=True).hidden_states
        with gemm.many_rows(model):
            seen = [vars(m).get("forward") for m in model.modules() if isinstance(m, torch.nn.Linear)]
        features = compute_features(model, ids, None, [1, 2])
    assert seen and all(isinstance(f, gemm.ManyRowsForward) for f in seen)
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))  # restored
    for i in (1, 2):
        torch.testing.assert_close(features.hidden_states[i], reference[i], rtol=1e-5, atol=1e-5)
