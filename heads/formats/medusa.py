"""Medusa layouts: vLLM's `MedusaModel` (`medusa`) and the original Medusa / TGI head file (`medusa-original`).

headway's Medusa head already uses vLLM's parameter names (`blocks.{i}.layers.{j}.*`, `lm_heads.{i}.weight`),
so `medusa` is the identity map; `medusa-original` nests each head as nn.Sequential(ResBlock x L, Linear).

Files (h = hidden size, V = target vocab, Vd = draft vocab, K = heads or modules, L = residual layers per
Medusa head, N = target layers):

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
"""

from __future__ import annotations

import json

from headway.heads.formats import Layout, Serve, register_layout


def _sizes(head) -> tuple[int, int]:  # (K heads, L residual layers per head)
    return len(head.blocks), len(head.blocks[0].layers)


def vllm_names(head) -> dict[str, str]:
    return {key: key for key in head.state_dict()}


def original_names(head) -> dict[str, str]:
    K, L = _sizes(head)
    names = {}
    for i in range(K):
        for j in range(L):
            for p in ("weight", "bias"):
                names[f"{i}.{j}.linear.{p}"] = f"blocks.{i}.layers.{j}.{p}"
        names[f"{i}.{L}.weight"] = f"lm_heads.{i}.weight"
    return names


def vllm_config(head, prov) -> dict:
    K, L = _sizes(head)
    cfg = head.target_config
    # MedusaConfig.from_pretrained renames every top-level key holding "num" and "heads"/"layers": add none.
    return {"config.json": {
        "architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "num_heads": K, "num_hidden_layers": L, "medusa_fc_bias": True,
        "truncated_vocab_size": cfg.vocab_size, "topk": 10, "max_paths": 64}}


def original_config(head, prov) -> dict:
    K, L = _sizes(head)
    return {"config.json": {"medusa_num_heads": K, "medusa_num_layers": L,
                            "base_model_name_or_path": prov.target_name}}


def vllm_serve(where: str, prov) -> list[Serve]:
    spec = json.dumps({"method": "medusa", "model": where, "num_speculative_tokens": prov.num_speculative_tokens})
    return [Serve("vLLM", f"vllm serve {prov.target_name} --speculative-config '{spec}'"),
            Serve("SGLang", note="SGLang has no Medusa drafter; serve this head with vLLM.")]


def original_serve(where: str, prov) -> list[Serve]:
    return [Serve("TGI", f"text-generation-launcher --model-id {where}"),
            Serve("vLLM", note="export the head with `format=medusa` for vLLM."),
            Serve("SGLang", note="SGLang has no Medusa drafter.")]


register_layout(Layout(
    name="medusa", head_kind="medusa", primary=True, weights_file="model.safetensors",
    tensor_names=vllm_names, configs=vllm_config, serve=vllm_serve, library_name="vllm",
    description="vLLM `MedusaModel` layout: `blocks.{i}.layers.{j}.{weight,bias}` residual blocks on the "
                "target's last hidden state and one LM head `lm_heads.{i}.weight` per head; head i drafts "
                "the token i+2 positions ahead."))

register_layout(Layout(
    name="medusa-original", head_kind="medusa", primary=False, weights_file="medusa_lm_head.safetensors",
    tensor_names=original_names, configs=original_config, serve=original_serve,
    library_name="text-generation-inference",
    description="Original Medusa layout (`medusa_lm_head.safetensors`, as TGI loads it): head i is "
                "`nn.Sequential(ResBlock x L, Linear)` with keys `{i}.{j}.linear.{weight,bias}` and "
                "`{i}.{L}.weight`; `config.json` holds `medusa_num_heads`, `medusa_num_layers` and "
                "`base_model_name_or_path`.",
    notes=("The Medusa repository builds `[ResBlock] * L` (one block shared L times), so with more than one "
           "residual layer only loaders that build separate blocks (TGI) reproduce this head.",)))
