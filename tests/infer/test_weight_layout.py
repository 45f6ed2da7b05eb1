"""The CPU weight layout changes strides only: same values, same outputs, tied weights stay tied, the HF
baseline runs the stock layout, and an engine keeps the layout it was built with."""

import json

import pytest
import torch
from transformers import GenerationConfig

from headway.heads.target import load_target
from headway.infer import weight_layout
from headway.infer.calibrate import curve_path
from headway.infer.engine import EngineError, Engine
from headway.infer.hf_generate import hf_generate
from headway.infer.weight_layout import apply_layout, current_layout, layout_path, stock_layout, wide_linears


@pytest.fixture()
def target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


def logits_of(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_wide_column_keeps_values_and_outputs(target):
    model = target.model
    ids = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    before = {id(l): l.weight.detach().clone() for l in wide_linears(model)}
    reference = logits_of(model, ids)
    assert apply_layout(model, "wide-column") == "wide-column"
    wide = wide_linears(model)
    assert wide and len(wide) < sum(isinstance(m, torch.nn.Linear) for m in model.modules())  # not every layer
    for linear in wide:
        out_features, in_features = linear.weight.shape
        assert linear.weight.stride() == (1, out_features)  # column-major: W^T is contiguous
        assert torch.equal(linear.weight, before[id(linear)])
    torch.testing.assert_close(logits_of(model, ids), reference, rtol=1e-5, atol=1e-5)
    assert current_layout(model) == "wide-column"
    assert apply_layout(model, "stock") == "stock" and current_layout(model) == "stock"
    assert all(l.weight.is_contiguous() for l in wide_linears(model))


def test_tied_embeddings_stay_tied():
    model = load_target({"path": "tiny-random", "name": "tiny-tied", "tiny": {"tie_word_embeddings": True}}).model
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    reference = logits_of(model, ids)
    apply_layout(model, "wide-column")
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.weight.stride() == (1, model.config.vocab_size)
    torch.testing.assert_close(logits_of(model, ids), reference, rtol=1e-5, atol=1e-5)


def test_auto_takes_the_faster_measured_layout_and_caches_the_choice(target, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    monkeypatch.setattr(weight_layout, "measure_layouts", lambda model: {"stock": 0.060, "wide-column": 0.050})
    assert apply_layout(target.model, "auto", target) == "wide-column"
    assert current_layout(target.model) == "wide-column"
    assert json.loads(layout_path(target).read_text())["layout"] == "wide-column"

    def must_not_measure(model):
        raise AssertionError("the cached choice should have been used")
    monkeypatch.setattr(weight_layout, "measure_layouts", must_not_measure)
    assert Engine(target).weight_layout == "wide-column"


def test_auto_keeps_the_stock_layout_without_a_clear_gain(target, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    monkeypatch.setattr(weight_layout, "measure_layouts", lambda model: {"stock": 0.0500, "wide-column": 0.0495})
    assert apply_layout(target.model, "auto", target) == "stock" and current_layout(target.model) == "stock"


def test_measuring_layouts_times_both_and_leaves_the_model_as_found(target):
    apply_layout(target.model, "wide-column")
    times = weight_layout.measure_layouts(target.model, repeats=1)
    assert set(times) == {"stock", "wide-column"} and all(0 < t < 10 for t in times.values())
    assert current_layout(target.model) == "wide-column"


def test_unknown_layout_is_refused(target):
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        apply_layout(target.model, "transposed")


def test_stock_layout_restores_the_previous_layout_even_on_error(target):
    model = target.model
    apply_layout(model, "wide-column")
    with pytest.raises(RuntimeError):
        with stock_layout(model):
            assert current_layout(model) == "stock"
            raise RuntimeError("boom")
    assert current_layout(model) == "wide-column"


def test_hf_baseline_runs_the_stock_layout(target):
    model = target.model
    engine = Engine(target, weight_layout="wide-column")
    assert engine.weight_layout == "wide-column" and current_layout(model) == "wide-column"
    seen = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(current_layout(module)))
    try:
        config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=[2])
        hf_generate(model, [[5, 6, 7]], config)
    finally:
        hook.remove()
    assert seen and set(seen) == {"stock"}
    assert current_layout(model) == "wide-column"


def test_engine_restores_its_layout_and_outputs_do_not_depend_on_it(target):
    prompts = [[5, 9, 13, 40], [7, 3]]
    stock = Engine(target, weight_layout="stock")
    expected = stock.generate(prompts, max_new_tokens=10, stop_on_eos=False).tokens
    wide = Engine(target, weight_layout="wide-column")
    assert current_layout(target.model) == "wide-column"
    assert stock.generate(prompts, max_new_tokens=10, stop_on_eos=False).tokens == expected
    assert current_layout(target.model) == "stock"  # the stock engine put its layout back
    assert wide.generate(prompts, max_new_tokens=10, stop_on_eos=False).tokens == expected
    assert current_layout(target.model) == "wide-column"


def test_bad_layout_is_one_clear_error(target):
    with pytest.raises(EngineError, match="weight_layout must be one of"):
        Engine(target, weight_layout="rows")


def test_latency_curves_are_cached_per_layout(target):
    apply_layout(target.model, "stock")
    stock_path = curve_path(target)
    apply_layout(target.model, "wide-column")
    assert curve_path(target) != stock_path and "wide-column" in curve_path(target).name
