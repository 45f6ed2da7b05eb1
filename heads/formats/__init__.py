"""Checkpoint layouts that serving engines load, one small module per layout family.

A layout is a bijection between a headway head's `state_dict` and the tensor names/config an engine reads,
plus the engine config and the commands that serve it. `heads.formats.io` writes and reads them generically.
Every module of this package is imported with it, and a layout module registers its layouts
(`register_layout`) when imported: a new head kind's export is one new file here, whose docstring lists
its files and who loads them. Every export also holds `headway.json` (head kind and options, target spec
and revision, headway version, sha256 of the source weights): that is what the reader rebuilds the head
from, so `load_export(dir)` gives the very head `final/` holds (tests check it bit for bit). All weights
are safetensors.

Checked against the engines' current loader code (vLLM vllm/model_executor/models/{medusa,llama_eagle,
llama_eagle3,deepseek_mtp}.py and transformers_utils/configs/{medusa,eagle,speculators/*}.py; SGLang
python/sglang/srt/models/{llama_eagle,llama_eagle3,deepseek_nextn}.py; SafeAILab/EAGLE eagle/model/cnets.py;
FasterDecoding/Medusa medusa/model/medusa_model.py).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from headway.heads.formats.common import ExportError, Provenance

LAYOUTS: dict[str, "Layout"] = {}


class Serve(NamedTuple):
    """How one engine serves a layout: a shell command, or a note when it cannot."""

    engine: str
    command: str | None = None
    note: str | None = None


def _no_tensors(head, prov) -> dict:
    return {}


def _nothing(head) -> list:
    return []


@dataclass(frozen=True)
class Layout:
    """How one head kind is laid out for one engine family. Functions take the (built) head."""

    name: str  # format=<name>
    head_kind: str  # the headway head kind it holds
    primary: bool  # what format=auto picks for this head kind
    weights_file: str
    tensor_names: Callable  # head -> {layout key: head state_dict key}
    configs: Callable  # (head, Provenance) -> {file name: JSON-able dict}
    serve: Callable  # (where: repo id or dir, Provenance) -> [Serve]
    library_name: str  # model-card metadata
    description: str  # model-card paragraph: what this layout is and who loads it
    extra_tensors: Callable = _no_tensors  # (head, Provenance) -> {layout key: tensor} not held by name
    absent: Callable = _nothing  # head -> [head state keys the layout drops]: they must be zero
    derived: Callable = _nothing  # head -> [head state keys rebuilt from extra tensors by `restore`]
    restore: Callable | None = None  # (head, {layout key: tensor}) -> {head key: tensor} for `derived`
    notes: tuple[str, ...] = field(default_factory=tuple)  # model-card caveats
    usage: str = ""  # model-card markdown before the serving commands (e.g. steps to merge into the target)


def register_layout(layout: Layout) -> Layout:
    """Make `format=<layout.name>` available; a name belongs to one layout only."""
    if layout.name in LAYOUTS and LAYOUTS[layout.name] != layout:
        raise ExportError(f"export format {layout.name!r} is already registered (for {LAYOUTS[layout.name].head_kind} "
                          f"heads): give the new layout another name")
    LAYOUTS[layout.name] = layout
    return layout


def layout_for(head_kind: str, fmt: str = "auto") -> Layout:
    """The layout `format=fmt` means for a head of `head_kind`; a clear error when it does not fit."""
    fitting = sorted(name for name, lay in LAYOUTS.items() if lay.head_kind == head_kind)
    if not fitting:
        raise ExportError(f"no export layout holds a {head_kind!r} head yet: add one in heads/formats/")
    if fmt == "auto":
        return next(LAYOUTS[name] for name in fitting if LAYOUTS[name].primary)
    if fmt not in LAYOUTS:
        raise ExportError(f"unknown format={fmt!r}: choose auto or one of {sorted(LAYOUTS)}")
    if LAYOUTS[fmt].head_kind != head_kind:
        raise ExportError(f"format={fmt} holds {LAYOUTS[fmt].head_kind} heads, but the checkpoint holds a "
                          f"{head_kind} head: use format=auto or one of {fitting}")
    return LAYOUTS[fmt]


def _import_modules() -> None:
    """Import every module of this package, so each layout module registers its layouts (not the export
    command, which imports this package)."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "export_cli":
            importlib.import_module(f"{__name__}.{module.name}")


_import_modules()

__all__ = ["LAYOUTS", "Layout", "Serve", "ExportError", "Provenance", "layout_for", "register_layout"]
