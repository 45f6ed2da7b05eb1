"""EAGLE-3 layouts: the official layout vLLM and SGLang load (`eagle3`) and vLLM's speculators layout
(`eagle3-speculators`, `vllm serve DIR` with no flags).

headway's EAGLE-3 head already uses the official names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`),
so `eagle3` is the identity map and the speculators layout renames `midlayer.` to `layers.0.`.

Aux-layer ids. The head fuses hidden_states[a] for a in `aux_layers`, i.e. the *input* of decoder layer a.
The engines count differently:
  * vLLM captures `hidden_states + residual` before layer i for every i in `eagle_aux_hidden_state_layer_ids`
    (top-level key, read first; also the speculators key): vLLM id = a.
  * SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures before layer id + 1, i.e. the
    *output* of layer id (SpecForge writes [1, N//2-1, N-4] for the default [2, N//2, N-3]): SGLang id = a - 1.
Both engines capture in ascending layer order, once per id, neither can capture the embedding output
(a = 0) or the final-normed state (a = N), and vLLM's `fc` reads exactly 3 hidden states. So the export writes both keys, each in its engine's convention
(vLLM's top-level key wins in vLLM, SGLang only reads eagle_config), and refuses aux layers outside
[1, N-1], repeated or out of ascending order. `norm_before_residual` is always written (default false: the fused feature,
not its norm, is the residual, EAGLE-3's code and the default of vLLM and speculators 0.9.0). The EAGLE 3.1 keys
`norm_before_fc` and `norm_output` are written only for a head trained with them (head options of the same
names; vLLM 0.32 and speculators 0.9.0 read both): `norm_output` means opposite things to the peers (vLLM: feed
the *normed* output to the next step, default false; SpecForge: apply `norm` before `lm_head`, default true), so
a default head leaves it out and each peer's default is EAGLE-3's computation. SGLang's reading of these keys is
not checked here: serve EAGLE 3.1 variants with vLLM.

Peers' extra expectations: SpecForge's warm start requires `embed_tokens.weight` in the draft and speculators
reads it from there first, so both layouts carry a copy of the target's input embedding (V x h more on disk). With the full vocabulary both
layouts leave d2t/t2d out: vLLM has no parameter for d2t then (it refuses the draft) and speculators builds no
such buffers (unexpected keys); SGLang needs none. SpecForge's draft always has them, so its warm start of a
full-vocabulary export reports them missing: serving comes first.

Files (h = hidden size, V = target vocab, Vd = draft vocab, K = heads or modules, L = residual layers per
Medusa head, N = target layers):

eagle3 (primary for eagle3; official EAGLE-3 layout, vLLM and SGLang `LlamaForCausalLMEagle3`)
    config.json  Llama config, num_hidden_layers = the head's num_layers (vocab_size = V, the target's), architectures
                 [LlamaForCausalLMEagle3], draft_vocab_size Vd, target_hidden_size, tie_word_embeddings false,
                 norm_before_residual, norm_before_fc / norm_output (only when true),
                 eagle_aux_hidden_state_layer_ids (vLLM ids, top level),
                 eagle_config {eagle_aux_hidden_state_layer_ids (SGLang ids), use_aux_hidden_state: true}
    model.safetensors  fc.weight [h, 3h], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}
                 .weight [h], midlayer.self_attn.{q,k,v}_proj.weight [*, 2h], midlayer.self_attn.o_proj.weight,
                 midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight [Vd, h], d2t int64 [Vd]
                 (target id = draft id + d2t[draft id]), input_norm.weight [3h] with norm_before_fc,
                 layers.{i}.* (i >= 1: the standard decoder layers of a head with num_layers > 1; vLLM 0.32
                 reads them, SGLang's drafter has one layer), and t2d bool [V] only when Vd < V (vLLM refuses d2t
                 with the full vocabulary), embed_tokens.weight [V, h] (a copy of the target's: SpecForge's
                 warm start requires it, speculators reads it; vLLM and SGLang use the target's values).
    Aux-layer ids: the head fuses hidden_states[a] (input of decoder layer a). vLLM's id i captures the input
    of layer i (id = a), SGLang's id j captures the output of layer j (id = a - 1; SpecForge's default
    [1, N//2-1, N-4] is EAGLE-3's [2, N//2, N-3]). vLLM reads the top-level key first and SGLang only
    eagle_config, so both keys are written, each in its engine's convention: both engines then feed fc
    the same tensors. Exports need 3 distinct ascending aux layers in [1, N-1] (see formats/eagle3.py).
eagle3-speculators (vLLM `Eagle3Speculator`: `vllm serve DIR` with no flags)
    config.json  {architectures: [Eagle3Speculator], speculators_model_type: eagle3, transformer_layer_config
                 (the Llama config above), draft_vocab_size, target_hidden_size, norm_before_residual
                 false (written explicitly; speculators 0.9.0's default is also false),
                 eagle_aux_hidden_state_layer_ids (vLLM ids),
                 speculators_config {algorithm eagle3, proposal_methods [{proposal_type greedy,
                 speculative_tokens K, ...}], default_proposal_method, verifier {name_or_path: a Hub id or
                 an absolute path, which vLLM and speculators load the target from; refused without one}}}
    model.safetensors  as eagle3 with `midlayer.` renamed `layers.0.`.
"""

from __future__ import annotations

import torch

from headway.heads.formats import Layout, Serve, register_layout
from headway.heads.formats.common import ExportError, llama_layer_fields, refuse_attention_bias
from headway.heads.formats.eagle import eagle_serve_commands

SPEC_PREFIX = "layers.0."
VOCAB_MAPS = ("d2t", "t2d")
EMBEDDING = "embed_tokens.weight"


def engine_aux_ids(head) -> tuple[list[int], list[int]]:
    """(vLLM ids, SGLang ids) of the head's aux layers; refuses layers no engine can capture."""
    aux, N = list(head.aux_layers), head.target_config.num_hidden_layers
    if len(aux) != 3 or any(not 1 <= a <= N - 1 for a in aux) or aux != sorted(set(aux)):
        raise ExportError(f"eagle3 aux_layers={aux} cannot be served: vLLM and SGLang capture each decoder-layer "
                          f"input once, in ascending order, for layers 1..{N - 1}, and vLLM's fc reads 3 of them; "
                          f"retrain with 3 distinct ascending aux_layers in [1, {N - 1}]")
    return aux, [a - 1 for a in aux]


def full_vocab(head) -> bool:
    """The draft vocabulary is the whole target vocabulary: d2t is all zeros and t2d all true."""
    return head.draft_vocab_size == head.target_config.vocab_size


def official_names(head) -> dict[str, str]:
    return {key: key for key in head.state_dict() if key not in dropped_vocab_maps(head)}


def speculators_names(head) -> dict[str, str]:
    return {key.replace("midlayer.", SPEC_PREFIX, 1): key for key in head.state_dict()
            if key not in dropped_vocab_maps(head)}


def dropped_vocab_maps(head) -> list[str]:
    """d2t/t2d are left out with the full vocabulary: vLLM then has no parameter for d2t and refuses the
    draft, and speculators builds no such buffers (they would be unexpected keys)."""
    return list(VOCAB_MAPS) if full_vocab(head) else []


def identity_vocab_maps(head, found) -> dict:
    """d2t/t2d of a full draft vocabulary, which the layouts leave out."""
    if not full_vocab(head):
        return {}
    return {"d2t": torch.zeros_like(head.d2t), "t2d": torch.ones_like(head.t2d)}


def target_embedding(head, prov) -> dict:
    """A copy of the target's input embedding. SpecForge's warm start refuses a draft without it; speculators
    builds `embed_tokens` as NaN and fills it from here (else from the verifier's weights); vLLM shares the
    target's when the copy is identical; SGLang replaces it with the target's."""
    weight = head.frozen["embed_tokens"].weight.detach()
    return {EMBEDDING: weight.to(head.fc.weight.dtype).contiguous().cpu()}


def eagle3_fields(head) -> dict:
    refuse_attention_bias(head, "eagle3")
    vllm_ids, _ = engine_aux_ids(head)
    o = head.options
    return {"draft_vocab_size": head.draft_vocab_size, "target_hidden_size": head.target_config.hidden_size,
            "norm_before_residual": o["norm_before_residual"], "eagle_aux_hidden_state_layer_ids": vllm_ids,
            **optional_norms(head)}


def optional_norms(head) -> dict:
    """The EAGLE 3.1 keys, written only when the head uses them: vLLM and speculators read `norm_before_fc`
    (an `input_norm.weight` [3h] then ships) and `norm_output` (the next step reads norm(o)); for the default
    head they are left out, as before, because SpecForge reads `norm_output` with another meaning."""
    return {flag: True for flag in ("norm_before_fc", "norm_output") if head.options[flag]}


def draft_layer_fields(head) -> dict:
    """The Llama config the engines build the drafter's decoder layers from (num_hidden_layers = num_layers)."""
    return llama_layer_fields(head.target_config, head.options["num_layers"])


def official_config(head, prov) -> dict:
    _, sglang_ids = engine_aux_ids(head)
    return {"config.json": {
        "architectures": ["LlamaForCausalLMEagle3"], **draft_layer_fields(head), **eagle3_fields(head),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True}}}


def speculators_config(head, prov) -> dict:
    layer = {"architectures": ["LlamaForCausalLM"], **draft_layer_fields(head)}
    target_arch = list(getattr(head.target_config, "architectures", None) or [causal_lm_class(head.target_config)])
    return {"config.json": {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, **eagle3_fields(head), "tie_word_embeddings": False,
        "torch_dtype": layer["torch_dtype"],
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": prov.num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_reference(prov), "architectures": target_arch}}}}


def verifier_reference(prov) -> str:
    """speculators and `vllm serve DIR` load the verifier from this: a Hub id or an absolute local path."""
    if not prov.base_model:
        raise ExportError(f"format=eagle3-speculators names the verifier that `vllm serve` and speculators load, "
                          f"but target {prov.target_name!r} is neither a Hub id nor a local transformers folder: "
                          f"pass base_model=<Hub id, or the folder of the target saved with save_pretrained>")
    return prov.base_model


def causal_lm_class(config) -> str:
    """The target's transformers class name, for configs (e.g. from a GGUF) that do not record it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__


def official_serve(where: str, prov) -> list[Serve]:
    commands = eagle_serve_commands(where, prov, method="eagle3", algorithm="EAGLE3")
    if prov.options.get("num_layers", 1) == 1:
        return commands
    return [c for c in commands if c.engine != "SGLang"] + [
        Serve("SGLang", note=f"SGLang's EAGLE-3 drafter has one decoder layer and this head has "
                             f"{prov.options['num_layers']}: serve it with vLLM.")]


def speculators_serve(where: str, prov) -> list[Serve]:
    return [Serve("vLLM", f"vllm serve {where}"),
            Serve("SGLang", note="SGLang reads the official layout: export the head with `format=eagle3`.")]


DESCRIPTION = ("`fc.weight` [h, 3h] over the concatenated aux hidden states, one decoder layer whose q/k/v read "
               "`cat(input_layernorm(embed), hidden_norm(fused))` [2h] with the fused feature as residual, "
               "`norm.weight`, `lm_head.weight` [Vd, h] over the draft vocabulary, `d2t` (int64 [Vd], target id = "
               "draft id + d2t[draft id]) and `t2d` (bool [V]) when the draft vocabulary is reduced (with the full "
               "vocabulary they are left out: vLLM refuses them there), `embed_tokens.weight` [V, h], a copy of the "
               "target's input embedding (speculators and SpecForge's warm start need it; vLLM and SGLang read "
               "the same values). "
               "`eagle_aux_hidden_state_layer_ids` (top level) counts layer inputs as vLLM does; "
               "`eagle_config.eagle_aux_hidden_state_layer_ids` counts layer outputs (= vLLM id - 1) as SGLang does.")

register_layout(Layout(
    name="eagle3", head_kind="eagle3", primary=True, weights_file="model.safetensors",
    tensor_names=official_names, configs=official_config, serve=official_serve, library_name="vllm",
    extra_tensors=target_embedding, derived=dropped_vocab_maps, restore=identity_vocab_maps,
    description="Official EAGLE-3 layout (`LlamaForCausalLMEagle3`, loaded by vLLM and SGLang): decoder layer "
                "`midlayer.*`; " + DESCRIPTION))

register_layout(Layout(
    name="eagle3-speculators", head_kind="eagle3", primary=False, weights_file="model.safetensors",
    tensor_names=speculators_names, configs=speculators_config, serve=speculators_serve, library_name="vllm",
    extra_tensors=target_embedding, derived=dropped_vocab_maps, restore=identity_vocab_maps,
    description="vLLM speculators layout (`Eagle3Speculator`; `vllm serve <this>` starts the verifier named in "
                "`speculators_config` with this drafter): decoder layer `layers.0.*`; " + DESCRIPTION))
