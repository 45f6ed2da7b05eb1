"""EAGLE-1/2 layout (`eagle`): vLLM `EagleLlamaForCausalLM` and SGLang `LlamaForCausalLMEagle`.

headway's EAGLE head already uses the engines' names (`fc.weight`, `layers.0.*`, no input layernorm, no final
norm, no LM head: the target's is shared), so the tensors are the identity map.

Files (h = hidden size, V = target vocab, Vd = draft vocab, K = heads or modules, L = residual layers per
Medusa head, N = target layers):

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
"""

from __future__ import annotations

import json

import torch

from headway.heads.formats import Layout, Serve, register_layout
from headway.heads.formats.common import llama_layer_fields, refuse_attention_bias

# SGLang resolves the first name, vLLM maps each to "Eagle" + name and resolves the first it knows:
# "EagleLlamaForCausalLMEagle" is unknown to it, "EagleLlamaForCausalLM" is its EAGLE-1 model.
ARCHITECTURES = ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"]


def names(head) -> dict[str, str]:
    return {key: key for key in head.state_dict()}


def zero_fc_bias(head, prov) -> dict:
    """SGLang's LlamaForCausalLMEagle builds `fc` with a bias and silently keeps its random init when the
    checkpoint has none; vLLM builds it without one and skips the name. A zero bias is right for both."""
    return {"fc.bias": torch.zeros(head.fc.weight.shape[0], dtype=head.fc.weight.dtype)}


def config(head, prov) -> dict:
    refuse_attention_bias(head, "eagle")
    fields = llama_layer_fields(head.target_config)
    return {"config.json": {"architectures": ARCHITECTURES, **fields}}


def serve(where: str, prov) -> list[Serve]:
    return eagle_serve_commands(where, prov, method="eagle", algorithm="EAGLE")


def eagle_serve_commands(where: str, prov, method: str, algorithm: str) -> list[Serve]:
    """vLLM and SGLang commands for an EAGLE-family head (EAGLE-1/2 and EAGLE-3 differ only by name)."""
    k = prov.num_speculative_tokens
    spec = json.dumps({"method": method, "model": where, "num_speculative_tokens": k})
    sglang = (f"python -m sglang.launch_server --model-path {prov.target_name} --speculative-algorithm {algorithm} "
              f"--speculative-draft-model-path {where} --speculative-num-steps {k} --speculative-eagle-topk 8 "
              f"--speculative-num-draft-tokens 64")
    return [Serve("vLLM", f"vllm serve {prov.target_name} --speculative-config '{spec}'"), Serve("SGLang", sglang)]


register_layout(Layout(
    name="eagle", head_kind="eagle", primary=True, weights_file="model.safetensors",
    tensor_names=names, configs=config, serve=serve, library_name="vllm", extra_tensors=zero_fc_bias,
    description="EAGLE-1 layout: `fc.weight` [h, 2h] over `cat(embed(x_t+1), f_t)` and a zero `fc.bias`, one Llama "
                "decoder layer `layers.0.*` without `input_layernorm`, no final norm and no LM head (the "
                "target's embedding and LM head are shared); `config.json` is a one-layer Llama config with "
                "architectures `LlamaForCausalLMEagle` (SGLang) and `EagleLlamaForCausalLM` (vLLM).",
    notes=("The zero `fc.bias` is there for SGLang, whose `LlamaForCausalLMEagle` builds `fc` with a bias and "
           "would otherwise keep a random one; vLLM ignores it.",)))
