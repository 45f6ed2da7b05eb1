"""The target's measured latency-vs-tokens curve T(N) and the tree budget the engine derives from it.

Verifying N tokens in one forward costs about one plain step while the target is memory-bound (the
flat part of the roofline, Williams et al. 2009); past the ridge point T(N) grows linearly and big trees
stop paying. The engine therefore sizes trees from the measured curve instead of a constant:

    budget N(B) = the largest N <= max_nodes with r = T(B * N) / T(B) <= min(slack, 1 + node_cost * (N - 1))

i.e. a verification step may cost at most `slack` plain steps of the same batch (default 2: a tree pays
off as long as it yields > 2 tokens per step, which good heads reach) and each extra node at most
`node_cost` (default 0.5) of a plain step on average (an extra node yields well under one token). Measured
tokens are B * N because a batch of B rows with N nodes each is one forward of B * N tokens; this is also
what throttles drafting at large batch: once B alone is past the ridge, T(2B) ~
2 T(B) > 1.5 T(B) and N falls to 1 (no speculation).
Without a curve a fixed throttle applies (full trees for B <= 8, a quarter for B <= 32, none
beyond).

    python -m headway.infer.calibrate target=smollm2-135m      # measure, cache on disk, print the curve
    python -m headway.infer.calibrate target=smollm2-135m weight_layout=stock context=512
    python -m headway.infer.calibrate target=smollm2-135m target.path=/models/SmolLM2-135M-Instruct
Keys (conf/calibrate.yaml, schema CalibrateConfig): target (a conf/target preset; its fields can be
overridden as target.path=..., target.dtype=...), weight_layout, context.
The curve is cached in $HEADWAY_CACHE/calibration/<target>-<device>-<dtype>-<layout>.json (device: cuda, or
cpu<threads>; layout: the engine's weight_layout, see heads.kernels.weight_layout, with its kernel versions for panel,
blocks and tiles).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from headway.heads.files import write_json_atomic
from headway.heads.target import TargetSpec
from headway.heads.kernels.measurements import measurement_path
from headway.heads.kernels.quiet import measure_until_quiet, watch
from headway.heads.kernels import blocks as blocks_kernel
from headway.heads.kernels import panel as panel_kernel
from headway.heads.kernels.weight_layout import (PACK_BUCKETS, apply_layout, candidates, check_layout, choose_layout,
                                         current_layout, layout_path, measured_name, pack_all)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class TreeBudget:
    max_nodes: int = 64  # hard cap on tree nodes per row (root included)
    curve: dict[int, float] | None = None  # N -> seconds for one target forward of N tokens
    slack: float = 2.0  # a verification step may cost up to slack * T(B)
    node_cost: float = 0.5  # ... and each extra node up to node_cost * T(B) on average

    def __post_init__(self):
        if self.curve:  # T is non-decreasing in N and noise only ever adds time: keep the min to the right
            sizes = sorted(self.curve)
            times = torch.tensor([self.curve[n] for n in sizes]).flip(0).cummin(0).values.flip(0)
            self.curve = dict(zip(sizes, times.tolist()))

    def max_tokens(self, batch_size: int) -> int:
        """Tree nodes per row (root included, >= 1) for a batch of `batch_size` rows."""
        if not self.curve:
            if batch_size <= 8:
                return self.max_nodes
            return max(1, self.max_nodes // 4) if batch_size <= 32 else 1
        plain = self.latency(batch_size)
        n = 1
        while n < self.max_nodes:
            ratio = self.latency(batch_size * (n + 1)) / plain
            if ratio > min(self.slack, 1 + self.node_cost * n):
                break
            n += 1
        return n

    def latency(self, tokens: int) -> float:
        """T(tokens) by linear interpolation of the curve (linear extrapolation past its ends)."""
        sizes = sorted(self.curve)
        if len(sizes) == 1:
            return self.curve[sizes[0]] * max(tokens / sizes[0], 1.0)
        lo = max((s for s in sizes[:-1] if s <= tokens), default=sizes[0])
        hi = sizes[sizes.index(lo) + 1]
        t_lo, t_hi = self.curve[lo], self.curve[hi]
        return t_lo + (t_hi - t_lo) * (tokens - lo) / (hi - lo)

    @classmethod
    def for_target(cls, target, max_nodes: int = 64, slack: float = 2.0, measure: bool = False) -> "TreeBudget":
        """The budget from this target's cached curve (`python -m headway.infer.calibrate`), measured now if
        `measure`; without a curve, the static batch-size throttle."""
        curve = load_curve(target)
        if curve is None and measure:
            curve = calibrate_latency(target)
        return cls(max_nodes=max_nodes, curve=curve, slack=slack)


def curve_path(target) -> Path:
    layout = current_layout(getattr(target, "model", target))  # the weight layout changes T(N) too
    return measurement_path(target, measured_name(layout))


CURVE_VERSION = 2  # 2: each timed forward follows one of its own size (curves timed before read T(1) high)


def load_curve(target) -> dict[int, float] | None:
    path = curve_path(target)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if record.get("version") != CURVE_VERSION:
            return None  # measured the old way: measured again
        return {int(n): float(t) for n, t in record["latency_s"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None  # a damaged cache is just re-measured


def calibrate_latency(target, sizes=DEFAULT_SIZES, context: int = 256, repeats: int = 5,
                      save: bool = True, force: bool = False) -> dict[int, float]:
    """Measure T(N): seconds for one target forward of N new tokens after `context` cached tokens,
    through the engine's own path (paged cache + 4D mask). Best of `repeats` (least disturbed). A curve
    measured while other processes used the CPU (heads.kernels.quiet) is measured again, twice at most; if still
    disturbed it is returned but not cached (unless `force`), so a busy moment is never kept."""
    samples, quality = measure_until_quiet(lambda: _measure_curve(target, sizes, context, repeats),
                                           lambda result: result.values(), watch)
    curve = {n: min(times) for n, times in samples.items()}
    if save and (force or not quality.noisy):
        _save_curve(target, curve, context, quality)
    elif save:
        print(f"warning: T(N) measured while the machine was busy ({quality.describe()}); not cached")
    calibrate_latency.last_quality = quality  # for the CLI's report
    return curve


@torch.inference_mode()
def _measure_curve(target, sizes, context: int, repeats: int) -> dict[int, list[float]]:
    """N -> `repeats` timings of one forward of N tokens after `context` cached ones."""
    from headway.infer.kv_cache import PagedKVCache
    from headway.infer.tree import causal_ancestors

    model = target.model
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    sizes = sorted({int(n) for n in sizes})
    vocab = model.config.vocab_size
    cache = PagedKVCache.for_model(model.config, batch_size=1, max_seq_len=context + max(sizes),
                                   dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab, (1, context), generator=gen)
    _forward(model, cache, prompt, causal_ancestors(context), dtype, device)
    tokens = {n: torch.randint(vocab, (1, n), generator=gen) for n in sizes}
    samples = {n: [] for n in sizes}
    for round_ in range(repeats + 1):  # the first round warms up; sizes interleave so noise hits them alike
        for n in sizes:
            # one untimed forward of the same size first: a decode step follows a decode step, not the 128-token
            # forward before it in this loop, whose working set evicts the weights from cache (T(1) read 10-16% high)
            _forward(model, cache, tokens[n], causal_ancestors(n), dtype, device)
            cache.truncate(torch.tensor([context]))
            start = time.perf_counter()
            _forward(model, cache, tokens[n], causal_ancestors(n), dtype, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:
                samples[n].append(time.perf_counter() - start)
            cache.truncate(torch.tensor([context]))
    return samples


def _forward(model, cache, tokens, anc, dtype, device):
    from headway.infer.tree import attention_mask

    n = tokens.shape[1]
    plan = cache.prepare(n)
    mask = attention_mask(plan.start, anc, plan.read_len, dtype)
    pos = plan.start[:, None] + torch.arange(n)
    model(input_ids=tokens.to(device), position_ids=pos.to(device), attention_mask=mask.to(device),
          cache=cache, use_cache=True, logits_to_keep=0)


def _save_curve(target, curve: dict[int, float], context: int, quality) -> None:
    write_json_atomic(curve_path(target), {"version": CURVE_VERSION, "context": context,
                                           "latency_s": {str(k): v for k, v in curve.items()},
                                           "quality": quality.as_dict()})


class CalibrateError(ValueError):
    """Bad calibration input; the message says what to do."""


@dataclass
class CalibrateConfig:
    target: TargetSpec = MISSING  # composed from conf/target/<name>.yaml by `target=<name>`
    weight_layout: str = "auto"  # the engine's weight layout (heads.kernels.weight_layout); its curve sets the budget
    context: int = 256  # cached tokens before the measured forward
    compare: bool = True  # also measure T(N) under every other layout this machine can run, side by side
    force: bool = False  # choose the layout again and cache what is measured even on a busy machine


ConfigStore.instance().store(name="calibrate_schema", node=CalibrateConfig)


def calibrate(cfg, out=print) -> dict[int, float]:
    """Measure and cache this target's T(N) under the engine's weight layout (and, with compare, under
    every candidate layout); print the curves side by side and the engine's tree budget."""
    from headway.heads.target import load_target

    if cfg.context < 1:
        raise CalibrateError(f"context must be >= 1, got {cfg.context}")
    try:
        check_layout(cfg.weight_layout)
    except ValueError as exc:
        raise CalibrateError(str(exc)) from None
    target = load_target(OmegaConf.to_object(cfg.target))
    if cfg.force and cfg.weight_layout == "auto":
        choose_layout(target, force=True)
    try:
        engine_layout = apply_layout(target.model, cfg.weight_layout, target)
    except ValueError as exc:  # a layout this target or machine cannot run
        raise CalibrateError(str(exc)) from None
    out(f"weight layout: {engine_layout}" + _layout_times(target))
    layouts = [engine_layout] + [l for l in candidates(target.model) if cfg.compare and l != engine_layout]
    curves, notes = {}, {}
    for layout in layouts:
        apply_layout(target.model, layout)
        if layout == "packed":
            out(f"packed: packing the weights for rows {', '.join(map(str, PACK_BUCKETS))} took "
                f"{pack_all(target.model):.1f} s (paid once per process, on first use of each bucket)")
        if layout == "panel":
            out(f"panel: kernel ready in {panel_kernel.READY_SECONDS.get('kernel', 0.0):.1f} s (compiled once per "
                f"machine and torch build in torch's extension folder, then loaded)")
        if layout == "blocks":
            read = sum(blocks_kernel.uses_blocks(module) for module in target.model.modules())
            out(f"blocks: {read} Linears read from the GGUF file's "
                f"codes, matched in {getattr(target.model, '_block_seconds', 0.0):.1f} s (once per load)")
        curves[layout] = calibrate_latency(target, context=cfg.context, force=cfg.force)
        notes[layout] = calibrate_latency.last_quality
    apply_layout(target.model, engine_layout)
    _print_curves(curves, out)
    for layout, quality in notes.items():
        out(f"{layout}: {quality.describe()}" + (" - NOT cached (busy machine; force=true caches it)"
                                                   if quality.noisy and not cfg.force else ""))
    curve = curves[engine_layout]
    budget = TreeBudget(curve=curve)
    out(f"tree budget (slack {budget.slack}): " +
        ", ".join(f"B={b}: {budget.max_tokens(b)}" for b in (1, 2, 4, 8, 16, 32, 64)))
    out(f"cached in {curve_path(target)}")
    return curve


def _print_curves(curves: dict[str, dict[int, float]], out) -> None:
    """One row per N: T in ms and T(N)/T(1) under each layout."""
    names = list(curves)
    out("     N  " + "  ".join(f"{name:>20}" for name in names))
    for n in sorted(curves[names[0]]):
        cells = [f"{c[n] * 1e3:8.2f} ms {c[n] / c[min(c)]:5.2f}x" for c in curves.values()]
        out(f"{n:6d}  " + "  ".join(f"{cell:>20}" for cell in cells))
    out("T(8)/T(1): " + ", ".join(f"{name} {c[8] / c[1]:.2f}" for name, c in curves.items() if 8 in c and 1 in c))


def main(argv: list[str] | None = None) -> int:
    from headway.heads.cli import run_command
    from headway.heads.target import TargetError

    return run_command("calibrate", calibrate, argv, errors=(TargetError, CalibrateError), usage=__doc__)


def _layout_times(target) -> str:
    try:
        record = json.loads(layout_path(target).read_text())
        return f" (auto's score {record.get('score', 'T(1) + T(8)')}: " + ", ".join(
            f"{k} {sum(v.values()) * 1e3:.1f} ms" for k, v in record["forward_s"].items()) + ")"
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return ""  # not chosen by measuring here (explicit layout, or a GPU)


if __name__ == "__main__":
    raise SystemExit(main())
