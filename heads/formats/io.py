"""Write a head in a layout, and read any layout back into the headway head it came from.

    export_head(final_dir, output, fmt)  -> folder with the engine files, headway.json, README.md
    load_export(folder, target=None)     -> the DraftHead, equal to load_head(final_dir)
"""

from __future__ import annotations

import json
from pathlib import Path

from headway.heads.base import HEAD_REGISTRY, WEIGHTS_NAME, DraftHead, _import_builtin_heads, load_head, read_head_config
from headway.heads.formats import Layout, layout_for
from headway.heads.files import file_sha256
from headway.heads.formats.common import (PROVENANCE_FILE, ExportError, Provenance, check_output, check_output_apart,
                                  check_tensors, check_writable, load_tensors, rename, require_finite,
                                  require_zero, save_tensors, target_reference, write_atomically)

TRAINING_KEYS = ("training", "train", "recipe")  # where a run's final/config.json may record how it was trained


# ------------------------------------------------------------------------------------------- writing

def layout_tensors(layout: Layout, head: DraftHead, prov: Provenance) -> dict:
    """The exact tensors `layout` holds for `head`; refuses a head the layout cannot represent."""
    state = head.state_dict()
    uncovered = sorted(set(state) - set(layout.tensor_names(head).values()) - set(layout.absent(head))
                       - set(layout.derived(head)))
    if uncovered:
        raise ExportError(f"format={layout.name} cannot hold the head tensors {uncovered[:5]}: "
                          f"fix the layout in heads/formats/{layout.head_kind}.py")
    require_zero(state, layout.absent(head), layout.name)
    return expected_tensors(layout, head, prov)


def expected_tensors(layout: Layout, head: DraftHead, prov: Provenance) -> dict:
    """Names, shapes and dtypes (and values) the layout writes for this head."""
    return {**rename(head.state_dict(), layout.tensor_names(head)), **layout.extra_tensors(head, prov)}


def provenance_for(head: DraftHead, layout: Layout, final_dir: Path, base_model: str | None = None,
                   num_speculative_tokens: int | None = None) -> Provenance:
    config = read_head_config(final_dir)
    training = next((config[k] for k in TRAINING_KEYS if isinstance(config.get(k), dict)), {})
    depth = head.max_draft_depth or 5
    return Provenance(
        format=layout.name, head_kind=head.kind, options=dict(head.options), target=config.get("target") or {},
        target_shape=config.get("target_shape", {}),
        base_model=target_reference(config.get("target") or {}, base_model),
        num_speculative_tokens=int(num_speculative_tokens or depth),
        source_sha256=file_sha256(Path(final_dir) / WEIGHTS_NAME), training=training)


def write_layout(head: DraftHead, layout: Layout, prov: Provenance, folder: Path) -> None:
    """Engine files + headway.json into an existing (temporary) folder."""
    metadata = {"format": "pt", "headway_format": layout.name, "head_kind": head.kind,
                "headway_version": prov.headway_version}
    save_tensors(layout_tensors(layout, head, prov), folder / layout.weights_file, metadata)
    for name, content in layout.configs(head, prov).items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    (folder / PROVENANCE_FILE).write_text(json.dumps(prov.to_dict(), indent=2, default=str) + "\n")


def export_head(final_dir, output, fmt: str = "auto", overwrite: bool = False, eval_path=None,
                base_model: str | None = None, num_speculative_tokens: int | None = None,
                license: str | None = "apache-2.0", where: str | None = None, target=None,
                trust_remote_code: bool = False) -> Path:
    """Export the head in `final_dir` to `output` (atomically) with a model card; returns `output`.
    `where` is what the card's serving commands load (the Hub repo id when pushing; default: `output`).
    The output never is, contains or lies inside `final_dir` or its run directory."""
    from headway.heads.formats.card import find_eval, model_card

    final_dir, output = Path(final_dir), Path(output)
    check_output_apart(output, final_dir)  # fail before the (slow) target load
    check_output(output, overwrite)
    kind = read_head_config(final_dir)["head_kind"]
    layout = layout_for(kind, fmt)
    check_writable(output)
    head = load_head(final_dir, target=target, trust_remote_code=trust_remote_code)
    require_finite(head.state_dict(), Path(final_dir) / WEIGHTS_NAME)
    prov = provenance_for(head, layout, final_dir, base_model, num_speculative_tokens)
    evaluation = find_eval(final_dir, eval_path)

    def fill(folder: Path) -> None:
        write_layout(head, layout, prov, folder)
        model_card(head, layout, prov, evaluation, license, where or str(output)).save(folder / "README.md")

    return write_atomically(output, fill, overwrite)


# ------------------------------------------------------------------------------------------- reading

def read_provenance(folder: Path) -> Provenance:
    path = Path(folder) / PROVENANCE_FILE
    if not path.is_file():
        raise ExportError(f"{folder} has no {PROVENANCE_FILE}: it was not exported by headway "
                          f"(export it with scripts/export.py)")
    try:
        return Provenance.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ExportError(f"{path} is corrupted ({exc}): re-export the head") from exc


def build_empty_head(prov: Provenance, target) -> DraftHead:
    if prov.head_kind not in HEAD_REGISTRY:
        _import_builtin_heads()
    head = HEAD_REGISTRY[prov.head_kind](target.config, **prov.options)
    head.attach(target)
    return head


def load_export(folder, target=None, device="cpu", trust_remote_code: bool = False) -> DraftHead:
    """Rebuild the headway head from an exported folder (any layout), e.g. to run it with infer/. The target
    headway.json names is loaded with the caller's `trust_remote_code`, never the one the file records."""
    from headway.heads.base import check_fits_target
    from headway.heads.target import load_target, recorded_spec

    folder = Path(folder)
    prov = read_provenance(folder)
    layout = layout_for(prov.head_kind, prov.format)
    target = target or load_target(recorded_spec(prov.target, trust_remote_code), device=device)
    check_fits_target({"target_shape": prov.target_shape}, target, folder)
    head = build_empty_head(prov, target)
    found = load_tensors(folder / layout.weights_file)
    check_tensors(found, expected_tensors(layout, head, prov), str(folder / layout.weights_file))
    state = {old: found[new] for new, old in layout.tensor_names(head).items()}
    state.update({k: head.state_dict()[k].new_zeros(head.state_dict()[k].shape) for k in layout.absent(head)})
    if layout.restore is not None:
        state.update(layout.restore(head, found))
    head.load_state_dict(state, strict=True)
    dtype = next(target.model.parameters()).dtype
    return head.to(device=device, dtype=dtype).eval()
