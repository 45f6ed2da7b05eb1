"""The CPU weight layout changes strides only: same values, same outputs, tied weights stay tied, the HF
baseline runs the stock layout, and an engine keeps the layout it was built with."""

import json
from contextlib import contextmanager

import pytest
import torch
from transformers import GenerationConfig

from headway.heads.target import load_target
from headway.heads.kernels import panel
from headway.heads.kernels import quiet as quiet_module
from headway.heads.kernels import weight_layout
from headway.infer.calibrate import curve_path
from headway.infer.engine import EngineError, Engine
from headway.infer.hf_generate import hf_generate
from headway.heads.kernels.weight_layout import apply_layout, current_layout, layout_path, stock_layout, wide_linears


NEEDS_PANEL = pytest.mark.skipif(panel.unavailable_reason() is not None,
                                 reason=f"panel layout: {panel.unavailable_reason()}")


@pytest.fixture()
def target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


def logits_of(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


def apply_keeping_logits(model, layout: str):
    """Apply `layout`, check the logits did not change; -> (ids, the stock logits) for later checks."""
    ids = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    reference = logits_of(model, ids)
    assert apply_layout(model, layout) == layout and current_layout(model) == layout
    torch.testing.assert_close(logits_of(model, ids), reference, rtol=1e-5, atol=1e-5)
    return ids, reference


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


def samples(**per_layout):
    """measure_layouts' result: layout -> rows -> repeated timings, from layout=(T(1), T(8))."""
    return lambda model: {k.replace("_", "-"): {1: [t1] * 3, 8: [t8] * 3} for k, (t1, t8) in per_layout.items()}


@pytest.fixture()
def quiet(monkeypatch):
    """The layout measurement sees a quiet machine (the real one may be busy running other tests)."""
    @contextmanager
    def quiet_watch():
        yield FakeWatch(0.0)
    monkeypatch.setattr(weight_layout, "watch", quiet_watch)
    monkeypatch.setattr(quiet_module, "MAX_SPREAD", float("inf"))


class FakeWatch(quiet_module.Watch):
    def __init__(self, other_cpu):
        self.other_cpu = other_cpu


def test_auto_takes_the_least_decode_plus_tree_time_and_caches_the_choice(target, tmp_path, monkeypatch, quiet):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    monkeypatch.setattr(weight_layout, "measure_layouts",
                        samples(stock=(0.050, 0.100), wide_column=(0.045, 0.110), packed=(0.052, 0.070)))
    assert apply_layout(target.model, "auto", target) == "packed"
    assert current_layout(target.model) == "packed"
    record = json.loads(layout_path(target).read_text())
    assert record["layout"] == "packed" and record["forward_s"]["packed"] == {"1": 0.052, "8": 0.070}
    assert record["quality"]["noisy"] is False and record["quality"]["measured_at"]

    def must_not_measure(model):
        raise AssertionError("the cached choice should have been used")
    monkeypatch.setattr(weight_layout, "measure_layouts", must_not_measure)
    assert Engine(target).weight_layout == "packed"


def test_auto_keeps_the_stock_layout_without_a_clear_gain(target, tmp_path, monkeypatch, quiet):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    monkeypatch.setattr(weight_layout, "measure_layouts",
                        samples(stock=(0.050, 0.100), wide_column=(0.0495, 0.100), packed=(0.050, 0.099)))
    assert apply_layout(target.model, "auto", target) == "stock" and current_layout(target.model) == "stock"


def test_a_disturbed_measurement_is_retaken_and_not_cached(target, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    calls = []

    @contextmanager
    def busy_watch():
        calls.append(1)
        yield FakeWatch(0.6)  # another process took 60% of the CPU
    monkeypatch.setattr(weight_layout, "watch", busy_watch)
    monkeypatch.setattr(weight_layout, "measure_layouts", samples(stock=(0.05, 0.1), wide_column=(0.04, 0.09)))
    assert apply_layout(target.model, "auto", target) == "wide-column"  # used for this run ...
    assert len(calls) == 3 and not layout_path(target).exists()  # ... measured three times, not cached
    assert "not cached" in capsys.readouterr().out
    assert weight_layout.choose_layout(target, force=True) == "wide-column"  # force caches it anyway
    assert json.loads(layout_path(target).read_text())["quality"]["noisy"] is True


def test_a_choice_cached_before_the_packed_layout_is_measured_again(target, tmp_path, monkeypatch, quiet):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    layout_path(target).parent.mkdir(parents=True)
    layout_path(target).write_text(json.dumps({"layout": "wide-column", "decode_step_s": {}}))
    monkeypatch.setattr(weight_layout, "measure_layouts", samples(stock=(0.05, 0.1), packed=(0.05, 0.05)))
    assert apply_layout(target.model, "auto", target) == "packed"


def test_measuring_layouts_times_each_candidate_and_leaves_the_model_as_found(target):
    apply_layout(target.model, "wide-column")
    times = weight_layout.measure_layouts(target.model, repeats=2)
    assert set(times) == set(weight_layout.candidates(target.model)) >= {"stock", "wide-column", "packed"}
    assert all(len(s) == 2 and all(0 < t < 10 for t in s) for per in times.values() for s in per.values())
    assert current_layout(target.model) == "wide-column"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 64, 65, 100])
def test_packed_linear_equals_the_stock_one_for_any_row_count(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(48, 80, bias=True)
    x = torch.randn(rows, 48)
    reference = linear(x)
    weight_layout._pack(linear)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x.view(1, rows, 48)), reference.view(1, rows, 80), rtol=1e-5, atol=1e-5)
    assert set(linear.packed_weights) <= set(weight_layout.PACK_BUCKETS)
    assert bool(linear.packed_weights) == (3 <= rows <= 64)  # packed only for the buckets' row counts
    out = linear(x)  # with autograd on, the plain path (the packed kernel has no backward)
    out.sum().backward()
    assert linear.weight.grad is not None


def test_packed_keeps_outputs_and_its_packs_across_a_stock_interlude(target):
    model = target.model
    ids, reference = apply_keeping_logits(model, "packed")
    packs = {id(l): dict(l.packed_weights) for l in weight_layout._linears(model)}
    assert all(packs.values())  # 22 rows: the 32-row bucket was packed
    with stock_layout(model):
        assert current_layout(model) == "stock" and "forward" not in vars(model.lm_head)
    assert current_layout(model) == "packed"
    assert all(l.packed_weights == packs[id(l)] for l in weight_layout._linears(model))  # not packed again
    apply_layout(model, "wide-column")
    assert current_layout(model) == "wide-column"
    torch.testing.assert_close(logits_of(model, ids), reference, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("layout", ["wide-column", "packed", pytest.param("panel", marks=NEEDS_PANEL)])
def test_engine_restores_its_layout_and_outputs_do_not_depend_on_it(target, layout):
    prompts = [[5, 9, 13, 40], [7, 3]]
    stock = Engine(target, weight_layout="stock")
    expected = stock.generate(prompts, max_new_tokens=10, stop_on_eos=False).tokens
    other = Engine(target, weight_layout=layout)
    assert current_layout(target.model) == layout
    assert stock.generate(prompts, max_new_tokens=10, stop_on_eos=False).tokens == expected
    assert current_layout(target.model) == "stock"  # the stock engine put its layout back
    assert other.generate(prompts, max_new_tokens=10, stop_on_eos=False).tokens == expected
    assert current_layout(target.model) == layout


def test_bad_layout_is_one_clear_error(target):
    with pytest.raises(EngineError, match="weight_layout must be one of"):
        Engine(target, weight_layout="rows")


def test_latency_curves_are_cached_per_layout(target):
    apply_layout(target.model, "stock")
    stock_path = curve_path(target)
    apply_layout(target.model, "wide-column")
    assert curve_path(target) != stock_path and "wide-column" in curve_path(target).name


def test_a_new_panel_kernel_does_not_reuse_the_curve_of_an_older_one(target, monkeypatch):
    import headway.infer.calibrate as calibrate

    monkeypatch.setattr(calibrate, "current_layout", lambda model: "panel")
    monkeypatch.setattr(calibrate.panel_kernel, "source_tag", lambda: "kernel-a")
    old = curve_path(target)
    monkeypatch.setattr(calibrate.panel_kernel, "source_tag", lambda: "kernel-b")
    assert curve_path(target) != old and "panel-kernel-b" in curve_path(target).name


def test_a_packed_model_can_be_deep_copied_and_pickled(target):
    import copy
    import io

    model = target.model
    apply_layout(model, "packed")
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    reference = logits_of(model, ids)  # packs the 16-row bucket
    twin = copy.deepcopy(model)
    assert current_layout(twin) == "packed" and not twin.lm_head.packed_weights
    torch.testing.assert_close(logits_of(twin, ids), reference, rtol=1e-5, atol=1e-5)
    buffer = io.BytesIO()
    torch.save(twin, buffer)
    assert not torch.load(io.BytesIO(buffer.getvalue()), weights_only=False).lm_head.packed_weights


@NEEDS_PANEL
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("shape", [(48, 80), (37, 200), (64, 48)])
def test_panel_linear_equals_the_stock_one_for_any_row_count_and_shape(rows, shape):
    """Any in/out size (a last panel only partly used, an input width that is no multiple of 16), 2 to 32
    rows through the kernel (8 rows per pass, then the rest), 1 through the kernel or F.linear (as measured
    here), more than 32 through the many-row GEMM; the bias is added."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(*shape, bias=rows % 2 == 1)
    x = torch.randn(rows, shape[0])
    reference = linear(x)
    panel.use_panels(linear)
    assert linear.panels.shape == (-(-shape[1] // 48), shape[0], 48)
    bias = 0 if linear.bias is None else linear.bias
    torch.testing.assert_close(panel.kernel().panel_linear(x, linear.panels, shape[1]) + bias, reference,
                               rtol=1e-5, atol=1e-5)  # the kernel itself, at every row count
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x.view(1, rows, -1)), reference.view(1, rows, -1), rtol=1e-5, atol=1e-5)
    linear(x).sum().backward()  # with autograd on, the plain path (the kernel has no backward)
    assert linear.weight.grad is not None


@NEEDS_PANEL
def test_panel_copy_follows_a_weight_changed_in_place():
    linear = torch.nn.Linear(32, 96, bias=False)
    panel.use_panels(linear)
    x = torch.randn(4, 32)
    with torch.no_grad():
        linear.weight.mul_(2)
        torch.testing.assert_close(linear(x), x @ linear.weight.T, rtol=1e-5, atol=1e-5)


@NEEDS_PANEL
def test_panel_layout_keeps_outputs_and_survives_copy_and_pickle(target):
    import copy
    import io

    model = target.model
    ids, reference = apply_keeping_logits(model, "panel")
    with stock_layout(model):
        assert current_layout(model) == "stock"
    assert current_layout(model) == "panel"
    twin = copy.deepcopy(model)
    assert current_layout(twin) == "panel"
    torch.testing.assert_close(logits_of(twin, ids), reference, rtol=1e-5, atol=1e-5)
    buffer = io.BytesIO()
    torch.save(twin, buffer)
    torch.testing.assert_close(logits_of(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False), ids),
                               reference, rtol=1e-5, atol=1e-5)


def test_panel_layout_where_it_cannot_run_is_one_clear_error(target, monkeypatch):
    monkeypatch.setattr(panel, "unavailable_reason", lambda: "needs AVX-512 or AVX2 (this CPU: DEFAULT)")
    assert "panel" not in weight_layout.candidates(target.model)
    with pytest.raises(ValueError, match="weight_layout=panel needs .*AVX-512"):
        apply_layout(target.model, "panel")


@NEEDS_PANEL
@pytest.mark.parametrize("path", ["kernel", "mkl"])
def test_one_row_goes_where_the_machine_choice_says(path, monkeypatch):
    """One row through the panel kernel or MKL's GEMV, as chosen: the same product either way."""
    linear = torch.nn.Linear(200, 100)
    x = torch.randn(1, 200)
    reference = linear(x)
    panel.use_panels(linear)
    calls = []
    real = panel.kernel()

    class Counting:
        def panel_linear(self, *args):
            calls.append(1)
            return real.panel_linear(*args)

    monkeypatch.setattr(panel, "kernel", lambda: Counting())
    with torch.inference_mode(), panel.forced_one_row_path(path):
        torch.testing.assert_close(linear(x), reference, rtol=1e-5, atol=1e-5)
    assert bool(calls) == (path == "kernel")
    with pytest.raises(ValueError, match="must be one of mkl, kernel"):
        with panel.forced_one_row_path("gemv"):
            pass


@NEEDS_PANEL
def test_one_row_choice_follows_the_measured_times_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    monkeypatch.setattr(panel, "_forced", [])
    record = tmp_path / "calibration" / f"gemv-cpu{torch.get_num_threads()}.json"
    measured = []
    for times, expected in [({"mkl": [[3.0] * 3], "kernel": [[1.0] * 3]}, "kernel"),
                            ({"mkl": [[1.05] * 3], "kernel": [[1.0] * 3]}, "mkl")]:  # within the gain: MKL stays
        monkeypatch.setattr(panel, "measure_one_row", lambda times=times: measured.append(1) or times)
        assert panel.one_row_path(force=True) == expected
        assert json.loads(record.read_text())["choice"] == expected
    measured.clear()
    panel._one_row_path.cache_clear()
    assert panel.one_row_path() == "mkl" and not measured  # read back, not measured again
    panel._one_row_path.cache_clear()


@NEEDS_PANEL
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_draft_head_runs_through_panels_under_a_cpu_kernel_layout(kind):
    """Under panel (or blocks, tiles) the engine routes the head's own Linears through the panel kernel too;
    greedy output still equals plain decoding. Under stock the head is left as it is."""
    from headway.heads.base import build_head
    from headway.infer.calibrate import TreeBudget
    from headway.infer.drafters import build_drafter

    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 4)]
    plain = Engine(target, weight_layout="panel").generate(prompts, max_new_tokens=16, stop_on_eos=False).tokens
    for layout in ("stock", "panel"):
        torch.manual_seed(0)
        head = build_head(kind, target)
        drafter = build_drafter("head", target, head=head, policy="dynamic", total_tokens=6, depth=3, top_k=2)
        engine = Engine(target, drafter, block_size=4, budget=TreeBudget(), weight_layout=layout)
        with panel.forced_one_row_path("kernel"):
            out = engine.generate(prompts, max_new_tokens=16, stop_on_eos=False)
        linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(panel.uses_panels(m) == (layout == "panel") for m in linears), layout
        if layout == "panel":
            assert out.tokens == plain
