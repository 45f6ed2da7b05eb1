"""Evaluate a draft head (or a training-free drafter) on held-out prompts.

    python -m headway.infer.evaluate checkpoint=RUN/final prompts=chat temperature=0 max_new_tokens=128
    python -m headway.infer.evaluate checkpoint=none drafter=prompt_lookup prompts=humaneval

For each prompt (batch 1, rendered with the target's chat template) it runs, interleaved so machine noise
hits all alike: speculative decoding with the drafter, the engine's plain decoding, and HF `generate()`.
It prints a table and writes OUTPUT/eval.json:

    {"target", "head", "temperature", "num_prompts",
     "max_new_tokens",
     "tau",                          emitted tokens per target verification forward, bonus included
     "tau_ci95",                     [low, high]: the 95% percentile bootstrap interval of tau over the prompts
                                     (infer.intervals; scripts/compare_evals.py compares two heads pairwise)
     "acceptance_by_depth",          P(depth d accepted | depth d-1 accepted)
     "by_category": {cat: {"tau", "num_prompts"}},
     "tokens_per_second": {"speculative", "vanilla", "hf_generate"},
     "speedup_vs_vanilla", "speedup_vs_hf_generate",
     "greedy_match"}                 temperature 0: fraction of prompts identical to plain decoding
                                     (null at temperature > 0, where outputs differ by design)
     "greedy_mismatches": [{"index", "prompt", "at", "speculative", "plain", "margin", "tie"}],
                                     temperature 0: each prompt whose outputs differ (its place in the
                                     run), the first token that differs (0-based), the two tokens, and how
                                     far apart the target's logits put them there; "tie": within fp32
                                     rounding (TIE_TOLERANCE), where a tree's forward and a decode step
                                     may round to either token
     "draft", "weight_layout",       the tree the drafter planned; the engine's weight layout
                                     (heads.kernels.weight_layout; HF generate() always runs the stock one)
     "step_ms": {"plain", "speculative", "drafting", "tree_forward", "accepting"},
                                     mean ms per step: the plain engine's, and a speculative step split
                                     into drafting, the target's forward over the tree, and accepting
                                     (verify, cache, commit); why speedup_vs_vanilla is what it is
     "draft_vocab_coverage": {"draft_vocab", "by_size": {N: share}},
                                     a head's, greedy: the share of the target's reply tokens its drafts
                                     can propose at all (the ceiling of depth-1 acceptance), and the
                                     share inside its N most frequent training tokens (what a larger
                                     draft vocabulary would cover); null for other drafters or sampling
     "per_prompt": [{"prompt", "category", "emitted", "steps"}]}
                                     each prompt's emitted tokens and target steps, in the order run;
                                     "prompt" is the first 16 hex digits of the prompt's SHA-1

and OUTPUT/eval.png (acceptance by depth, tau by category). A baseline left out of `baselines` gets null.
Bad input (a checkpoint for another target, a corrupted or missing safetensors file, an empty, malformed or
non-UTF-8 prompt file, a NaN, infinite or negative temperature, top_p outside (0, 1], a prompt longer than the
cache, an output folder that cannot be written, checked before measuring) ends with one `error:` line and
exit status 2, before anything is written. A temperature below 1e-5 decodes greedily. The checkpoint's
recorded target is loaded without its own code unless trust_remote_code=true is passed here.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from headway.heads.base import HeadError, load_head, most_frequent, read_head_config
from headway.heads.files import atomic_path, write_text_atomic
from headway.heads.target import TargetError, TargetSpec, device_problem, load_target, recorded_spec, target_preset
from headway.infer.engine import CacheFullError, EngineError, Engine, GenerationStats, encode_prompts
from headway.infer.hf_generate import generation_config, hf_generate
from headway.infer.intervals import prompt_key, tau_interval
from headway.infer.prompt_sets import PromptSetError, load_prompt_set
from headway.heads.sampling import is_greedy
from headway.heads.kernels.weight_layout import check_layout, current_layout

DEFAULT_TARGET = "smollm2-135m"  # the conf/target preset used when neither target= nor the checkpoint names one
DRAFTERS = ("head", "prompt_lookup", "draft_model")
BASELINES = ("vanilla", "hf_generate")


class EvalError(ValueError):
    """Bad evaluation input; the message says what to do."""


@dataclass
class EvalConfig:
    checkpoint: Optional[str] = None
    drafter: str = "head"
    draft_model: Optional[str] = None
    draft: Dict[str, Any] = field(default_factory=dict)
    target: Optional[TargetSpec] = None
    prompts: str = "chat"
    max_prompts: Optional[int] = None
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    max_new_tokens: int = 128
    baselines: List[str] = field(default_factory=lambda: list(BASELINES))
    seed: int = 0
    device: str = "auto"
    budget: str = "auto"
    weight_layout: str = "auto"
    output: Optional[str] = None
    plot: bool = True
    trust_remote_code: bool = False  # let transformers run the recorded target folder's own Python (never
    #                                  taken from the checkpoint: only this flag, or target.trust_remote_code)


ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


# ------------------------------------------------------------------------------------------ checks

def check_config(cfg) -> None:
    """Reject values that compose but cannot work, before anything is loaded."""
    if not math.isfinite(cfg.temperature) or cfg.temperature < 0:
        raise EvalError(f"temperature must be a finite number >= 0 (0 = greedy; below 1e-5 is greedy too), "
                        f"got {cfg.temperature}")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        raise EvalError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.top_k is not None and cfg.top_k < 1:
        raise EvalError(f"top_k must be >= 1 (or null for no top-k), got {cfg.top_k}")
    if cfg.max_new_tokens < 1:
        raise EvalError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.max_prompts is not None and cfg.max_prompts < 1:
        raise EvalError(f"max_prompts must be >= 1 or null, got {cfg.max_prompts}")
    if cfg.drafter not in DRAFTERS:
        raise EvalError(f"unknown drafter {cfg.drafter!r}: use one of {', '.join(DRAFTERS)}")
    unknown = sorted(set(cfg.baselines) - set(BASELINES))
    if unknown:
        raise EvalError(f"unknown baselines {unknown}: use a subset of {list(BASELINES)}")
    no_head = cfg.checkpoint is None or str(cfg.checkpoint).lower() == "none"
    if cfg.drafter == "head" and no_head:
        raise EvalError("pass checkpoint=RUN/final (a head folder), or checkpoint=none with "
                        "drafter=prompt_lookup or drafter=draft_model")
    if cfg.drafter != "head" and not no_head:
        raise EvalError(f"drafter={cfg.drafter} evaluates a training-free baseline: pass checkpoint=none")
    try:
        check_layout(cfg.weight_layout)
    except ValueError as exc:
        raise EvalError(str(exc)) from exc
    if cfg.budget not in ("auto", "static"):
        raise EvalError(f"budget must be auto (the measured T(N)) or static (the batch-size throttle only), "
                        f"got {cfg.budget!r}")
    if cfg.drafter == "draft_model" and not cfg.draft_model:
        raise EvalError("drafter=draft_model needs draft_model=<HF model dir or hub name sharing the tokenizer>")


def load_prompts(name_or_path: str, limit: int | None) -> list[dict]:
    """[{"prompt", "category"}] from a built-in set or a JSONL file whose lines hold a "prompt" and
    optionally a "category" (default "general"), read by infer.prompt_sets."""
    try:
        rows = [{"prompt": r["prompt"], "category": r["category"]} for r in load_prompt_set(name_or_path)]
    except PromptSetError as exc:
        raise EvalError(str(exc)) from None
    rows = round_robin_by_category(rows)[:limit]
    if not rows:
        raise EvalError(f"prompt set {name_or_path!r} holds no prompts: give at least one line with a \"prompt\"")
    return rows


def round_robin_by_category(rows: list[dict]) -> list[dict]:
    """Interleave categories (file order kept within each) so `max_prompts=N` samples every category."""
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    rank = {id(row): i for group in by_category.values() for i, row in enumerate(group)}
    return sorted(rows, key=lambda row: rank[id(row)])  # stable: category order kept within a rank


def check_lengths(prompt_ids: list[list[int]], max_new_tokens: int, target) -> None:
    """Fail before any generation if a prompt cannot fit the cache with its new tokens."""
    limit = getattr(target.config, "max_position_embeddings", None)
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    need = len(prompt_ids[longest]) + max_new_tokens
    if limit and need > limit:
        raise EvalError(f"prompt {longest} has {len(prompt_ids[longest])} tokens: with max_new_tokens="
                        f"{max_new_tokens} it needs {need} cache positions but the target holds {limit}: "
                        f"shorten the prompt or lower max_new_tokens")


# ------------------------------------------------------------------------------------- building

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = device_problem(name)
    if problem:
        raise EvalError(f"device={name} {problem}: use device=auto, or a device this machine has")
    return torch.device(name)


def build(cfg, device):
    """-> (target, drafter, head name). The target is the one the checkpoint records unless cfg.target."""
    from headway.infer.drafters import build_drafter

    override = OmegaConf.to_container(cfg.target) if cfg.target is not None else None
    if cfg.drafter == "head":
        recorded = read_head_config(cfg.checkpoint)  # its trust_remote_code is never honoured: recorded_spec
        spec = override or (recorded_spec(recorded["target"], cfg.trust_remote_code) if recorded.get("target")
                            else target_preset(DEFAULT_TARGET))
        target = load_target(spec, device=device)
        head = load_head(cfg.checkpoint, target, device=device)
        return target, build_drafter("head", target, head=head, **cfg.draft), recorded["head_kind"]
    target = load_target(override or target_preset(DEFAULT_TARGET), device=device)
    if cfg.drafter == "draft_model":
        draft = load_target({"path": cfg.draft_model, "name": Path(cfg.draft_model).name, "dtype": "auto"},
                            device=device)
        return target, build_drafter("draft_model", target, draft_model=draft, **cfg.draft), "draft_model"
    return target, build_drafter("prompt_lookup", target, **cfg.draft), "prompt_lookup"


# ------------------------------------------------------------------------------------- measuring

@dataclass
class Tally:
    """Sums over prompts, so every rate is a micro-average over all steps of all prompts."""

    speculative: GenerationStats = field(default_factory=GenerationStats)  # the speculative engine's calls, summed
    plain: GenerationStats = field(default_factory=GenerationStats)  # the plain engine's: what a step is compared with
    tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    prompts: int = 0
    replies: list[list[int]] = field(default_factory=list)  # plain decoding's tokens (greedy: the target's own)
    per_prompt: list[dict] = field(default_factory=list)  # each prompt's emitted tokens and steps (eval.json)
    mismatches: list[dict] = field(default_factory=list)  # greedy prompts whose outputs differ (greedy_divergence)

    def add_steps(self, stats: GenerationStats) -> None:
        self.speculative.add(stats)
        self.prompts += 1

    def add_plain_steps(self, stats: GenerationStats) -> None:
        self.plain.add(stats)

    def step_ms(self) -> dict:
        """Mean ms per step: the plain engine's, and a speculative step with its phases."""
        return dict(self.speculative.step_ms(), plain=self.plain.step_ms()["plain"])

    def add_time(self, method: str, tokens: int, seconds: float) -> None:
        self.tokens[method] = self.tokens.get(method, 0) + tokens
        self.seconds[method] = self.seconds.get(method, 0.0) + seconds

    @property
    def tau(self) -> float:
        return self.speculative.tau

    def tokens_per_second(self, method: str) -> float | None:
        return self.tokens[method] / max(self.seconds[method], 1e-9) if method in self.tokens else None


def measure(cfg, target, drafter, rows: list[dict], prompt_ids: list[list[int]], out=print):
    """Run every method on every prompt; -> (overall Tally, {category: Tally}, greedy matches)."""
    # drafting on every step even when sampling: tau and acceptance measure the head, not the engine's guard
    spec = Engine(target, drafter, budget=cfg.budget, weight_layout=cfg.weight_layout, stop_unpaid_drafting="never")
    plain = Engine(target, weight_layout=cfg.weight_layout)
    sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                    top_p=cfg.top_p)
    hf_cfg = generation_config(spec.eos.tolist(), target.tokenizer.pad_token_id, cfg.max_new_tokens,
                               cfg.temperature, cfg.top_k, cfg.top_p)
    warm = dict(sampling, max_new_tokens=min(8, cfg.max_new_tokens))
    spec.generate(prompt_ids[:1], **warm, seed=cfg.seed)  # first calls pay one-off setup: keep it out
    plain.generate(prompt_ids[:1], **warm, seed=cfg.seed)

    total, by_cat, matches = Tally(), {}, 0
    for i, (row, ids) in enumerate(zip(rows, prompt_ids)):
        s = spec.generate([ids], **sampling, seed=cfg.seed + i)
        cat = by_cat.setdefault(row["category"], Tally())
        total.per_prompt.append({"prompt": prompt_key(row["prompt"]), "category": row["category"],
                                 "emitted": s.stats.emitted, "steps": s.stats.row_steps})
        for tally in (total, cat):
            tally.add_steps(s.stats)
            tally.add_time("speculative", s.stats.new_tokens, s.stats.prefill_s + s.stats.decode_s)
        if "vanilla" in cfg.baselines or is_greedy(cfg.temperature):
            p = plain.generate([ids], **sampling, seed=cfg.seed + i)
            matches += int(p.tokens[0] == s.tokens[0])
            if is_greedy(cfg.temperature) and p.tokens[0] != s.tokens[0]:
                total.mismatches.append(dict(index=i, prompt=total.per_prompt[-1]["prompt"],
                                             **greedy_divergence(target, ids, s.tokens[0], p.tokens[0])))
            if is_greedy(cfg.temperature):
                total.replies.append(p.tokens[0])
            total.add_plain_steps(p.stats)
            total.add_time("vanilla", p.stats.new_tokens, p.stats.prefill_s + p.stats.decode_s)
        if "hf_generate" in cfg.baselines:
            h = hf_generate(target.model, [ids], hf_cfg, seed=cfg.seed + i)
            total.add_time("hf_generate", h.new_tokens, h.seconds)
        out(f"  [{i + 1}/{len(rows)}] {row['category']}: {len(s.tokens[0])} tokens, "
            f"tau {s.stats.tau:.2f}, {s.stats.tokens_per_second:.1f} tok/s")
    return total, by_cat, matches


TIE_TOLERANCE = 1e-4  # logits closer than this (relative to their size) are a tie at fp32 rounding: verifying a
# tree and a decode step sum in different orders, so a tie can go either way between them (a verification error
# picks a token the target clearly ranks lower)


def greedy_divergence(target, prompt: list[int], speculative: list[int], plain: list[int]) -> dict:
    """Where two greedy outputs of one prompt first differ, and the target's logits for the two tokens there (its
    forward over the prompt and the plain output before that token): a tie, or a real difference."""
    at = next((k for k, (a, b) in enumerate(zip(speculative, plain)) if a != b), min(len(speculative), len(plain)))
    if at == min(len(speculative), len(plain)):  # one output is the other's prefix: no tie explains that
        return {"at": at, "speculative": None, "plain": None, "margin": None, "tie": None}
    device = next(target.model.parameters()).device
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + plain[:at]], device=device), logits_to_keep=1).logits[0, -1]
    pair = logits[[speculative[at], plain[at]]].double()  # [2]
    margin = float((pair[0] - pair[1]).abs())
    return {"at": at, "speculative": speculative[at], "plain": plain[at], "margin": margin,
            "tie": margin <= TIE_TOLERANCE * max(1.0, float(pair.abs().max()))}


COVERAGE_SIZES = (4096, 8192, 16384, 32768)  # draft vocabulary sizes a greedy evaluation reports coverage for


def draft_vocab_coverage(head, replies: list[list[int]]) -> dict | None:
    """Of the target's greedy reply tokens, the share a head's drafts can propose at all, and the share inside
    its N most frequent training tokens for COVERAGE_SIZES (chosen as a draft vocabulary of N would be). A
    token outside can never be accepted, so a prompt set far from the training data shows here first."""
    counts = getattr(head, "token_counts", None)
    tokens = torch.tensor([t for reply in replies for t in reply], dtype=torch.long)
    if counts is None or tokens.numel() == 0:
        return None
    share = lambda ids: torch.isin(tokens, ids).float().mean().item()  # noqa: E731
    by_size = {n: share(most_frequent(counts, n)) for n in COVERAGE_SIZES if n < counts.numel()}
    return {"draft_vocab": head.draftable()[tokens].float().mean().item(), "by_size": by_size}


def results(cfg, target, head_name: str, total: Tally, by_cat: dict, matches: int, draft: dict | None = None,
            coverage: dict | None = None) -> dict:
    """The eval.json dict (schema in the module docstring)."""
    tps = {m: total.tokens_per_second(m) for m in ("speculative", *BASELINES)}
    if "vanilla" not in cfg.baselines:
        tps["vanilla"] = None  # measured only for greedy_match
    ratio = lambda m: tps["speculative"] / tps[m] if tps[m] else None  # noqa: E731
    return {
        "target": target.spec.name,
        "head": head_name,
        "temperature": float(cfg.temperature),
        "num_prompts": total.prompts,
        "max_new_tokens": int(cfg.max_new_tokens),
        "tau": total.tau,
        "tau_ci95": tau_interval([p["emitted"] for p in total.per_prompt], [p["steps"] for p in total.per_prompt]),
        "acceptance_by_depth": total.speculative.acceptance_by_depth,
        "by_category": {c: {"tau": t.tau, "num_prompts": t.prompts} for c, t in sorted(by_cat.items())},
        "tokens_per_second": tps,
        "speedup_vs_vanilla": ratio("vanilla"),
        "speedup_vs_hf_generate": ratio("hf_generate"),
        "greedy_match": matches / total.prompts if is_greedy(cfg.temperature) else None,
        "greedy_mismatches": total.mismatches if is_greedy(cfg.temperature) else None,
        "draft": draft or {},  # the drafter and, for planned trees, the size and the speedup it predicted
        "weight_layout": current_layout(target.model),  # the engines' (HF generate() runs the stock one)
        "step_ms": total.step_ms(),
        "draft_vocab_coverage": coverage,
        "per_prompt": total.per_prompt,
    }


# --------------------------------------------------------------------------------------- output

def print_report(res: dict, out=print) -> None:
    out(f"\ntarget {res['target']}, drafter {res['head']}, temperature {res['temperature']}, "
        f"{res['num_prompts']} prompts")
    out(f"{'category':<16} {'prompts':>7} {'tau':>6}")
    for cat, r in res["by_category"].items():
        out(f"{cat:<16} {r['num_prompts']:>7} {r['tau']:>6.2f}")
    out(f"{'all':<16} {res['num_prompts']:>7} {res['tau']:>6.2f}")
    if res.get("tau_ci95"):
        low, high = res["tau_ci95"]
        out(f"tau {res['tau']:.3f}, 95% interval over these prompts {low:.3f}-{high:.3f}")
    out("acceptance by depth: " + "  ".join(f"d{d + 1} {a:.3f}" for d, a in enumerate(res["acceptance_by_depth"])))
    out(f"{'method':<16} {'tokens/s':>9} {'speculative is':>15}")
    for method, tps in res["tokens_per_second"].items():
        speedup = {"speculative": 1.0, "vanilla": res["speedup_vs_vanilla"],
                   "hf_generate": res["speedup_vs_hf_generate"]}[method]
        out(f"{method:<16} {_num(tps, '9.1f')} {_num(speedup, '14.2f')}x")
    if res["greedy_match"] is not None:
        out(f"greedy match with plain decoding: {res['greedy_match']:.3f}")
        for miss in res.get("greedy_mismatches") or []:
            out(f"  prompt {miss['index'] + 1} differs from its token {miss['at'] + 1} on: " + mismatch_words(miss))
    if res.get("draft"):
        out("draft: " + ", ".join(f"{k} {v}" for k, v in res["draft"].items()))
    if res.get("step_ms", {}).get("speculative") is not None:
        out(step_line(res["step_ms"]))
    if res.get("draft_vocab_coverage"):
        cov = res["draft_vocab_coverage"]
        out(f"reply tokens the drafts can propose: {cov['draft_vocab']:.1%} (inside the N most frequent training "
            "tokens: " + ", ".join(f"{n:,} {share:.1%}" for n, share in cov["by_size"].items()) + ")")


def mismatch_words(miss: dict) -> str:
    if miss["tie"] is None:
        return "one output stops there while the other goes on: a verification error, please report it"
    if miss["tie"]:
        return (f"tokens {miss['speculative']} and {miss['plain']} tie in the target's logits (margin "
                f"{miss['margin']:.1e}): fp32 rounding picks either, the output is still the target's")
    return (f"tokens {miss['speculative']} and {miss['plain']} differ by {miss['margin']:.3g} in the target's logits, "
            f"more than rounding: a verification error, please report it")


def step_line(ms: dict) -> str:
    """'a speculative step: 20.7 ms = drafting 2.6 + tree forward 17.4 + accepting 0.7 (1.95 plain steps of 10.6 ms)'"""
    line = (f"a speculative step: {ms['speculative']:.1f} ms = drafting {ms['drafting']:.1f} + tree forward "
            f"{ms['tree_forward']:.1f} + accepting {ms['accepting']:.1f}")
    if ms.get("plain"):
        line += f" ({ms['speculative'] / ms['plain']:.2f} plain steps of {ms['plain']:.1f} ms)"
    return line


def _num(v, spec: str) -> str:
    return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))


def default_output(cfg) -> Path:
    prompts = Path(cfg.prompts).stem
    name = f"{prompts}-t{cfg.temperature:g}"
    if cfg.drafter == "head":
        return Path(cfg.checkpoint).resolve().parent / "eval" / name
    return Path("outputs") / "eval" / f"{cfg.drafter}-{name}"


def write_results(res: dict, directory: Path, plot: bool) -> list[Path]:
    """eval.json (and eval.png) written to temp files, then renamed: never half-written."""
    text = json.dumps(finite_or_null(res), indent=2, allow_nan=False) + "\n"  # JSON has no NaN or Infinity
    try:
        directory.mkdir(parents=True, exist_ok=True)
        written = [write_text_atomic(directory / "eval.json", text)]
        if plot:
            with atomic_path(directory / "eval.png") as tmp:
                plot_results(res, tmp)
            written.append(directory / "eval.png")
    except OSError as exc:
        raise EvalError(f"cannot write the results to {directory}: {exc.strerror or exc}; "
                        f"pass a writable output=") from None
    return written


def finite_or_null(value):
    """res with every NaN or infinite float replaced by None (null in eval.json)."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def check_writable(directory: Path) -> None:
    """Write (and delete) a probe file in the results folder, or in its nearest existing ancestor, before
    anything is measured: a read-only or full disk fails now, and a refused run leaves nothing behind."""
    existing = next(p for p in [directory.absolute(), *directory.absolute().parents] if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(existing))
        probe = existing / f".headway-writable-{os.getpid()}"
        probe.write_bytes(b"headway")
        probe.unlink()
    except OSError as exc:
        raise EvalError(f"cannot write the results to {directory}: {exc.strerror or exc}; pass a writable "
                        f"output=DIR") from None


def plot_results(res: dict, file) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    acc = res["acceptance_by_depth"]
    left.bar(range(1, len(acc) + 1), acc, color="tab:blue")
    left.set_xticks(range(1, len(acc) + 1))
    left.set(xlabel="draft depth", ylabel="P(accepted | parent accepted)", ylim=(0, 1),
             title=f"acceptance by depth (tau {res['tau']:.2f})")
    cats = list(res["by_category"])
    right.bar(cats, [res["by_category"][c]["tau"] for c in cats], color="tab:orange")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(ylabel="tau (tokens per target forward)", title="tau by category")
    right.tick_params(axis="x", rotation=45)
    fig.suptitle(f"{res['head']} on {res['target']}, temperature {res['temperature']:g}")
    fig.tight_layout()
    fig.savefig(file, format="png", dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ main

def evaluate(cfg, out=print) -> dict:
    """Validate, load, measure, write. Raises the errors listed in ERRORS on bad input."""
    check_config(cfg)
    rows = load_prompts(cfg.prompts, cfg.max_prompts)
    output = Path(cfg.output) if cfg.output else default_output(cfg)
    check_writable(output)  # before minutes of measuring, not after
    device = resolve_device(cfg.device)
    target, drafter, head_name = build(cfg, device)
    prompt_ids = encode_prompts(target.tokenizer, [r["prompt"] for r in rows])
    check_lengths(prompt_ids, cfg.max_new_tokens, target)
    out(f"evaluating {head_name} on {target.spec.name}: {len(rows)} prompts from {cfg.prompts}, "
        f"temperature {cfg.temperature}, max_new_tokens {cfg.max_new_tokens}, {device}")
    total, by_cat, matches = measure(cfg, target, drafter, rows, prompt_ids, out)
    coverage = draft_vocab_coverage(getattr(getattr(drafter, "proposer", None), "head", None), total.replies)
    res = results(cfg, target, head_name, total, by_cat, matches, drafter.describe(), coverage)
    print_report(res, out)
    written = write_results(res, output, cfg.plot)
    out("wrote " + ", ".join(str(p) for p in written))
    return res


ERRORS = (EvalError, HeadError, TargetError, EngineError, CacheFullError)


@hydra.main(config_path=str(Path(__file__).resolve().parents[1] / "conf"), config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        evaluate(cfg)
    except ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
