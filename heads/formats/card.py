"""The model card (README.md with YAML metadata) every export carries: what the head is, how it was trained,
what it measured (from infer.evaluate's eval.json files) and the exact commands that serve it."""

from __future__ import annotations

import json
from pathlib import Path

from headway.heads.formats.common import ExportError, is_local_path

EVAL_GLOBS = ("eval*.json", "*/eval.json", "eval/*/eval.json")  # infer.evaluate writes RUN/eval/<set>-t<T>/

ARCHITECTURES = {
    "medusa": "Medusa (Cai et al. 2024): {num_heads} heads on the target's last hidden state, each "
              "{num_layers} residual SiLU block(s) and its own LM head; head k drafts the token k+2 ahead.",
    "eagle": "EAGLE-1/2 (Li et al. 2024): `fc(cat(embed(x_t+1), f_t))` into one decoder layer of the target's "
             "architecture predicting the next feature, read out by the target's frozen LM head.",
    "eagle3": "EAGLE-3 (Li et al. 2025): fuses the target's low/mid/high hidden states with `fc`, one decoder "
              "layer attending over `cat(norm(embed), norm(feature))`, an LM head over a reduced draft "
              "vocabulary mapped to target ids by `d2t`, trained with training-time test.",
    "mtp": "Multi-token prediction (DeepSeek-V3): {num_modules} sequential modules, each "
           "`eh_proj(cat(enorm(embed), hnorm(h)))` into one transformer block and a shared head "
           "(norm + the target's LM head).",
}


# -------------------------------------------------------------------------------------- evaluation

def find_eval(final_dir: Path, eval_path=None) -> list[dict]:
    """eval.json results: the given path(s), else any found next to the checkpoint (final/ or its run dir)."""
    if eval_path:
        paths = [Path(p) for p in (eval_path if isinstance(eval_path, (list, tuple)) else [eval_path])]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ExportError(f"eval={missing[0]} does not exist: pass the eval.json infer.evaluate wrote")
    else:
        paths = sorted({p for d in (Path(final_dir), Path(final_dir).parent) for g in EVAL_GLOBS
                        for p in d.glob(g)})
    results = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ExportError(f"{path} is not valid JSON ({exc.msg}): re-run infer.evaluate") from exc
        label = path.parent.name if path.name == "eval.json" else path.stem  # e.g. chat-t0
        results += [dict(r, _set=label) for r in (data if isinstance(data, list) else [data])
                    if isinstance(r, dict) and "tau" in r]
    return sorted(results, key=lambda r: (float(r.get("temperature") or 0.0), r["_set"]))


def _fmt(value, digits=2) -> str:
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return "–" if value is None else str(value)


def eval_table(results: list[dict]) -> str:
    if not results:
        return ("No evaluation was recorded with this export. Measure it with\n"
                "`python -m headway.infer.evaluate checkpoint=RUN/final temperature=0` (and `temperature=1`).\n")
    rows = ["| eval | temperature | tau | acceptance by depth | tokens/s (spec / plain / HF generate) "
            "| speedup vs plain | speedup vs HF generate | prompts | hardware |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tps = r.get("tokens_per_second") or {}
        acc = ", ".join(_fmt(a) for a in r.get("acceptance_by_depth") or [])
        rows.append(f"| {r['_set']} | {_fmt(r.get('temperature'), 1)} | {_tau_cell(r)} | {acc or '–'} "
                    f"| {_fmt(tps.get('speculative'), 1)} / {_fmt(tps.get('vanilla'), 1)} / "
                    f"{_fmt(tps.get('hf_generate'), 1)} | {_fmt(r.get('speedup_vs_vanilla'))}x "
                    f"| {_fmt(r.get('speedup_vs_hf_generate'))}x | {r.get('num_prompts', '–')} "
                    f"| {r.get('hardware') or r.get('device') or '–'} |")
    by_cat = [(r, c, v) for r in results for c, v in (r.get("by_category") or {}).items()]
    if by_cat:
        rows += ["", "| eval | temperature | category | tau | prompts |", "|---|---|---|---|---|"]
        rows += [f"| {r['_set']} | {_fmt(r.get('temperature'), 1)} | {c} | {_fmt(v.get('tau'))} "
                 f"| {v.get('num_prompts', '–')} |" for r, c, v in by_cat]
    rows += ["", "tau = tokens emitted per target forward (the bonus token included), with its 95% interval over "
                 "the prompts where recorded; acceptance by depth is conditional on the previous depth being accepted; "
                 "speedups are measured in the same run."]
    return "\n".join(rows) + "\n"


def _tau_cell(r: dict) -> str:
    """'2.41 (2.30-2.52)': tau and its 95% interval over the prompts, where the evaluation recorded one."""
    ci = r.get("tau_ci95")
    if isinstance(ci, list) and len(ci) == 2 and all(isinstance(v, (int, float)) for v in ci):
        return f"{_fmt(r.get('tau'))} ({_fmt(ci[0])}-{_fmt(ci[1])})"
    return _fmt(r.get("tau"))


# ------------------------------------------------------------------------------------------- recipe

def _flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:  # nested keys as "a.b.c"
    items = []
    for key, value in d.items():
        name = f"{prefix}{key}"
        items += _flatten(value, f"{name}.") if isinstance(value, dict) else [(name, value)]
    return items


def recipe_section(prov) -> str:
    """The run's recipe as a short table, then everything it recorded (final/config.json "training")."""
    options = ", ".join(f"`{k}={v}`" for k, v in sorted(prov.options.items())) or "defaults"
    rows = [("head options", options)]
    t = prov.training
    if t:
        data, opt, val, best = (t.get(k) or {} for k in ("data", "optimizer", "validation", "best"))
        rows += [
            ("data", f"`{data.get('name', '?')}` (`{data.get('source', '?')}`), {data.get('hidden_states', '?')} "
                     f"hidden states"),
            ("steps", f"{t.get('steps', '?')} of {t.get('max_steps', '?')} (best step {best.get('step', '?')}), "
                      f"{t.get('tokens_seen', '?')} tokens seen"),
            ("batch", f"{t.get('batch_size', '?')} x {t.get('grad_accum', '?')} accumulation x "
                      f"{t.get('processes', '?')} processes = {t.get('effective_batch_size', '?')} sequences of "
                      f"<= {t.get('max_length', '?')} tokens"),
            ("optimizer", f"AdamW lr {opt.get('lr', '?')}, betas {opt.get('betas', '?')}, {opt.get('schedule', '?')} "
                          f"schedule, warmup {opt.get('warmup_steps') or opt.get('warmup_ratio', '?')}, grad clip "
                          f"{opt.get('grad_clip', '?')}, weight decay {opt.get('weight_decay', '?')}"),
            ("validation", f"loss {_fmt(val.get('loss'), 3)}, simulated tau {_fmt(val.get('sim_tau'))}, accuracy by "
                           f"depth {', '.join(_fmt(val[k]) for k in sorted(val) if k.startswith('acc_depth_')) or '–'}"),
        ]
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    if not t:
        return table + "\nThe checkpoint records no training details.\n"
    details = json.dumps(t, indent=2, default=str)
    return table + f"\n<details><summary>Everything the run recorded</summary>\n\n```json\n{details}\n```\n</details>\n"


def datasets_of(prov) -> list[str]:
    """Hub dataset ids named in the recorded training info (only strings that look like `org/name`)."""
    found = []
    for key, value in _flatten(prov.training):
        values = value if isinstance(value, list) else [value]
        for v in values:
            if ("data" in key or "dataset" in key) and isinstance(v, str) and v.count("/") == 1 \
                    and not v.startswith((".", "/", "~")) and not v.endswith((".json", ".jsonl")):
                found.append(v)
    return sorted(set(found))


# --------------------------------------------------------------------------------------------- card

def model_card(head, layout, prov, evaluation: list[dict], license: str | None, where: str | None = None):
    """A huggingface_hub ModelCard for the export; `where` is the repo id or folder the commands load."""
    from huggingface_hub import ModelCard, ModelCardData

    where = where or "<this repo or folder>"
    data = ModelCardData(
        base_model=None if is_local_path(prov.base_model) else prov.base_model, library_name=layout.library_name, license=license,
        datasets=datasets_of(prov) or None,
        tags=["speculative-decoding", "draft-model", f"{prov.head_kind}", f"headway-{layout.name}", "headway"])
    opts = dict(prov.options)
    opts.setdefault("num_modules", opts.get("num_modules", getattr(head, "num_depths", "K")))
    arch = ARCHITECTURES.get(prov.head_kind, prov.head_kind).format_map(_Default(opts))
    serve = "\n".join(f"{s.engine}:\n\n```bash\n{s.command}\n```\n" if s.command else f"{s.engine}: {s.note}\n"
                      for s in layout.serve(where, prov))
    notes = "".join(f"\n> {n}\n" for n in layout.notes)
    revision = f" (revision `{prov.revision}`)" if prov.revision else ""
    body = f"""
# {prov.head_kind} draft head for {prov.target_name}

A speculative-decoding draft head trained with headway for the frozen target
`{prov.target_name}`{revision}. It proposes tokens that the target verifies losslessly: outputs are those of
the target alone, only faster.

- head kind: **{prov.head_kind}**; export format: **{layout.name}**; headway {prov.headway_version}
- target: `{prov.target.get('name')}` (`{prov.target.get('path')}`{revision}), hidden size
  {prov.target_shape.get('hidden_size')}, vocabulary {prov.target_shape.get('vocab_size')}
- source weights sha256: `{prov.source_sha256}`

## Architecture

{arch}

## Layout

{layout.description}
{notes}
## Training recipe

{recipe_section(prov)}
## Measured speed and acceptance

{eval_table(evaluation)}
## Serving

{layout.usage}{serve}
To run it with headway itself: `headway.heads.formats.io.load_export(<folder>)` returns the head for `infer/`.
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


class _Default(dict):
    def __missing__(self, key):
        return "?"
