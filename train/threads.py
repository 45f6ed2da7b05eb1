"""CPU threads of a training process.

`accelerate launch` exports OMP_NUM_THREADS=1 unless it was told `--cpu` or a thread count, so on a machine
without a GPU the default job would run every matmul (data generation, the hidden-state cache, training)
on one core. `cpu_threads=auto` gives each process its share of the physical cores instead (what accelerate
itself does under `--cpu`); a number sets it explicitly.
"""

from __future__ import annotations

import os

import torch


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads slow fp32 matmuls down rather than up)."""
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return max(1, min(cores, usable))


def local_processes() -> int:
    """Processes of this job on this machine (accelerate/torchrun export LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def threads_for(setting: str | int) -> int:
    """`auto` -> this process's share of the physical cores; a number -> that number."""
    if str(setting) == "auto":
        return max(1, physical_cores() // local_processes())
    return int(setting)


def use_cpu_threads(setting: str | int) -> int:
    """Set torch's intra-op threads for a process that computes on the CPU; returns the count."""
    n = threads_for(setting)
    torch.set_num_threads(n)
    return n
