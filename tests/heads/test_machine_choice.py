"""heads/kernels/machine_choice.py: whether the CPU multiplies bf16, as oneDNN is allowed to."""

import pytest
import torch

from headway.heads.kernels.machine_choice import cpu_multiplies_bf16


@pytest.mark.parametrize("cap, allowed", [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_VNNI", False),
                                          ("AVX512_CORE_BF16", True), ("AVX512_CORE_AMX", True), ("ALL", True)])
def test_a_onednn_isa_cap_below_bf16_means_bf16_is_emulated(monkeypatch, cap, allowed):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN emulate bf16 even on a CPU with AVX512-BF16: then the jobs pick fp32
    as on a CPU without it; a cap that keeps bf16 leaves the hardware's answer."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert cpu_multiplies_bf16() is allowed


def test_without_a_cap_the_hardware_answers(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    for hardware in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda h=hardware: h)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert cpu_multiplies_bf16() is hardware
