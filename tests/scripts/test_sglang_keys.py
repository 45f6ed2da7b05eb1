"""SGLang loads the EAGLE exports key by key: a static check (SGLang has no CPU build to serve them here).

SGLang's loaders (python/sglang/srt/models/llama_eagle.py, llama_eagle3.py) prefix names with `model.`, stack
q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, and *silently skip* any name they have no parameter for;
a parameter the file does not fill keeps its random initialisation. So the check is both ways: every SGLang
parameter that is not replaced by the target's is filled by the export, and every exported tensor lands
somewhere (or is one SGLang reads specially: d2t, t2d). The parameter lists below restate those files.
"""

import json

import pytest
from safetensors.torch import load_file

from headway.heads.formats.io import export_head
from test_export import HEADS, finals, target  # noqa: F401  (fixtures)

STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
           ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def sglang_eagle_params(cfg: dict) -> dict[str, str]:
    """LlamaForCausalLMEagle: parameter -> who fills it ("file" or "target" via set_embed_and_head)."""
    layer = "model.layers.0."
    params = {"model.embed_tokens.weight": "target", "lm_head.weight": "target",
              "model.fc.weight": "file", "model.fc.bias": "file"}  # torch.nn.Linear(2h, h): bias=True
    for name in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                 "mlp.down_proj.weight", "post_attention_layernorm.weight"):  # layer 0: no input_layernorm
        params[layer + name] = "file"
    return params


def sglang_eagle3_params(cfg: dict) -> dict[str, str]:
    """LlamaForCausalLMEagle3 (one midlayer, no `bias` in the config, draft_vocab_size set)."""
    mid = "model.midlayer."
    params = {"model.embed_tokens.weight": "target",  # the EAGLE-3 worker calls set_embed(target's)
              "model.fc.weight": "file", "model.norm.weight": "file", "lm_head.weight": "file"}
    for name in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                 "hidden_norm.weight"):
        params[mid + name] = "file"
    return params


def eagle_load(name: str) -> str:
    """LlamaForCausalLMEagle.load_weights + LlamaForCausalLM's stacking."""
    name = name if "lm_head" in name else "model." + name
    return stack(name)


def eagle3_load(name: str, params: dict) -> str | None:
    """LlamaForCausalLMEagle3.load_weights: d2t -> hot_token_id, t2d skipped, else name or model.name."""
    if "d2t" in name or "t2d" in name:
        return None
    name = stack(name)
    return name if name in params else f"model.{name}"


def stack(name: str) -> str:
    for shard, stacked in STACKED.items():
        if shard in name:
            return name.replace(shard, stacked)
    return name


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_sglang_fills_every_parameter_and_drops_nothing(kind, target, finals, tmp_path):  # noqa: F811
    final, _ = finals[kind]
    out = export_head(final, tmp_path / kind, kind, target=target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"][0] == {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}[kind]
    tensors = load_file(str(out / "model.safetensors"))
    params = sglang_eagle_params(cfg) if kind == "eagle" else sglang_eagle3_params(cfg)
    landed = {}
    for name in tensors:
        param = eagle_load(name) if kind == "eagle" else eagle3_load(name, params)
        if param is not None:
            landed.setdefault(param, []).append(name)
    dropped = sorted(n for p, names in landed.items() if p not in params for n in names)
    assert not dropped, f"SGLang would silently skip {dropped}"
    unfilled = sorted(p for p, source in params.items() if source == "file" and p not in landed)
    assert not unfilled, f"SGLang would keep its random initialisation for {unfilled}"
    qkv = [names for param, names in landed.items() if param.endswith("qkv_proj.weight")]
    assert len(qkv) == 1 and len(qkv[0]) == 3  # q, k and v all stacked into the one qkv_proj
    if kind == "eagle3":
        assert {"d2t", "t2d"} <= set(tensors)  # SGLang maps draft ids through d2t (hot_token_id)
        assert cfg["draft_vocab_size"] == tensors["lm_head.weight"].shape[0]
        assert "bias" not in cfg  # SGLang would build fc with a bias the file does not hold
