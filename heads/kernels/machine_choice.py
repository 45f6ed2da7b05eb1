"""Choices between two kernels that only a measurement on this machine can make, measured once and cached.

Which library multiplies many rows faster (heads/kernels/gemm.py) or whether one row is faster through MKL's
matrix-vector product or the panel kernel (heads/kernels/panel.py) depends on the CPU's vendor and generation,
not on the model. Each such choice is timed once per machine and thread count, while the machine is quiet
(heads.kernels.quiet), and cached as a small JSON record under $HEADWAY_CACHE/calibration/ with the CPU's
name; a record from another CPU, another version of the choice or a damaged file is measured again.

    choice = measured_choice(path, version, options, measure, pick, force=False, describe={...})
    times = interleaved_times({"a": fn_a, "b": fn_b}, cases, repeats)   # what a `measure` returns
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from headway.heads.files import write_json_atomic
from headway.heads.kernels.quiet import measure_until_quiet


BF16_ISA_MARKS = ("BF16", "FP16", "AMX", "AVX10")  # oneDNN ISA names that include bf16 dot products


def cpu_multiplies_bf16() -> bool:
    """The CPU has AMX tiles or AVX512-BF16 dot products (bf16 in hardware, not emulated) and oneDNN may use them:
    with ONEDNN_MAX_CPU_ISA capped below them (AVX2, AVX512_CORE, ...) oneDNN emulates bf16, as on a CPU without."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if cap != "ALL" and not any(mark in cap for mark in BF16_ISA_MARKS):
        return False
    return any(getattr(torch.cpu, probe, lambda: False)()
               for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measured_choice(path: Path, version: int, options: tuple[str, ...], measure: Callable[[], dict],
                    pick: Callable[[dict[str, float]], str], force: bool = False, describe: dict | None = None) -> str:
    """The cached choice at `path` when it was made on this CPU by this `version`, else a new one:
    `measure()` -> {option: [[seconds per repeat] per case]}, `pick({option: summed best seconds})` -> option.
    A measurement disturbed by other processes is used but not cached (unless `force`)."""
    cached = None if force else _cached(path, version, options)
    if cached is not None:
        return cached
    samples, quality = measure_until_quiet(measure, lambda result: (s for per in result.values() for s in per))
    seconds = {name: sum(min(s) for s in per) for name, per in samples.items()}
    choice = pick(seconds)
    if force or not quality.noisy:
        write_json_atomic(path, {"version": version, "cpu": cpu_name(), "choice": choice, "seconds": seconds,
                                 **(describe or {}), "quality": quality.as_dict()})
    return choice


def _cached(path: Path, version: int, options: tuple[str, ...]) -> str | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # missing or damaged: measure
    if not isinstance(record, dict) or record.get("version") != version or record.get("cpu") != cpu_name():
        return None
    choice = record.get("choice")
    return choice if choice in options else None


def interleaved_times(run: dict[str, Callable], cases: list[tuple], repeats: int, calls: int = 1) -> dict[str, list[list[float]]]:
    """{option: [[seconds for `calls` calls of run[option](*case), per repeat] per case]}: options and cases
    interleaved so that noise hits them alike; the first round warms up and is not kept."""
    times = {name: [[] for _ in cases] for name in run}
    for round_ in range(repeats + 1):
        for name, fn in run.items():
            for i, case in enumerate(cases):
                start = time.perf_counter()
                for _ in range(calls):
                    fn(*case)
                if round_:
                    times[name][i].append(time.perf_counter() - start)
    return times
