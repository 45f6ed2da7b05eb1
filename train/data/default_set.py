"""The embedded default dataset (`data=default`): prompts answered by the default target, no external data.

Prompts: a hand-written multi-category set (train/data/builtin/default_prompts.jsonl), coding prompts from
the installed Python standard library's docstrings, and prompts the target writes itself
(train/data/self_prompts.py, `regen.self_prompts` per category). Responses: written by the frozen target
(self-distillation; a share sampled, the rest greedy), on first use, offline, into $HEADWAY_CACHE/data/;
later runs reuse the files. With a capture (training reads its features from the automatic offline cache)
the target's hidden states are stored in that cache during the same pass.

Files, all keyed by what changes them: default-<target>-<digest>-prompts.jsonl (the self-written prompts
kept), -candidates.jsonl (every candidate written, kept or not), default-<target>-<digest>.jsonl (the
conversations) and its .report.json. A killed build resumes from its `.partial` files; a final file appears
(by rename) only when complete. A larger build copies the candidates and answers earlier builds wrote the same
way (train/data/reuse.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

from headway.heads.files import swap_in, write_json_atomic, write_text_atomic
from headway.heads.target import cache_root
from headway.train.data import overlap
from headway.train.data.config import DataError, RegenConfig
from headway.train.data.decode import generating, resolve_precision
from headway.train.data.regenerate import (HOW_NOT_WHAT, GenerationSettings, JsonlSink, ProgressBar, content_settings,
                                           done_ids, prompt_rows, provenance_of, regenerate, stop_token_ids,
                                           unwritable)
from headway.train.data.reuse import earlier_builds, reusable_answers, reusable_candidates
from headway.train.data.self_prompts import (SelfPromptSettings, candidate_rows, example_pools, select_prompts,
                                             write_candidates)
from headway.train.data.vllm_decode import open_decoder

WRITTEN_PROMPTS = Path(__file__).parent / "builtin" / "default_prompts.jsonl"
STDLIB_PROMPTS = Path(__file__).parent / "builtin" / "stdlib_prompts.jsonl"  # train/data/stdlib_prompts.py
MORE_PROMPTS = Path(__file__).parent / "builtin" / "more_prompts.jsonl"  # regen.extra_prompts=builtin:more
# self-prompt settings at the value builds had before the setting existed: left out, so those builds keep their
# candidates' provenance and their dataset's key (the key also leaves out examples=0, as it did before examples)
UNRECORDED_DEFAULTS = {("examples_shared", 1)}
UNKEYED_DEFAULTS = UNRECORDED_DEFAULTS | {("examples", 0)}
log = logging.getLogger(__name__)


def default_prompts(num_prompts: int | None = None, extra: str | None = None) -> list[dict]:
    """[{"id", "category", "prompt", "source"}]: the written set, then `extra` (regen.extra_prompts: a file or
    builtin:more), then the stdlib coding prompts (the self-written ones need the target: see
    self_written_prompts)."""
    written = _read_prompts(WRITTEN_PROMPTS, "written")
    prompts = written + extra_prompts(extra, {p["id"] for p in written}) + _read_prompts(STDLIB_PROMPTS, "stdlib")
    return prompts[:num_prompts] if num_prompts else prompts


def _read_prompts(path: Path, source: str) -> list[dict]:
    return [dict(json.loads(line), source=source) for line in path.read_text().split("\n") if line.strip()]


def extra_prompts(spec: str | None, taken: set[str]) -> list[dict]:
    """More written prompts (source "written"), checked line by line; those that ask a held-out evaluation
    question (train/data/overlap.py) are left out, with a warning, so `evaluate prompts=chat` stays held out."""
    if not spec:
        return []
    path = MORE_PROMPTS if spec == "builtin:more" else Path(spec).expanduser()
    where = f"data.regen.extra_prompts={spec}"
    try:
        lines = path.read_text().split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{where}: cannot read {path} ({exc.__class__.__name__}): give a JSONL file of "
                        '{"id", "category", "prompt"} rows') from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and all(isinstance(row.get(k), str) and row[k].strip()
                                               for k in ("id", "category", "prompt"))
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise DataError(f'{where}: line {n} of {path} is not a {{"id", "category", "prompt"}} row of '
                            "non-empty strings")
        if row["id"] in taken:
            raise DataError(f"{where}: line {n} of {path}: the id {row['id']!r} is taken; give each prompt its own id")
        taken.add(row["id"])
        rows.append({"id": row["id"], "category": row["category"], "prompt": row["prompt"], "source": "written"})
    if not rows:
        raise DataError(f"{where}: {path} holds no prompts")
    kept = [r for r in rows if not overlap.held_out_index().overlap(r["prompt"])]
    if len(kept) < len(rows):
        log.warning("%s: %d of %d prompts ask a held-out evaluation question and are left out", where,
                    len(rows) - len(kept), len(rows))
    return kept


def settings_of(regen: RegenConfig) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=regen.max_new_tokens, temperature=regen.temperature,
                              top_p=regen.top_p, sampled_fraction=regen.sampled_fraction,
                              batch_size=regen.batch_size, seed=regen.seed, backend=regen.backend,
                              vllm_python=regen.vllm_python, weight_layout=regen.weight_layout,
                              precision=regen.precision)


def self_prompt_settings(regen: RegenConfig) -> SelfPromptSettings:
    if regen.self_prompt_examples < 0:
        raise DataError(f"data.regen.self_prompt_examples={regen.self_prompt_examples}: use 0 (the category hint "
                        "alone) or more written prompts shown before each self-written one")
    if regen.self_prompt_examples_shared < 1:
        raise DataError(f"data.regen.self_prompt_examples_shared={regen.self_prompt_examples_shared}: use 1 (each "
                        "candidate its own draw of examples) or more consecutive candidates sharing one draw")
    # no examples shown: nothing to share, and an unsteered build keeps the key it had
    shared = regen.self_prompt_examples_shared if regen.self_prompt_examples else 1
    return SelfPromptSettings(per_category=regen.self_prompts, oversample=regen.self_prompt_oversample,
                              max_new_tokens=regen.self_prompt_max_new_tokens,
                              temperature=regen.self_prompt_temperature, top_p=regen.self_prompt_top_p,
                              batch_size=regen.batch_size, seed=regen.seed, examples=regen.self_prompt_examples,
                              examples_shared=shared)


def default_dataset_path(regen: RegenConfig, prompts: list[dict]) -> Path:
    """Keyed by everything that changes the conversations (not batch size)."""
    skip = set(HOW_NOT_WHAT)
    key = {"prompts": [(p["id"], p["prompt"]) for p in prompts], "target": regen.target,
           "settings": content_settings(settings_of(regen))}
    if regen.self_prompts:  # key of a default set without self-written prompts unchanged
        key["self_prompts"] = {k: v for k, v in asdict(self_prompt_settings(regen)).items()
                               if k not in skip and (k, v) not in UNKEYED_DEFAULTS}  # earlier keys unchanged
        key["decontamination"] = overlap.RULES  # which candidates the held-out filter drops
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / "data" / f"default-{regen.target_name}-{digest}.jsonl"


def ensure_default_dataset(regen: RegenConfig, device: str = "cpu", capture=None) -> Path:
    """Path of the complete default dataset, generating it with the target first if needed.
    capture: a train.data.capture.FeatureCapture (its target is used when it is the generating one)."""
    regen = replace(regen, precision=resolve_precision(regen.precision, device))  # it keys the data
    prompts = default_prompts(regen.num_prompts, regen.extra_prompts)
    final = default_dataset_path(regen, prompts)
    if final.is_file():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = open(final.with_suffix(".lock"), "w")
    except OSError as exc:
        raise unwritable(final.parent, exc) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another job building the same set: wait, then reuse its file
        if not final.is_file():
            build_default_dataset(regen, prompts, final, device, capture)
    return final


def generating_target(regen: RegenConfig, device: str, capture):
    """The capture's (already loaded, training) target when it is the one that writes the data, else a
    freshly loaded one and no capture (features of another model would be wrong)."""
    target = capture.target if capture is not None else None
    if target is not None and (target.spec.path, target.spec.name) == (regen.target, regen.target_name):
        return target, capture
    from headway.heads.target import load_target

    return load_target({"path": regen.target, "name": regen.target_name}, device=device), None


def build_default_dataset(regen: RegenConfig, prompts: list[dict], final: Path, device: str = "cpu",
                          capture=None) -> dict:
    partial = final.with_name(final.name + ".partial")
    started = time.perf_counter()
    target, capture = generating_target(regen, device, capture)
    with open_decoder(settings_of(regen), target, [final] if not final.is_file() else []) as decoder, \
            generating(target, None if decoder else regen.weight_layout,
                       "fp32" if decoder else regen.precision):  # the self-written prompts too
        return _build(regen, prompts, final, partial, started, target, capture, decoder)


def _build(regen, prompts, final, partial, started, target, capture, decoder) -> dict:
    own = self_written_prompts(regen, target, prompts, final, decoder)
    rows, _ = prompt_rows(prompts + own)
    log.info("building the default dataset (%d prompts, %d self-written, answered by %s, once) into %s%s",
             len(rows), len(own), regen.target_name, final,
             f", hidden states into {capture.directory}" if capture and not decoder else "")
    reused = reuse_answers(regen, rows, target, final, partial)
    stats = regenerate(rows, target, partial, settings_of(regen), capture=capture, decoder=decoder)
    if done_ids(partial) != {r["id"] for r in rows}:
        raise DataError(f"default dataset build incomplete in {partial}: run again to resume")
    stats["resumed"] -= reused
    stats.update(reused=reused, conversations=len(rows), self_written=len(own),
                 seconds=round(time.perf_counter() - started, 1),
                 target=regen.target_name, settings=asdict(settings_of(regen)))
    try:  # how it was built (read by reports), then the data itself
        write_json_atomic(report_path(final), stats)
        swap_in(partial, final)
    except OSError as exc:
        raise unwritable(final, exc) from None
    log.info("default dataset ready: %s (%s)", final, stats)
    return stats


def reuse_answers(regen: RegenConfig, rows: list[dict], target, final: Path, partial: Path) -> int:
    """Copy into the partial build the rows earlier complete builds answered exactly as this one would
    (train/data/reuse.py); -> how many. Rows already in the partial (a resumed build) are left alone."""
    if not regen.reuse:
        return 0
    sink = JsonlSink(partial)
    try:
        todo = [r for r in rows if r["id"] not in sink.done]
        found = reusable_answers(todo, provenance_of(target, settings_of(regen), "hf"), earlier_builds(final))
        sink.write(found)
    finally:
        sink.close()
    if found:
        log.info("reusing %d answers of earlier default dataset builds (same prompts and generation settings)",
                 len(found))
    return len(found)


def self_written_prompts(regen: RegenConfig, target, fixed: list[dict], final: Path, decoder=None) -> list[dict]:
    """The target's own prompts, filtered and balanced (cached next to the dataset; resumable)."""
    settings = self_prompt_settings(regen)
    if settings.per_category <= 0:
        return []
    done = prompts_path(final)
    if done.is_file():
        return [json.loads(line) for line in done.read_text().split("\n") if line.strip()]
    sink = JsonlSink(done.with_name(done.name + ".partial"))
    rows = candidate_rows(settings)
    pools = example_pools([p for p in fixed if p["source"] == "written"])
    provenance = candidate_provenance(regen, target, pools)
    if regen.reuse:  # the candidates of the same ids earlier builds wrote the same way
        sink.write(reusable_candidates({r["id"] for r in rows} - sink.done, provenance,
                                       earlier_builds(final, "-candidates")))
    todo = [r for r in rows if r["id"] not in sink.done]
    bar = ProgressBar(len(rows), len(rows) - len(todo), "writing prompts", True)
    for batch, tokens in write_candidates(target, todo, settings, stop_token_ids(target.tokenizer), decoder, pools):
        sink.write([dict(r, provenance=provenance) for r in batch])
        bar.update(len(batch), tokens)
    bar.close()
    sink.close()
    order = {r["id"]: i for i, r in enumerate(rows)}
    candidates = sorted((json.loads(line) for line in sink.path.read_text().split("\n") if line.strip()),
                        key=lambda r: order.get(r["id"], len(order)))
    kept, dropped = select_prompts(candidates, settings.per_category, overlap.held_out_index(),
                                   [p["prompt"] for p in fixed])
    log.info("self-written prompts: %d kept of %d candidates (dropped: %s)", len(kept), len(candidates), dropped)
    try:
        write_text_atomic(done, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
        sink.path.replace(candidates_path(final))  # kept for larger builds to reuse
    except OSError as exc:
        raise unwritable(done, exc) from None
    return kept


def candidate_provenance(regen: RegenConfig, target, pools: dict[str, list[str]]) -> dict:
    """What a self-written candidate depends on besides its id (not how many are written, nor batch size)."""
    settings = {k: v for k, v in asdict(self_prompt_settings(regen)).items()
                if k not in ("per_category", "oversample", "batch_size") and (k, v) not in UNRECORDED_DEFAULTS}
    shown = hashlib.sha256(json.dumps(pools, sort_keys=True).encode()).hexdigest()[:12]
    return {"target": target.spec.name, "target_path": target.spec.path, "precision": regen.precision,
            **settings, "example_pools": shown}


def prompts_path(final: Path) -> Path:
    return final.with_name(final.stem + "-prompts.jsonl")


def candidates_path(final: Path) -> Path:
    """Every self-written candidate of the build, kept or dropped, with how it was written."""
    return final.with_name(final.stem + "-candidates.jsonl")


def report_path(final: Path) -> Path:
    return final.with_name(final.name + ".report.json")
