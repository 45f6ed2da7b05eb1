"""The CPU kernels built for each instruction set this CPU runs besides its own (AVX2 on an AVX-512 CPU) compute
what they should: a CPU without AVX-512 runs the AVX2 builds, and a CPU with it checks them here too. (The
builds for the CPU's own instruction set are tested with the layouts: tests/infer/test_weight_layout.py,
tests/infer/test_blocks.py, tests/heads/test_decode_attention.py.)"""

import pytest
import torch
import torch.nn.functional as F

from headway.heads.kernels import blocks, decode_attention, panel

OTHER_BUILDS = pytest.mark.skipif(not panel.other_isas(),
                                  reason=f"this CPU runs no other build than its own ({panel.kernel_isa()})")


@pytest.mark.parametrize("capability, native, others", [("AVX512", "AVX512", ["AVX2"]), ("AVX2", "AVX2", []),
                                                         ("DEFAULT", None, [])])
def test_kernels_are_built_for_what_pytorch_runs_here(capability, native, others, monkeypatch):
    """PyTorch's CPU capability (the CPU's and the OS's say) picks the build; an AVX-512 CPU also checks AVX2's;
    a CPU with neither gets one reason, and no layout or kernel is offered."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert panel.kernel_isa() == native and panel.other_isas() == others
    if native is None:
        assert panel.unavailable_reason() == "needs AVX-512 or AVX2 (this CPU: DEFAULT)"
        assert blocks.unavailable_reason() == panel.unavailable_reason()
        with pytest.raises(RuntimeError, match="needs AVX-512 or AVX2"):
            panel.build_extension("headway_panel", panel.SOURCE)

SHAPES = [(576, 576), (1536, 576), (50, 64), (100, 96), (20, 32)]  # N, K: whole panels, a half panel, less
ROWS = [1, 2, 3, 4, 5, 8, 13, 32]  # one pass, several, and rows left over


@pytest.fixture(scope="module", params=panel.other_isas() or [None])
def isa(request):
    return request.param


def close_to_fp64(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    exact = F.linear(x.double(), weight.double())
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))


@OTHER_BUILDS
def test_panel_kernel(isa):
    kernel = panel.build_extension("headway_panel", panel.SOURCE, isa=isa)
    g = torch.Generator().manual_seed(0)
    for N, K in SHAPES:
        weight = torch.randn(N, K, generator=g)
        panels = panel.to_panels(weight)
        for M in ROWS:
            x = torch.randn(M, K, generator=g)
            close_to_fp64(kernel.panel_linear(x, panels, N), x, weight)


@OTHER_BUILDS
def test_blocks_kernel(isa):
    """Q4_1-like codes, f16 scales and fp32 offsets: the weights the kernel rebuilds are the dequantizer's."""
    kernel = panel.build_extension("headway_blocks", blocks.SOURCE, ("-ffp-contract=off",), isa=isa)
    g = torch.Generator().manual_seed(1)
    for N, K in SHAPES:
        codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int8)
        scales = (torch.rand(N, K // blocks.BLOCK, generator=g) / 8).half().float()
        offsets = torch.randn(N, K // blocks.BLOCK, generator=g)
        weight = blocks.dequantize(codes, scales, offsets)  # [N, K]
        parts = [panel.to_panels(t) for t in (codes, scales, offsets)]
        for M in ROWS:
            x = torch.randn(M, K, generator=g)
            close_to_fp64(kernel.blocks_linear(x, *parts, N), x, weight)


@OTHER_BUILDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_kernel(isa, dtype):
    """One decode step over a growing cache's strided views with left pads, against fp64 SDPA."""
    kernel = panel.build_extension("headway_decode_attention", decode_attention.SOURCE, isa=isa)
    g = torch.Generator().manual_seed(2)
    for D, T in [(64, 37), (128, 12), (64, 300)]:
        B, Hkv, G = 4, 3, 3
        query = torch.randn(B, Hkv, G, D, generator=g).to(dtype)
        key = torch.randn(B, Hkv, T + 5, D, generator=g).to(dtype)[:, :, :T]
        value = torch.randn(B, Hkv, T + 5, D, generator=g).to(dtype)[:, :, :T]
        mask = torch.arange(T) >= (torch.arange(B) * 3)[:, None]  # [B, T] row b: 3b left pads (9 at most)
        out = kernel.decode_attention(query, key, value, mask, 0.125)  # [B, Hkv, G, D]
        exact = F.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                               attn_mask=mask[:, None, None], scale=0.125)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's one rounding
        torch.testing.assert_close(out.double(), exact, rtol=tolerance, atol=tolerance)
