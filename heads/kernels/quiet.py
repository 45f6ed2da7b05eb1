"""Is a timing trustworthy? Timings that steer cached decisions (the weight layout, the T(N) curve) are
only as good as the moment they were taken: on a small CPU a second busy process makes a multi-threaded
PyTorch forward several times slower, and a choice cached then is wrong for good. So every such
measurement is watched:

    with watch() as seen:                      # CPU time other processes used while we measured
        times = measure(...)                   # [repeats] seconds per measured thing
    quality = seen.quality(spreads)            # + how far the repeats disagree
    if quality.noisy: re-measure, or refuse to cache

other_cpu: share of the machine's CPU time (all cores) spent outside this process during the block, from
/proc/stat (Linux; elsewhere unknown and taken as 0). spread: (median - best) / best over the repeats,
the worst measured thing. Both are recorded with the result, with the time and the 1-minute load.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

MAX_OTHER_CPU = 0.15  # other processes may use at most this share of the CPU while we measure
MAX_SPREAD = 0.25  # repeats may disagree by at most this much (median over best)


@dataclass
class Quality:
    other_cpu: float  # share of all cores' time used by other processes during the measurement
    spread: float  # (median - best) / best, worst over the measured things
    load: float  # 1-minute load average at the end (this process included)
    measured_at: str  # UTC, ISO 8601

    @property
    def noisy(self) -> bool:
        return self.other_cpu > MAX_OTHER_CPU or self.spread > MAX_SPREAD

    def as_dict(self) -> dict:
        return {**asdict(self), "noisy": self.noisy}

    def describe(self) -> str:
        return (f"other processes used {self.other_cpu:.0%} of the CPU, repeats spread {self.spread:.0%}, "
                f"load {self.load:.2f}")


class Watch:
    def __init__(self):
        self.other_cpu = 0.0

    def quality(self, spread: float) -> Quality:
        return Quality(other_cpu=round(self.other_cpu, 4), spread=round(spread, 4), load=_load(),
                       measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


@contextmanager
def watch():
    """Measure the CPU time other processes take while the block runs (see the module doc)."""
    seen = Watch()
    busy0, own0, wall0 = _machine_busy_s(), time.process_time(), time.perf_counter()
    yield seen
    busy1, own1, wall1 = _machine_busy_s(), time.process_time(), time.perf_counter()
    capacity = (wall1 - wall0) * (os.cpu_count() or 1)
    if busy0 is not None and busy1 is not None and capacity > 0:
        seen.other_cpu = max(0.0, (busy1 - busy0) - (own1 - own0)) / capacity


def measure_until_quiet(measure, timings, watch_with=None, tries: int = 3):
    """Run `measure()` until one run is not disturbed, `tries` times at most; -> (its result, its Quality).
    `timings(result)` yields the repeated timings of each measured thing; `watch_with` (default: watch) is the
    caller's watch, looked up by the caller so that it can be replaced in tests."""
    for _ in range(tries):
        with (watch_with or watch)() as seen:
            result = measure()
        quality = seen.quality(max(spread(t) for t in timings(result)))
        if not quality.noisy:
            break
    return result, quality


def spread(samples: list[float]) -> float:
    """(median - best) / best of one thing's repeated timings."""
    ordered = sorted(samples)
    best, median = ordered[0], ordered[len(ordered) // 2]
    return (median - best) / best if best > 0 else 0.0


def _machine_busy_s() -> float | None:
    """Seconds all cores spent busy since boot (user + nice + system + irq + softirq + steal)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _load() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0
