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
eagle (primary for eagle; EAGLE-1/2: vLLM `EagleLlamaForCausalLM`, SGLang `LlamaForCausalLMEagle`)
    config.json  one-layer Llama config (hidden/intermediate size, heads, kv heads, head_dim, rms_norm_eps,
                 rope, vocab_size V, tie_word_embeddings false), architectures
                 [LlamaForCausalLMEagle, EagleLlamaForCausalLM]: SGLang resolves the first; vLLM prefixes
                 "Eagle" to each name and resolves the first it knows.
    model.safetensors  fc.weight [h, 2h] (input cat(embed(x_t+1), f_t)), fc.bias [h] (zero), layers.0.self_attn.
                 {q,k,v,o}_proj.weight, layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}
                 _proj.weight; no input_layernorm, no final norm, no embed_tokens / lm_head (the target's are
                 shared). f = the target's final-normed last hidden state; the draft feature is the layer's
                 output (residual stream), read by the target's LM head.
    SGLang builds fc *with* a bias and silently keeps its random init when the file has none, so the zero
    fc.bias is always written (vLLM builds fc without one and ignores it).
eagle3 (primary for eagle3; official EAGLE-3 layout, vLLM and SGLang `LlamaForCausalLMEagle3`)
    config.json  one-layer Llama config (vocab_size = V, the target's), architectures
                 [LlamaForCausalLMEagle3], draft_vocab_size Vd, target_hidden_size, tie_word_embeddings false,
                 norm_before_residual false, eagle_aux_hidden_state_layer_ids (vLLM ids, top level),
                 eagle_config {eagle_aux_hidden_state_layer_ids (SGLang ids), use_aux_hidden_state: true}
    model.safetensors  fc.weight [h, 3h], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}
                 .weight [h], midlayer.self_attn.{q,k,v}_proj.weight [*, 2h], midlayer.self_attn.o_proj.weight,
                 midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight [Vd, h], d2t int64 [Vd]
                 (target id = draft id + d2t[draft id]) and t2d bool [V] only when Vd < V (vLLM refuses d2t
                 with the full vocabulary), embed_tokens.weight [V, h] (a copy of the target's: SpecForge's
                 warm start requires it, speculators reads it; vLLM and SGLang use the target's values).
    Aux-layer ids: the head fuses hidden_states[a] (input of decoder layer a). vLLM's id i captures the input
    of layer i (id = a), SGLang's id j captures the output of layer j (id = a - 1; SpecForge's default
    [1, N//2-1, N-4] is EAGLE-3's [2, N//2, N-3]). vLLM reads the top-level key first and SGLang only
    eagle_config, so both keys are written, each in its engine's convention: both engines then feed fc
    the same tensors. Exports need 3 distinct ascending aux layers in [1, N-1] (see formats/eagle3.py).
eagle3-speculators (vLLM `Eagle3Speculator`: `vllm serve DIR` with no flags)
    config.json  {architectures: [Eagle3Speculator], speculators_model_type: eagle3, transformer_layer_config
                 (the one-layer Llama config), draft_vocab_size, target_hidden_size, norm_before_residual
                 false (written explicitly; speculators 0.9.0's default is also false),
                 eagle_aux_hidden_state_layer_ids (vLLM ids),
                 speculators_config {algorithm eagle3, proposal_methods [{proposal_type greedy,
                 speculative_tokens K, ...}], default_proposal_method, verifier {name_or_path: a Hub id or
                 an absolute path, which vLLM and speculators load the target from; refused without one}}}
    model.safetensors  as eagle3 with `midlayer.` renamed `layers.0.`.
mtp (primary for mtp; DeepSeek-V3 MTP: vLLM `DeepSeekMTP`, SGLang `DeepseekV3ForCausalLMNextN`)
    model-mtp.safetensors  module k as layer N+k of the target: model.layers.{N+k}.{enorm,hnorm}.weight [h],
                 .eh_proj.weight [h, 2h] (input [enorm(embed); hnorm(h)]), .shared_head.norm.weight [h],
                 .shared_head.head.weight [V, h] (a copy of the target's LM head, shared),
                 .input_layernorm/.post_attention_layernorm.weight, .self_attn.*, .mlp.* (the block)
    merge_into_config.json  {num_nextn_predict_layers: D};  merge_into_index.json  {weight_map: shard keys}
    h^0 = the target's final-normed last hidden state (what both engines pass). The engines load MTP layers
    only for DeepSeek-V2/V3-architecture targets (SGLang: one module).
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
