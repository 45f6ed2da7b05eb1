"""Roofline model of a decode step (Williams et al. 2009) and what it predicts for speculative decoding.

A decode step that runs N tokens through the target streams every weight once (bytes ~ params) and does
~2 N params FLOPs, so its arithmetic intensity grows ~N (bf16) and its latency stays flat until the
hardware's ridge point, then grows linearly. Speculation rides that flat part: verifying a tree of N
tokens costs about one plain step. This module predicts T(N), the ridge point, the chain speedup of
speculative decoding (Leviathan et al. 2023) and the tree size that maximises tokens per unit time for a
head's measured acceptance, and prints the prediction next to the engine's measured calibration so one
sees how close the hardware gets.

    python -m headway.infer.roofline device=h100-sxm target=smollm2-135m
    python -m headway.infer.roofline device=local target=smollm2-135m acceptance=RUN/eval/eval.json draft_cost=0.05
    python -m headway.infer.roofline device=h200 config=path/to/config.json dtype=bf16 alpha=0.8 gamma=5
    python -m headway.infer.roofline device=a100 target=llama-3.1-8b-instruct acceptance=[0.8,0.6,0.4]
Keys (conf/roofline.yaml, schema RooflineConfig): device, target (a conf/target preset) or config (an HF
config.json, a model folder, or a head's final/), dtype, context, alpha, gamma, draft_cost, acceptance,
max_nodes, top_k, measure. A target's shape is read from its HF config (the embedded default's from its
GGUF, fetched once).
"""

from __future__ import annotations

import heapq
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from headway.heads.target import TargetError, TargetSpec, preset_names, target_config, target_preset


class RooflineError(ValueError):
    """Bad device, target or acceptance input; the message says what to do."""


# -------------------------------------------------------------------------------------------- devices

@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # FLOP/s, dense, in the dtype the target runs in
    bandwidth: float  # bytes/s from main memory (HBM / DRAM)
    dtype: str = "bf16"  # the dtype peak_flops refers to and the default for targets on this device

    @property
    def ridge_intensity(self) -> float:
        """FLOP/byte above which a kernel is compute-bound."""
        return self.peak_flops / self.bandwidth


DEVICES = {  # spec-sheet numbers: bf16 dense tensor-core peak, HBM bandwidth
    "h100-sxm": DeviceSpec("h100-sxm", 989e12, 3.35e12),
    "h200": DeviceSpec("h200", 989e12, 4.8e12),
    "a100": DeviceSpec("a100", 312e12, 2.0e12),
}


def measure_local(seconds: float = 2.0) -> DeviceSpec:
    """This machine, measured on the spot (about `seconds`): copy bandwidth and fp32 matmul rate with
    torch on the CPU, using the threads torch is allowed. Shared machines measure low and noisy."""
    size = 32 * 2**20 // 4  # 32 MiB of fp32: well past the caches, so the copy streams from DRAM
    src, dst = torch.randn(size), torch.empty(size)
    copy_s = _best_time(lambda: dst.copy_(src), seconds / 2)
    bandwidth = 2 * src.numel() * 4 / copy_s  # a copy reads and writes every byte
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm_s = _best_time(lambda: torch.mm(a, b), seconds / 2)
    return DeviceSpec("local", 2 * n**3 / mm_s, bandwidth, dtype="fp32")


def _best_time(fn, budget_s: float) -> float:
    """Fastest of repeated runs within a time budget: the least disturbed by other processes."""
    fn()  # warm up (page faults, thread pool)
    best, deadline = math.inf, time.perf_counter() + budget_s
    while time.perf_counter() < deadline or best == math.inf:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def get_device(name: str) -> DeviceSpec:
    if name == "local":
        return measure_local()
    if name not in DEVICES:
        raise RooflineError(f"unknown device {name!r}: use one of {', '.join([*DEVICES, 'local'])}")
    return DEVICES[name]


# -------------------------------------------------------------------------------------------- targets

BYTES_PER_PARAM = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
                   "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class TargetShape:
    """The numbers of a decoder-only transformer that set its decode cost."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, cfg: dict, name: str = "target") -> "TargetShape":
        cfg = dict(cfg.get("text_config", cfg))  # multimodal configs nest the language model
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(name=name, hidden=hidden, intermediate=int(cfg["intermediate_size"]),
                       layers=int(cfg["num_hidden_layers"]), vocab=int(cfg["vocab_size"]), heads=heads,
                       kv_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or hidden // heads),
                       tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))
        except KeyError as exc:
            raise RooflineError(f"config of {name} has no {exc.args[0]!r}: pass a decoder-only HF config.json")

    # linear layers as (d_in, d_out): what a decode step multiplies by
    def layer_linears(self) -> list[tuple[int, int]]:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        return [(h, q), (h, kv), (h, kv), (q, h), (h, self.intermediate), (h, self.intermediate),
                (self.intermediate, h)]

    def linears(self) -> list[tuple[int, int]]:
        return self.layer_linears() * self.layers + [(self.hidden, self.vocab)]  # + LM head

    @property
    def num_params(self) -> int:
        """Parameters as a checkpoint counts them (embedding, layers incl. norms, final norm, LM head)."""
        layer = sum(i * o for i, o in self.layer_linears()) + 2 * self.hidden
        lm_head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * layer + self.hidden + lm_head


def get_target(name_or_path: str) -> TargetShape:
    return resolve_target(name_or_path)[0]


def resolve_target(name_or_path: str) -> tuple[TargetShape, TargetSpec | None]:
    """A preset of conf/target/, a config.json, or a folder holding one (an HF model dir, or a head's
    final/: the target it records) -> its shape, and the spec to load it by when it can be measured."""
    if name_or_path in preset_names():
        spec = target_preset(name_or_path)
        return _shape_of(spec), spec
    path = Path(name_or_path).expanduser()
    folder = path if path.is_dir() else None
    if folder is not None:
        path = path / "config.json"
    if not path.is_file():
        raise RooflineError(f"{name_or_path!r} is neither a preset ({', '.join(preset_names())}) nor a "
                            f"config.json or a folder holding one: pass one of those")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RooflineError(f"{path} is not valid JSON ({exc.msg})") from exc
    if "head_kind" in cfg:  # a head folder: use the target it records
        if not cfg.get("target"):
            raise RooflineError(f"{path} records no target: pass the target's preset or config.json")
        spec = TargetSpec.from_dict(cfg["target"])
        return _shape_of(spec), spec
    spec = TargetSpec(name=folder.name, path=str(folder)) if folder is not None else None
    return TargetShape.from_config(cfg, path.parent.name or str(path)), spec


def _shape_of(spec: TargetSpec) -> TargetShape:
    try:
        return TargetShape.from_config(target_config(spec), spec.name)
    except TargetError as exc:
        raise RooflineError(str(exc)) from None


# ----------------------------------------------------------------------------------------- the model

def step_cost(shape: TargetShape, n, bytes_per_param: float, context: int = 0):
    """FLOPs and bytes moved by one forward of n new tokens over `context` cached tokens.

    Per linear (d_in, d_out): 2 n d_in d_out FLOPs; weights d_in d_out and activations n (d_in + d_out)
    elements moved. Attention reads the KV cache (context + n positions) once and does
    4 n (context + n) q*head_dim FLOPs. `n` may be a tensor of sizes."""
    n = torch.as_tensor(n, dtype=torch.float64)
    lin = torch.tensor(shape.linears(), dtype=torch.float64)  # [L, 2]
    weights = (lin[:, 0] * lin[:, 1]).sum()
    acts = (lin[:, 0] + lin[:, 1]).sum()
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * (context + n)  # K and V elements read
    attn_flops = 4 * shape.layers * shape.heads * shape.head_dim * n * (context + n)
    flops = 2 * n * weights + attn_flops
    moved = bytes_per_param * (weights + n * acts + kv)
    return flops, moved


def intensity(shape: TargetShape, n, bytes_per_param: float, context: int = 0):
    """Arithmetic intensity (FLOP/byte) of a decode step with n tokens."""
    flops, moved = step_cost(shape, n, bytes_per_param, context)
    return flops / moved


def predicted_latency(shape: TargetShape, device: DeviceSpec, n, bytes_per_param: float, context: int = 0):
    """T(N) = max(FLOPs / peak, bytes / bandwidth): the roofline's lower bound on a step's time (s)."""
    flops, moved = step_cost(shape, n, bytes_per_param, context)
    return torch.maximum(flops / device.peak_flops, moved / device.bandwidth)


def ridge_tokens(shape: TargetShape, device: DeviceSpec, bytes_per_param: float, context: int = 0,
                 max_n: int = 1 << 16) -> int:
    """N_ridge: the fewest tokens per step at which the step becomes compute-bound (the end of the flat
    part of T(N)); max_n if it never does within max_n (e.g. the KV reads dominate)."""
    ns = torch.arange(1, max_n + 1)
    compute_bound = intensity(shape, ns, bytes_per_param, context) >= device.ridge_intensity
    return int(ns[compute_bound][0]) if compute_bound.any() else max_n


# ------------------------------------------------------------------------------------- speculation

def expected_tokens_chain(alpha: float, gamma: int) -> float:
    """E[tokens/step] = (1 - alpha^(g+1)) / (1 - alpha), bonus token included (Leviathan et al. 2023)."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def chain_speedup(alpha: float, gamma: int, draft_cost: float) -> float:
    """Speedup(alpha, g, c) = (1 - alpha^(g+1)) / ((1 - alpha)(1 + g c)), c = T_draft / T_target.
    Assumes verifying g+1 tokens costs one plain step (the flat part of T(N))."""
    return expected_tokens_chain(alpha, gamma) / (1.0 + gamma * draft_cost)


@dataclass
class TreePlan:
    size: int  # draft nodes (the verified step runs size + 1 tokens)
    depth: int
    expected_tokens: float  # per verification step, bonus included
    speedup: float  # tokens per unit time relative to plain decoding
    curve: list[tuple[int, int, float, float]]  # (size, depth, expected tokens, speedup) for every size


def rank_rate(a: float, rank: int) -> float:
    """P(the rank-th (1-based) draft candidate is right | its parent is) for top-1 acceptance a."""
    return a * (1.0 - a) ** (rank - 1) / rank


def tree_path_probs(acceptance: list[float], max_nodes: int, top_k: int = 10) -> list[tuple[float, int]]:
    """The best tree's nodes, best first, as (probability the node is on the accepted path, depth).

    `acceptance[d-1]` is the measured conditional rate at depth d of the head's top-1 draft. A lower-ranked
    sibling r (1-based) is modelled by `rank_rate`: P(rank r right) = a_d (1 - a_d)^(r-1) / r. (The
    plain geometric a (1 - a)^(r-1) overstated the lower ranks: four heads trained here with top-1
    validation rates 0.21-0.27 accepted 0.31-0.39 of depth-1 steps with 3 children, vs 0.51-0.61 geometric
    and 0.34-0.41 with the 1/r damping.) A child is never more likely than its parent, so taking nodes
    greedily by path probability (Medusa's tree construction) always yields a valid tree and the best
    expected length 1 + sum of path probabilities for every size."""
    out: list[tuple[float, int]] = []
    heap = []  # (-prob, depth, rank, parent prob)

    def push(depth, rank, parent_prob):
        if depth <= len(acceptance) and rank <= top_k:
            a = float(acceptance[depth - 1])
            heapq.heappush(heap, (-parent_prob * rank_rate(a, rank), depth, rank, parent_prob))

    push(1, 1, 1.0)
    while heap and len(out) < max_nodes:
        neg, depth, rank, parent_prob = heapq.heappop(heap)
        out.append((-neg, depth))
        push(depth, rank + 1, parent_prob)  # the next sibling
        push(depth + 1, 1, -neg)  # the first child
    return out


def best_tree(acceptance: list[float], step_latency, draft_cost: float, max_nodes: int = 128,
              top_k: int = 10) -> TreePlan:
    """The tree size that maximises expected tokens per unit time.

    step_latency(N) -> seconds for a target step verifying N tokens (a tensor of N is passed); drafting a
    tree of depth D costs D * draft_cost * T(1) (one head pass per level). Size 0 is plain decoding."""
    nodes = tree_path_probs(acceptance, max_nodes, top_k)
    probs = torch.tensor([0.0] + [p for p, _ in nodes], dtype=torch.float64)
    depths = torch.tensor([0] + [d for _, d in nodes], dtype=torch.float64).cummax(0).values
    sizes = torch.arange(len(probs))
    expected = 1.0 + probs.cumsum(0)  # [S]
    latency = torch.as_tensor(step_latency(sizes + 1), dtype=torch.float64)  # [S]
    t1 = latency[0]
    speedup = expected * t1 / (latency + depths * draft_cost * t1)
    best = int(torch.argmax(speedup))  # first maximum: the smallest tree among equals
    curve = [(int(s), int(d), float(e), float(x)) for s, d, e, x in zip(sizes, depths, expected, speedup)]
    return TreePlan(best, int(depths[best]), float(expected[best]), float(speedup[best]), curve)


def read_acceptance(value) -> list[float]:
    """Per-depth acceptance from a list, a number, a comma-separated string, or an eval.json (or the folder
    holding one) written by `python -m headway.infer.evaluate` (its acceptance_by_depth)."""
    if isinstance(value, (int, float)):
        value = [value]
    if isinstance(value, str):
        try:
            value = [float(v) for v in value.split(",") if v.strip()]
        except ValueError:
            value = _acceptance_from_file(Path(value).expanduser())
    rates = [float(v) for v in value]
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise RooflineError(f"acceptance rates must be a non-empty list of numbers in [0, 1], got {rates}")
    return rates


def _acceptance_from_file(path: Path) -> list[float]:
    path = path / "eval.json" if path.is_dir() else path
    if not path.is_file():
        raise RooflineError(f"acceptance {str(path)!r} is neither a list of rates nor an eval.json")
    try:
        return list(json.loads(path.read_text())["acceptance_by_depth"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise RooflineError(f"{path} has no acceptance_by_depth: pass the eval.json of "
                            f"`python -m headway.infer.evaluate`") from exc


# ------------------------------------------------------------------------------------------ measured

def measured_latency(spec: TargetSpec, sizes: list[int], context: int) -> dict[int, float]:
    """The engine's calibration of T(N) on this machine (seconds per target step of N tokens after
    `context` cached ones), measured now under the engine's weight layout."""
    from headway.heads.target import load_target
    from headway.infer.calibrate import calibrate_latency
    from headway.heads.kernels.weight_layout import apply_layout

    target = load_target(spec)
    apply_layout(target.model, "auto", target)  # the engine's weight layout (heads.kernels.weight_layout)
    # save=False: the engine's cached curve (its own context) stays what `python -m headway.infer.calibrate` wrote
    return calibrate_latency(target, sizes, context=context, repeats=3, save=False)


# ---------------------------------------------------------------------------------------------- CLI

@dataclass
class RooflineConfig:
    device: str = "h100-sxm"  # h100-sxm | h200 | a100 | local (this machine, measured on the spot)
    target: TargetSpec = MISSING  # composed from conf/target/<name>.yaml by `target=<name>`
    config: Optional[str] = None  # instead of the target: an HF config.json, or a folder holding one (a
    #                               model dir, or a head's final/: the target it records)
    dtype: Optional[str] = None  # weight bytes: fp32 | bf16 | fp16 | fp8 | int8 | int4 (null: the device's)
    context: int = 512  # cached tokens each step attends to
    alpha: float = 0.8  # chain example: per-token acceptance ...
    gamma: int = 5  # ... draft length ...
    draft_cost: float = 0.05  # ... and c = T_draft / T_target per drafted token (or tree level)
    acceptance: Any = None  # per-depth acceptance [a1,a2,...] or an eval.json (or its folder): plans a tree
    max_nodes: int = 128  # largest tree considered
    top_k: int = 10  # children per node considered
    measure: Optional[bool] = None  # also measure T(N) here with the engine (null: with device=local)


ConfigStore.instance().store(name="roofline_schema", node=RooflineConfig)


def check_config(cfg) -> None:
    if not 0.0 <= cfg.alpha <= 1.0 or cfg.gamma < 0 or cfg.draft_cost < 0:
        raise RooflineError("need 0 <= alpha <= 1, gamma >= 0 and draft_cost >= 0")
    if cfg.context < 0 or cfg.max_nodes < 1 or cfg.top_k < 1:
        raise RooflineError("need context >= 0, max_nodes >= 1 and top_k >= 1")


def run(cfg, out=print) -> None:
    check_config(cfg)
    if cfg.config:
        shape, spec = resolve_target(cfg.config)
    else:
        spec = OmegaConf.to_object(cfg.target)
        shape = _shape_of(spec)
    report(OmegaConf.to_container(cfg), shape, spec, out)


def report(args: dict, shape: TargetShape, spec: TargetSpec | None = None, out=print) -> None:
    """Print the model for `shape` on args["device"]; `spec` (a loadable target) allows measuring T(N)."""
    device = get_device(args["device"])
    dtype = args["dtype"] or device.dtype
    if dtype not in BYTES_PER_PARAM:
        raise RooflineError(f"unknown dtype {dtype!r}: use one of {', '.join(BYTES_PER_PARAM)}")
    bpp, ctx = BYTES_PER_PARAM[dtype], args["context"]
    latency = lambda n: predicted_latency(shape, device, n, bpp, ctx)  # noqa: E731

    out(f"device {device.name}: {device.peak_flops / 1e12:.3g} TFLOP/s ({device.dtype}), "
        f"{device.bandwidth / 1e9:.4g} GB/s, ridge intensity {device.ridge_intensity:.1f} FLOP/byte")
    out(f"target {shape.name}: {shape.num_params / 1e6:.1f}M params ({shape.layers} layers, hidden {shape.hidden}, "
        f"intermediate {shape.intermediate}, vocab {shape.vocab}, kv heads {shape.kv_heads}), {dtype} "
        f"({bpp:g} bytes/param), context {ctx}")
    n_ridge = ridge_tokens(shape, device, bpp, ctx)
    out(f"N_ridge = {n_ridge} tokens per step (latency is flat below it, then grows ~linearly)")

    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    measure = device.name == "local" if args["measure"] is None else args["measure"]
    measured = measured_latency(spec, sizes, ctx) if measure and spec is not None else None
    pred = latency(torch.tensor(sizes))
    out("")
    out(f"{'N':>5} {'intensity':>10} {'T(N) pred ms':>13} {'T(N)/T(1)':>10}"
        + (f" {'T(N) meas ms':>13} {'T(N)/T(1)':>10} {'of roofline':>12}" if measured else ""))
    for n, t in zip(sizes, pred.tolist()):
        row = f"{n:>5} {float(intensity(shape, n, bpp, ctx)):>10.2f} {t * 1e3:>13.4f} {t / float(pred[0]):>10.2f}"
        if measured and n in measured:
            row += f" {measured[n] * 1e3:>13.4f} {measured[n] / measured[1]:>10.2f} {t / measured[n]:>12.1%}"
        out(row)
    if measured:
        out("(of roofline = predicted / measured time: how close this machine runs to its limit)")
    if measure and measured is None:
        out("(no measured T(N): a bare config.json cannot be loaded; pass a preset or a model folder)")

    alpha, gamma, c = args["alpha"], args["gamma"], args["draft_cost"]
    out("")
    out(f"chain: alpha {alpha}, gamma {gamma}, draft cost c {c}: E[tokens/step] "
        f"{expected_tokens_chain(alpha, gamma):.2f}, speedup {chain_speedup(alpha, gamma, c):.2f}x "
        f"(Leviathan et al. 2023 formula, verification assumed flat); with this T(N): "
        f"{expected_tokens_chain(alpha, gamma) / (float(latency(gamma + 1) / latency(1)) + gamma * c):.2f}x")
    if args["acceptance"] is not None:
        rates = read_acceptance(args["acceptance"])
        curves = {"roofline T(N)": latency}
        if measured:
            curves["measured T(N)"] = interpolate(measured)
        plans = {name: best_tree(rates, fn, c, args["max_nodes"], args["top_k"]) for name, fn in curves.items()}
        out(f"tree for acceptance by depth {[round(r, 3) for r in rates]}, draft cost c {c} per level:")
        for name, plan in plans.items():
            out(f"  with the {name}: best size {plan.size} nodes (depth {plan.depth}), "
                f"E[tokens/step] {plan.expected_tokens:.2f}, predicted speedup {plan.speedup:.2f}x")
        out(f"  {'size':>5} {'depth':>5} {'E[tokens]':>9} " + " ".join(f"{'speedup (' + n + ')':>24}" for n in plans))
        shown = {0, 1, 2, 4, 8, 16, 32, 60, 64, 128} | {p.size for p in plans.values()}
        for rows in zip(*(p.curve for p in plans.values())):
            size, depth, exp, _ = rows[0]
            if size in shown:
                out(f"  {size:>5} {depth:>5} {exp:>9.2f} " + " ".join(f"{r[3]:>23.2f}x" for r in rows))


def interpolate(curve: dict[int, float]):
    """T(N) from measured points: piecewise linear, extended linearly past the largest N. Noise only ever
    adds time and T never falls with N, so each point is first lowered to the smallest time to its right."""
    sizes = sorted(curve)
    xs = torch.tensor(sizes, dtype=torch.float64)
    ys = torch.tensor([curve[n] for n in sizes], dtype=torch.float64).flip(0).cummin(0).values.flip(0)

    def latency(n):
        n = torch.as_tensor(n, dtype=torch.float64)
        hi = torch.searchsorted(xs, n).clamp(1, len(sizes) - 1)  # segment [hi - 1, hi]
        x0, x1, y0, y1 = xs[hi - 1], xs[hi], ys[hi - 1], ys[hi]
        return torch.clamp(y0 + (y1 - y0) * (n - x0) / (x1 - x0), min=float(ys.min()))

    return latency


def main(argv: list[str] | None = None) -> int:
    from headway.heads.cli import run_command

    return run_command("roofline", run, argv, errors=(RooflineError,), usage=__doc__,
                       hint="a config.json or model folder goes in config=PATH; every key: --help")


if __name__ == "__main__":
    sys.exit(main())
