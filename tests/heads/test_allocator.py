"""keep_freed_memory: large tensors come from malloc's heap and stay there once freed, instead of each
being a fresh mmap that is unmapped on free and faulted in again page by page on the next step (what made
every EAGLE training step pay ~41,000 page faults; the speed-up is measured by scripts/bench_train.py
--allocator)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# mallinfo2's byte counts while a 40 MB tensor is alive and after it is freed (40 MB is above glibc's largest
# adaptive mmap threshold, 32 MiB, so by default it is always a fresh mapping).
PROBE = """
import ctypes, sys, torch
from headway.heads.kernels.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    print("no-mallinfo2"); sys.exit()
libc.mallinfo2.restype = MallInfo2
applied = f"{keep_freed_memory()}/{keep_freed_memory()}" if sys.argv[1] == "keep" else None  # twice: idempotent
tensor = torch.empty(10_000_000).fill_(1.0)  # [10M] fp32 = 40 MB
alive = libc.mallinfo2()
del tensor
freed = libc.mallinfo2()
print(applied, alive.hblkhd, alive.arena, freed.hblkhd, freed.arena)
"""
BLOCK = 40_000_000


def malloc_bytes(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    if out.strip() == "no-mallinfo2":
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    return out.split()


def test_large_tensors_come_from_the_heap_and_stay_after_free():
    applied, alive_mapped, alive_heap, freed_mapped, freed_heap = malloc_bytes("keep")
    assert applied == "True/True"  # applied, and a second call says so too
    assert int(alive_mapped) < BLOCK <= int(alive_heap)  # not its own mapping: a heap block
    assert int(freed_heap) >= BLOCK  # freed, not trimmed: the next step's tensor reuses its pages


def test_by_default_a_large_tensor_is_its_own_mapping():
    """The baseline the switch changes (if glibc ever stops mapping such blocks, this test says so)."""
    _, alive_mapped, _, freed_mapped, _ = malloc_bytes("default")
    assert int(alive_mapped) >= BLOCK > int(freed_mapped)  # mapped while alive, unmapped on free
