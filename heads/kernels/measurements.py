"""Where what the engine measures about a target on this machine is cached: the latency curve T(N)
(infer.calibrate) and the faster weight layout (heads.kernels.weight_layout), both under
$HEADWAY_CACHE/calibration/<target>-<device>-<dtype>-<what>.json.

Device is cuda, or cpu<threads> (the thread count changes the timings).
"""

from __future__ import annotations

from pathlib import Path

import torch

from headway.heads.target import cache_root


def measurement_path(target, what: str) -> Path:
    """The cache file of measurement `what` for `target` (a heads.target.Target or a bare HF model)."""
    return cache_root() / "calibration" / f"{_stem(target)}-{what}.json"


def _stem(target) -> str:
    """<target>-<device>-<dtype>; a bare model is named by its type and size."""
    model = getattr(target, "model", target)
    param = next(model.parameters())
    dtype = str(param.dtype).replace("torch.", "")
    name = getattr(getattr(target, "spec", None), "name", None) or \
        f"{model.config.model_type}-{sum(p.numel() for p in model.parameters())}"
    where = f"cpu{torch.get_num_threads()}" if param.device.type == "cpu" else param.device.type
    return f"{name}-{where}-{dtype}"
