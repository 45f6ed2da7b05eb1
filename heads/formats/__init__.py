"""Checkpoint layouts that serving engines load, one small module per layout family.

A layout is a bijection between a headway head's `state_dict` and the tensor names/config an engine reads,
plus the engine config and the commands that serve it. `heads.formats.io` writes and reads them generically;
adding a head kind means adding its layouts here. Every export also holds `headway.json` (head kind and
options, target spec and revision, headway version, sha256 of the source weights): that is what the reader
rebuilds the head from, so `load_export(dir)` gives the very head `final/` holds (tests check it bit for bit).
All weights are safetensors. Shapes below: h = hidden size, V = target vocab, Vd = draft vocab, K = heads or
modules, L = residual layers per Medusa head, N = target layers.

Checked against the engines' current loader code (vLLM vllm/model_executor/models/{medusa,llama_eagle,
llama_eagle3,deepseek_mtp}.py and transformers_utils/configs/{medusa,eagle,speculators/*}.py; SGLang
python/sglang/srt/models/{llama_eagle,llama_eagle3,deepseek_nextn}.py; SafeAILab/EAGLE eagle/model/cnets.py;
FasterDecoding/Medusa medusa/model/medusa_model.py).

medusa (primary for medusa; vLLM `MedusaModel`)
    config.json  {architectures: [MedusaModel], model_type: medusa, hidden_size, vocab_size, num_heads: K,
                  num_hidden_layers: L, medusa_fc_bias: true, truncated_vocab_size: V}
    model.safetensors  blocks.{i}.layers.{j}.weight [h, h], blocks.{i}.layers.{j}.bias [h],
                       lm_heads.{i}.weight [V, h]
    vLLM's MedusaConfig renames *any* top-level key holding "num"+"heads" or "num"+"layers", so the config
    carries nothing else of that shape. Input: the target's final-normed last hidden state; head i drafts
    token t+i+2 (same as headway and the original Medusa).
medusa-original (Medusa repo / TGI)
    config.json  {medusa_num_heads: K, medusa_num_layers: L, base_model_name_or_path}
    medusa_lm_head.safetensors  {i}.{j}.linear.weight [h, h], {i}.{j}.linear.bias [h], {i}.{L}.weight [V, h]
    (nn.Sequential(ResBlock x L, Linear) per head). The original code builds `[ResBlock] * L`, one shared
    block, so for L > 1 only TGI (separate blocks) reproduces the head.
eagle (primary for eagle; EAGLE-1/2, vLLM `EagleLlamaForCausalLM`, SGLang `LlamaForCausalLMEagle`)
    ...
eagle3 (primary for eagle3; official EAGLE-3 layout, vLLM and SGLang)
    ...
eagle3-speculators (vLLM `Eagle3Speculator`, `vllm serve DIR` with no flags)
    ...
mtp (DeepSeek-V3 style; vLLM `DeepSeekMTP`, SGLang NextN)
    ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from heads.formats.common import ExportError, Provenance

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


from heads.formats import eagle, eagle3, medusa, mtp  # noqa: E402,F401  (registers their layouts)

__all__ = ["LAYOUTS", "Layout", "Serve", "ExportError", "Provenance", "layout_for", "register_layout"]
