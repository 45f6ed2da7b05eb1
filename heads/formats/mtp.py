"""DeepSeek-V3 MTP layout (`mtp`): the modules as extra layers `model.layers.{N+k}` of the target checkpoint.

vLLM's DeepSeekMTP and SGLang's NextN read the MTP modules from the target's own checkpoint: module k is layer
N + k (N = the target's num_hidden_layers) with `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}` and the
decoder block's tensors directly under the layer (vLLM moves them into `mtp_block`), and the target's
config says `num_nextn_predict_layers`. So this layout is a standalone shard plus the keys to merge:

    model-mtp.safetensors       model.layers.{N+k}.{enorm,hnorm}.weight [h], .eh_proj.weight [h, 2h],
                                .shared_head.norm.weight [h], .shared_head.head.weight [V, h] (the target's
                                LM head, which the module shares), .input_layernorm/.post_attention_layernorm,
                                .self_attn.*, .mlp.* (the target's decoder-layer tensors)
    merge_into_config.json      {"num_nextn_predict_layers": D}
    merge_into_index.json       {"weight_map": {key: "model-mtp.safetensors"}} for model.safetensors.index.json

Files (h = hidden size, V = target vocab, Vd = draft vocab, K = heads or modules, L = residual layers per
Medusa head, N = target layers):

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

import json

from headway.heads.formats import Layout, Serve, register_layout

SHARD = "model-mtp.safetensors"
BLOCK = "mtp_block."


def _first_layer(head) -> int:
    return head.target_config.num_hidden_layers


def names(head) -> dict[str, str]:
    N = _first_layer(head)
    out = {}
    for key in head.state_dict():
        _, k, rest = key.split(".", 2)  # layers.{k}.{rest}
        out[f"model.layers.{N + int(k)}.{rest.removeprefix(BLOCK)}"] = key
    return out


def shared_lm_head(head, prov) -> dict:
    """DeepSeek checkpoints carry the (shared) LM head in every MTP layer; vLLM loads it from there."""
    N, weight = _first_layer(head), head.frozen["lm_head"].weight.detach().cpu()
    return {f"model.layers.{N + k}.shared_head.head.weight": weight.clone() for k in range(len(head.layers))}


def configs(head, prov) -> dict:
    keys = sorted(set(names(head)) | set(shared_lm_head(head, prov)))
    return {"merge_into_config.json": {"num_nextn_predict_layers": len(head.layers)},
            "merge_into_index.json": {"weight_map": {key: SHARD for key in keys}}}


MERGE = """Merge the modules into a local copy of the target (TARGET_COPY), then serve that copy:

```python
import json, shutil
from pathlib import Path
from safetensors import safe_open

target, export = Path("TARGET_COPY"), Path("EXPORT_DIR")  # EXPORT_DIR: this folder (or its download)
shutil.copy(export / "model-mtp.safetensors", target)
config = json.loads((target / "config.json").read_text())
config.update(json.loads((export / "merge_into_config.json").read_text()))
(target / "config.json").write_text(json.dumps(config, indent=2))
index_path = target / "model.safetensors.index.json"
if index_path.exists():
    index = json.loads(index_path.read_text())
else:  # a single-file checkpoint: index it first
    with safe_open(target / "model.safetensors", "pt") as f:
        index = {"metadata": {}, "weight_map": {key: "model.safetensors" for key in f.keys()}}
index["weight_map"].update(json.loads((export / "merge_into_index.json").read_text())["weight_map"])
index_path.write_text(json.dumps(index, indent=2))
```

"""


def serve(where: str, prov) -> list[Serve]:
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": prov.num_speculative_tokens})
    return [Serve("vLLM", f"vllm serve TARGET_COPY --speculative-config '{spec}'"),
            Serve("SGLang", "python -m sglang.launch_server --model-path TARGET_COPY --speculative-algorithm EAGLE "
                            "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2")]


register_layout(Layout(
    name="mtp", head_kind="mtp", primary=True, weights_file=SHARD, tensor_names=names, configs=configs,
    serve=serve, library_name="headway", extra_tensors=shared_lm_head, usage=MERGE,
    description="DeepSeek-V3 MTP layout: module k becomes layer `model.layers.{N+k}` of the target checkpoint "
                "(`enorm`, `hnorm`, `eh_proj` over `[enorm(embed); hnorm(h)]`, `shared_head.norm`, "
                "`shared_head.head`, and the decoder block's tensors), shipped as the shard "
                "`model-mtp.safetensors` plus `merge_into_config.json` (`num_nextn_predict_layers`) and "
                "`merge_into_index.json` (the shard's weight-map entries) to merge into the target.",
    notes=("vLLM (`DeepSeekMTP`) and SGLang (`DeepseekV3ForCausalLMNextN`) load MTP layers only for "
           "DeepSeek-V2/V3-architecture targets, and SGLang only one module: for other targets (Llama, Qwen2) "
           "the merged checkpoint is for headway's own engine (`load_export`) or custom loaders.",
           "headway trains module k to attend to its own entries at positions <= i - (k - 1) (exact KV-cached "
           "drafting); vLLM recomputes deeper modules causally, a small train/serve difference beyond depth 1.")))
