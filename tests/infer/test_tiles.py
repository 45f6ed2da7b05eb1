"""The tiles layout multiplies a GGUF target's codes with AMX: x's three bf16 parts add up to x exactly, the kernel
equals F.linear on the dequantized weight within fp32 rounding at every row count, a row's result does not depend
on the other rows (a decode step and a tree run the same arithmetic), single weights read back exactly, and the
engine's greedy output under the layout equals the stock layout's (tests/infer/test_blocks.py runs its layout tests
under both layouts)."""

import pytest
import torch
import torch.nn.functional as F

from headway.heads.kernels import blocks, tiles
from headway.heads.kernels.weight_layout import _linears, apply_layout, candidates, current_layout

from tests.infer.test_blocks import quantized_target

pytestmark = pytest.mark.skipif(tiles.unavailable_reason() is not None,
                                reason=f"tiles layout: {tiles.unavailable_reason()}")


def random_blocks(N: int, K: int, small: bool, seed: int):
    """Codes, f16 scales and offsets as a Q4_1 (small codes, offsets) or Q8_0 (signed codes, no offsets) tensor."""
    g = torch.Generator().manual_seed(seed)
    if small:
        codes = torch.randint(0, 16, (N, K), generator=g).to(torch.int8)
        offsets = -torch.rand(N, K // 32, generator=g).half().float()
    else:
        codes = torch.randint(-128, 128, (N, K), generator=g).to(torch.int8)
        offsets = torch.zeros(N, K // 32)
    scales = (torch.rand(N, K // 32, generator=g) / 7).half().float()
    return codes, scales, offsets


def run(x, codes, scales, offsets, small: bool):
    N = codes.shape[0]
    arranged = (tiles.to_tile_order(t, N) for t in (codes, scales, offsets))
    return tiles.kernel().tiles_linear(*tiles.kernel().split_rows(x), *arranged, N, small, bool(offsets.any()))


def test_x_splits_into_three_bf16_parts_that_add_up_to_it_exactly():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 6, 96)
    parts, sums = tiles.kernel().split_rows(x)  # [3, K/32, M, 32] bf16 bits, [M, K/32]
    as_float = (parts.int() << 16).view(torch.float32).double()  # bf16 bits -> their fp32 values
    rebuilt = as_float.sum(0).permute(1, 0, 2).reshape(5, 96)  # [M, K]
    assert torch.equal(rebuilt, x.double())
    torch.testing.assert_close(sums, x.view(5, 3, 32).sum(-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 32, 100])
@pytest.mark.parametrize("shape,small", [((64, 80), True), ((96, 48), True), ((32, 200), False), ((64, 16), False)])
def test_kernel_equals_f_linear_on_the_dequantized_weight(rows, shape, small):
    """Any output size (a last column group partly used), 1..128 rows (16 per pass), both code kinds."""
    K, N = shape
    codes, scales, offsets = random_blocks(N, K, small, seed=rows)
    weight = blocks.dequantize(codes, scales, offsets)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    out = run(x, codes, scales, offsets, small)
    exact = x.double() @ weight.double().T  # [rows, N]
    bound = 1e-5 * (x.abs() @ weight.abs().T).double()  # fp32 rounding of a K-term sum, any order
    assert bool(((out.double() - exact).abs() <= bound).all())
    assert bool(((F.linear(x, weight).double() - exact).abs() <= bound).all())  # the bound is one F.linear meets


@pytest.mark.parametrize("small", [True, False])
def test_a_rows_result_does_not_depend_on_the_other_rows(small):
    codes, scales, offsets = random_blocks(80, 96, small, seed=1)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2))
    together = run(x, codes, scales, offsets, small)
    alone = torch.cat([run(x[i:i + 1].contiguous(), codes, scales, offsets, small) for i in range(20)])
    assert torch.equal(together, alone)


def test_kernel_reads_each_weight_back_exactly():
    """One-hot rows read single weights out: d * q + m rounded once, the dequantizer's value bit for bit."""
    codes, scales, offsets = random_blocks(80, 64, small=True, seed=0)
    weight = blocks.dequantize(codes, scales, offsets)  # [80, 64]
    for first in (0, 32):
        one_hot = torch.eye(64)[first:first + 32]  # [32, 64]
        assert torch.equal(run(one_hot, codes, scales, offsets, True), weight[:, first:first + 32].T)


def test_every_bit_of_x_reaches_the_product():
    """x values that need all 24 bits of fp32 (three bf16 parts): each one-hot row times such a value comes out
    within 2 ulps of its terms d * q * x and m * x, where dropping x's lowest part would cost ~2^-17 of them."""
    codes, scales, offsets = random_blocks(48, 64, small=True, seed=3)
    weight = blocks.dequantize(codes, scales, offsets)  # [48, 64]
    value = 1.0 + 2.0 ** -9 + 2.0 ** -17 + 2.0 ** -23  # exact in fp32; its bf16 parts: 1, 2^-9 + 2^-16, -2^-17 + 2^-23
    x = torch.eye(64)[:32] * value  # [32, 64]
    out = run(x, codes, scales, offsets, True).double()
    exact = weight[:, :32].T.double() * value
    terms = (blocks.dequantize(codes, scales, 0 * offsets).abs() + blocks.dequantize(0 * codes, 0 * scales, offsets.abs()))
    assert bool(((out - exact).abs() <= 2.0 ** -22 * value * terms[:, :32].T.double()).all())


@pytest.fixture()
def target(tmp_path):
    return quantized_target(tmp_path / "tiny.gguf")


def test_switching_between_tiles_and_blocks_keeps_each_layouts_routing(target):
    model = target.model
    for layout in ("tiles", "blocks", "wide-column", "tiles"):
        apply_layout(model, layout)
    assert current_layout(model) == "tiles" and all(tiles.uses_tiles(l) for l in _linears(model))
    apply_layout(model, "blocks")
    assert all(blocks.uses_blocks(l) for l in _linears(model))


def test_without_a_gguf_file_asking_for_tiles_is_one_clear_error():
    from headway.heads.target import load_target

    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    assert "tiles" not in candidates(target.model)
    with pytest.raises(ValueError, match="weight_layout=tiles needs a target loaded from a block-quantized GGUF"):
        apply_layout(target.model, "tiles")
