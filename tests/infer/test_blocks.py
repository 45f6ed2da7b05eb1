"""The blocks layout reads a GGUF target's Linear weights from their Q4_1/Q8_0 codes: the values rebuilt
are the dequantizer's bit for bit, the kernel equals F.linear on them at every row count, matching is by
value (rows in any order, one changed value refuses the match), and the engine's greedy output under the
layout equals the stock layout's."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from headway.heads.target import load_target, local_gguf
from headway.heads.kernels import blocks, gemm, panel, tiles
from headway.infer.engine import Engine
from headway.heads.kernels.weight_layout import _linears, apply_layout, candidates, current_layout

pytestmark = pytest.mark.skipif(blocks.unavailable_reason() is not None or panel.unavailable_reason() is not None,
                                reason=f"blocks layout: {blocks.unavailable_reason()}")

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> None:
    writer = GGUFWriter(str(path), "llama")
    for name, (values, kind) in tensors.items():
        writer.add_tensor(name, gguf_quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized_target(path, permuted: str = "model.layers.0.self_attn.q_proj"):
    """The tiny random target as if loaded from a GGUF file: every Linear quantized (the read-out Q8_0, the
    rest Q4_1) into `path`, its fp32 weights set to the dequantized values; `permuted`'s rows are stored
    in reverse order in the file (transformers reorders q/k rows of GGUF Llamas)."""
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    tensors = {}
    for name, module in target.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            kind = Q8_0 if name == "lm_head" else Q4_1
            values = gguf_dequantize(gguf_quantize(module.weight.detach().numpy(), kind), kind)
            module.weight.data = torch.from_numpy(values.copy())
            tensors[name] = (values[::-1].copy() if name == permuted else values, kind)
    write_gguf(path, tensors)
    target.model.gguf_source = str(path)
    return target


@pytest.fixture()
def target(tmp_path):
    return quantized_target(tmp_path / "tiny.gguf")


# the layouts that read a GGUF target's codes: blocks (AVX-512) and tiles (AMX, where the CPU has it)
CODE_LAYOUTS = ["blocks", pytest.param("tiles", marks=pytest.mark.skipif(
    tiles.unavailable_reason() is not None, reason=f"tiles layout: {tiles.unavailable_reason()}"))]


@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
def test_decoded_codes_rebuild_the_dequantized_values_bit_for_bit(tmp_path, kind):
    values = np.random.default_rng(0).standard_normal((7, 96)).astype(np.float32) * 3
    write_gguf(tmp_path / "t.gguf", {"w": (values, kind)})
    tensor = GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    codes, scales, offsets = (torch.from_numpy(a) for a in blocks.decode_tensor(tensor))
    assert codes.shape == (7, 96) and scales.shape == offsets.shape == (7, 3)
    expected = torch.from_numpy(gguf_dequantize(np.asarray(tensor.data), kind).reshape(7, 96))
    assert torch.equal(blocks.dequantize(codes, scales, offsets), expected)


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("shape", [(64, 80), (96, 48), (32, 200)])
def test_kernel_equals_f_linear_on_the_dequantized_weight(rows, shape):
    """Any output size (a last panel partly used), 1..32 rows (8 per pass, then the rest)."""
    K, N = shape
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 16, (N, K), generator=g).to(torch.int8)
    scales = torch.rand(N, K // 32, generator=g).half().float()
    offsets = -torch.rand(N, K // 32, generator=g).half().float()
    weight = blocks.dequantize(codes, scales, offsets)
    x = torch.randn(rows, K, generator=g)
    out = blocks.kernel().blocks_linear(x, panel.to_panels(codes), panel.to_panels(scales),
                                        panel.to_panels(offsets), N)
    exact = x.double() @ weight.double().T  # [rows, N]
    bound = 1e-5 * (x.abs() @ weight.abs().T).double()  # fp32 rounding of a K-term sum, any order
    assert bool(((out.double() - exact).abs() <= bound).all())
    assert bool(((F.linear(x, weight).double() - exact).abs() <= bound).all())  # the bound is one F.linear meets


def test_kernel_rebuilds_each_weight_exactly():
    """One-hot rows read single weights out: the kernel's in-register d * q + m is the dequantizer's value
    bit for bit (codes, scales and offsets laid out in the panels the kernel expects)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (80, 64), generator=g).to(torch.int8)
    scales = (torch.rand(80, 2, generator=g) / 7).half().float()
    offsets = -(torch.rand(80, 2, generator=g) / 3).half().float()
    weight = blocks.dequantize(codes, scales, offsets)  # [80, 64]
    panels = [panel.to_panels(t) for t in (codes, scales, offsets)]
    for first in (0, 32):
        one_hot = torch.eye(64)[first:first + 32]  # [32, 64]
        assert torch.equal(blocks.kernel().blocks_linear(one_hot, *panels, 80), weight[:, first:first + 32].T)


def test_every_linear_is_matched_by_value_rows_in_any_order(target):
    found = blocks.model_blocks(target.model, _linears(target.model))
    assert set(found) == set(_linears(target.model))
    q_proj = target.model.model.layers[0].self_attn.q_proj
    codes, scales, offsets = (panel.from_panels(t, q_proj.out_features) for t in
                              (found[q_proj].codes, found[q_proj].scales, found[q_proj].offsets))
    assert torch.equal(blocks.dequantize(codes, scales, offsets), q_proj.weight)  # the file's rows reversed back


def test_a_weight_that_differs_in_one_value_is_not_matched(target):
    down = target.model.model.layers[1].mlp.down_proj
    down.weight.data[3, 5] += 1e-3
    target.model.__dict__.pop("_block_weights", None)
    found = blocks.model_blocks(target.model, _linears(target.model))
    assert down not in found and len(found) == len(_linears(target.model)) - 1


@pytest.mark.parametrize("layout", CODE_LAYOUTS)
def test_blocks_layout_keeps_outputs_and_engine_tokens(target, layout):
    model = target.model
    ids = torch.randint(3, 200, (2, 70), generator=torch.Generator().manual_seed(0))
    prompts = [[5, 9, 13, 40], [7, 3]]
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
    expected = Engine(target, weight_layout="stock").generate(prompts, max_new_tokens=12, stop_on_eos=False).tokens
    assert layout in candidates(model)
    engine = Engine(target, weight_layout=layout)
    assert current_layout(model) == layout and all(blocks.uses_blocks(l) for l in _linears(model))
    backends = ["mkl"] + (["onednn"] if gemm.onednn_available() else [])
    with torch.inference_mode():
        for backend in backends:  # a prefill past the kernel's rows takes either many-row GEMM
            with gemm.forced_backend(backend):
                for width in (1, 5, 11, 70):  # a decode step, a tree, prefills (140 rows: past every kernel's)
                    torch.testing.assert_close(model(input_ids=ids[:, :width]).logits, reference[:, :width],
                                               rtol=1e-4, atol=1e-4)
    assert engine.generate(prompts, max_new_tokens=12, stop_on_eos=False).tokens == expected


@pytest.mark.parametrize("layout", CODE_LAYOUTS)
def test_a_weight_changed_after_matching_takes_the_stock_path(target, layout):
    apply_layout(target.model, layout)
    linear = target.model.model.layers[0].mlp.up_proj
    x = torch.randn(3, linear.in_features)
    with torch.no_grad():
        linear.weight.mul_(2)
        torch.testing.assert_close(linear(x), x @ linear.weight.T, rtol=1e-5, atol=1e-5)


def test_blocks_survive_a_round_trip_through_other_layouts(target):
    """wide-column stores some weights column-major and stock copies them back: new storage, same values."""
    model = target.model
    apply_layout(model, "blocks")
    for layout in ("wide-column", "packed", "stock", "blocks"):
        apply_layout(model, layout)
    linears = _linears(model)
    assert all(blocks.uses_blocks(l) for l in linears)
    assert all(l.block_weights.stamp == (l.weight.data_ptr(), l.weight._version) for l in linears)


def test_without_a_gguf_file_the_layout_is_not_offered_and_asking_is_one_clear_error():
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    assert "blocks" not in candidates(target.model)
    with pytest.raises(ValueError, match="weight_layout=blocks needs a target loaded from a block-quantized GGUF"):
        apply_layout(target.model, "blocks")


def test_the_gguf_file_of_a_local_folder_is_found(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert local_gguf(str(tmp_path), "m.gguf", None) == str(tmp_path / "m.gguf")
    assert local_gguf(str(tmp_path), "other.gguf", None) is None
    assert local_gguf("./no/such/folder", "m.gguf", None) is None


def test_a_gguf_file_that_cannot_be_read_offers_no_blocks_and_does_not_crash(tmp_path):
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    (tmp_path / "damaged.gguf").write_bytes(b"GGUF" + bytes(60))
    target.model.gguf_source = str(tmp_path / "damaged.gguf")
    assert "blocks" not in candidates(target.model)
    assert Engine(target).generate([[5, 6, 7]], max_new_tokens=3).tokens  # auto picks among the others


def test_switching_to_blocks_drops_the_panel_copies(target):
    apply_layout(target.model, "panel")
    assert all("panels" in vars(l) for l in _linears(target.model))
    apply_layout(target.model, "blocks")
    assert not any("panels" in vars(l) for l in _linears(target.model))
    apply_layout(target.model, "panel")  # made again when needed
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    assert all("panels" in vars(l) for l in _linears(target.model))


@pytest.mark.parametrize("layout", CODE_LAYOUTS)
def test_a_heads_draft_vocabulary_reads_the_target_read_out_from_its_codes(target, layout):
    """EAGLE drafts through the target's LM head restricted to its draft vocabulary: under the blocks (and tiles)
    layout those rows come from the GGUF codes (the same values), through the blocks kernel."""
    from headway.heads.base import build_head

    head = build_head("eagle", target).eval()
    head.set_draft_vocab(40)
    hidden = torch.randn(2, 3, target.model.config.hidden_size)  # [B, T, h]
    lm_head = head.frozen["lm_head"]
    with torch.inference_mode():
        expected = head.readout(hidden, lm_head)  # [B, T, V]: fp32 rows, stock layout
        apply_layout(target.model, layout)
        logits = head.readout(hidden, lm_head)
    subsets = [rows for rows, _ in head._rows.values() if isinstance(rows, blocks.RowSubset)]
    assert len(subsets) == 1 and len(subsets[0].rows) == 40
    kept = torch.isfinite(expected) & (expected > torch.finfo(expected.dtype).min)  # the draft vocabulary's slots
    assert int(kept.sum()) == 2 * 3 * 40
    torch.testing.assert_close(logits[kept], expected[kept], rtol=1e-5, atol=1e-5)
    assert torch.equal(kept, torch.isfinite(logits) & (logits > torch.finfo(logits.dtype).min))
