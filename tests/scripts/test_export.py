"""Export layouts: exact key sets and configs the engines read, bit-exact reload into the headway head, an
engine-style forward computed from the exported files alone, model cards, and bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from headway.heads.base import build_head, compute_features, save_head
from headway.heads.formats import LAYOUTS, ExportError
from headway.heads.formats.io import export_head, load_export
from headway.heads.target import load_target

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)

# Tiny target: hidden 64, 4 heads of 16 (2 kv heads), intermediate 128, vocab 259, 4 layers.
H, V, I, KV = 64, 259, 128, 32
LAYER = {  # one Llama decoder layer of the tiny target, without input_layernorm
    "self_attn.q_proj.weight": [H, H], "self_attn.k_proj.weight": [KV, H], "self_attn.v_proj.weight": [KV, H],
    "self_attn.o_proj.weight": [H, H], "post_attention_layernorm.weight": [H],
    "mlp.gate_proj.weight": [I, H], "mlp.up_proj.weight": [I, H], "mlp.down_proj.weight": [H, I]}

EAGLE3_LAYER = {**LAYER, "self_attn.q_proj.weight": [H, 2 * H], "self_attn.k_proj.weight": [KV, 2 * H],
                "self_attn.v_proj.weight": [KV, 2 * H], "input_layernorm.weight": [H], "hidden_norm.weight": [H]}

HEADS = {  # kind -> options used here (small, but every structural option away from 1 where it matters)
    "medusa": dict(num_heads=2, num_layers=2),
    "eagle": dict(),
    "eagle3": dict(aux_layers=[1, 2, 3], draft_vocab_size=100, ttt_steps=2),
    "mtp": dict(num_modules=2),
}
VD = 100  # eagle3 draft vocabulary

# The exact tensors (name -> shape) each layout must hold for the heads above.
EXPECTED = {
    "medusa": {**{f"blocks.{i}.layers.{j}.{p}": [H, H] if p == "weight" else [H]
                  for i in range(2) for j in range(2) for p in ("weight", "bias")},
               "lm_heads.0.weight": [V, H], "lm_heads.1.weight": [V, H]},
    "medusa-original": {**{f"{i}.{j}.linear.{p}": [H, H] if p == "weight" else [H]
                           for i in range(2) for j in range(2) for p in ("weight", "bias")},
                        "0.2.weight": [V, H], "1.2.weight": [V, H]},
    "eagle": {"fc.weight": [H, 2 * H], "fc.bias": [H], **{f"layers.0.{k}": s for k, s in LAYER.items()}},
    "eagle3": {"fc.weight": [H, 3 * H], "norm.weight": [H], "lm_head.weight": [VD, H], "d2t": [VD], "t2d": [V],
               "embed_tokens.weight": [V, H], **{f"midlayer.{k}": s for k, s in EAGLE3_LAYER.items()}},
    "eagle3-speculators": {"fc.weight": [H, 3 * H], "norm.weight": [H], "lm_head.weight": [VD, H], "d2t": [VD],
                           "t2d": [V], "embed_tokens.weight": [V, H],
                           **{f"layers.0.{k}": s for k, s in EAGLE3_LAYER.items()}},
    "mtp": {f"model.layers.{4 + k}.{name}": shape for k in range(2) for name, shape in {
        "enorm.weight": [H], "hnorm.weight": [H], "eh_proj.weight": [H, 2 * H], "shared_head.norm.weight": [H],
        "shared_head.head.weight": [V, H], "input_layernorm.weight": [H], **LAYER}.items()},
}
FILES = {  # every file of each layout
    "medusa-original": ["config.json", "medusa_lm_head.safetensors"],
    "mtp": ["model-mtp.safetensors", "merge_into_config.json", "merge_into_index.json"],
}


@pytest.fixture(scope="module")
def target():
    return load_target({"path": "tiny-random", "name": "tiny-random"})


@pytest.fixture(scope="module")
def finals(target, tmp_path_factory):
    """kind -> a final/ folder holding a head with random (non-initial) weights, and the head itself."""
    out = {}
    for kind, options in HEADS.items():
        torch.manual_seed(0)
        head = build_head(kind, target, **options)
        if kind == "eagle3":  # a draft vocabulary that is not simply the first ids
            head.init_from_data(torch.randint(0, 1000, (V,)))
        with torch.no_grad():  # away from init: zero-init blocks would hide a wrong mapping
            for p in head.parameters():
                p.normal_(0, 0.2)
        folder = tmp_path_factory.mktemp(kind) / "final"
        save_head(head, folder, extra={"training": {"steps": 7, "data": {"source": "org/chat-data"},
                                                    "optimizer": {"lr": 1e-4}}})
        out[kind] = (folder, head.eval())
    return out


def draft(head, target, ids):
    """Draft logits of the first two tree levels (root + 2 children) after committing `ids` [1, T]."""
    T = ids.shape[1]
    feats = compute_features(target.model, ids, None, head.feature_layers()).slice((slice(None), slice(None, -1)))
    positions = torch.arange(T - 1)[None]
    with torch.no_grad():
        state = head.draft_state(1, T + 8)
        logits, hidden = head.draft_begin(state, ids[:, 1:], feats, positions, torch.tensor([T - 1]))
        children = logits.topk(2).indices  # [1, 2]
        logits2, _ = head.draft_expand(state, 1, children, hidden[:, None].expand(-1, 2, -1),
                                       torch.full_like(children, -1), torch.full_like(children, T - 1))
        head.draft_end(state)
    return logits, logits2


def prompt_ids(target):
    return target.tokenizer("Hello there, how are you doing today?", return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_layout_keys_reload_and_card(fmt, target, finals, tmp_path):
    kind = LAYOUTS[fmt].head_kind
    final, head = finals[kind]
    base_model = "org/target" if fmt == "eagle3-speculators" else None  # tiny-random is built in code
    out = export_head(final, tmp_path / fmt, fmt, target=target, base_model=base_model)
    files = FILES.get(fmt, ["config.json", "model.safetensors"])
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", "headway.json", *files])
    tensors = load_file(str(out / LAYOUTS[fmt].weights_file))
    assert {k: list(v.shape) for k, v in tensors.items()} == EXPECTED[fmt]
    assert {k: v.dtype for k, v in tensors.items() if v.dtype != torch.float32} == (
        {"d2t": torch.int64, "t2d": torch.bool} if kind == "eagle3" else {})

    back = load_export(out, target=target)
    for name, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    for got, want in zip(draft(back, target, prompt_ids(target)), draft(head, target, prompt_ids(target))):
        assert torch.equal(got, want)

    prov = json.loads((out / "headway.json").read_text())
    assert prov["format"] == fmt and prov["head_kind"] == kind and prov["target"]["name"] == "tiny-random"
    assert prov["headway_version"] and len(prov["source_sha256"]) == 64
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "apache-2.0" and "speculative-decoding" in card.data.tags
    assert card.data.datasets == ["org/chat-data"] and card.data.library_name
    assert "## Serving" in card.text and "| steps | 7 of ? " in card.text and "AdamW lr 0.0001" in card.text


def test_format_auto_picks_the_primary_layout(target, finals, tmp_path):
    for kind, want in (("medusa", "medusa"), ("eagle", "eagle"), ("eagle3", "eagle3"), ("mtp", "mtp")):
        out = export_head(finals[kind][0], tmp_path / kind, "auto", target=target)
        assert json.loads((out / "headway.json").read_text())["format"] == want


# --------------------------------------------------------------------------- engine-side forwards

def test_medusa_configs_and_engine_forward(target, finals, tmp_path):
    final, head = finals["medusa"]
    out = export_head(final, tmp_path / "m", "medusa", target=target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"]) == (2, 2, True)
    # vLLM's MedusaConfig renames every top-level key holding "num" + "heads"/"layers": only these two may.
    assert [k for k in cfg if "num" in k and ("heads" in k or "layers" in k)] == ["num_heads", "num_hidden_layers"]
    orig = export_head(final, tmp_path / "o", "medusa-original", target=target)
    ocfg = json.loads((orig / "config.json").read_text())
    assert (ocfg["medusa_num_heads"], ocfg["medusa_num_layers"]) == (2, 2)
    assert ocfg["base_model_name_or_path"] == "tiny-random"

    # vLLM's forward from the files alone: x <- x + SiLU(W x + b) per layer, then lm_heads.i
    w = load_file(str(out / "model.safetensors"))
    ids = prompt_ids(target)
    f = compute_features(target.model, ids, None, []).last_hidden[:, -2]  # newest committed feature
    x = f
    for j in range(2):
        x = x + torch.nn.functional.silu(x @ w[f"blocks.0.layers.{j}.weight"].T + w[f"blocks.0.layers.{j}.bias"])
    torch.testing.assert_close(x @ w["lm_heads.0.weight"].T, draft(head, target, ids)[0])


def test_eagle_config_and_engine_forward(target, finals, tmp_path):
    """vLLM/SGLang EAGLE-1: h = fc(cat(embed, f)); h = h + attn(h); h = h + mlp(post_norm(h)); target lm_head."""
    from transformers import AutoConfig, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    final, head = finals["eagle"]
    out = export_head(final, tmp_path / "e", "eagle", target=target)
    cfg = AutoConfig.from_pretrained(out)
    assert isinstance(cfg, LlamaConfig) and cfg.num_hidden_layers == 1 and cfg.hidden_size == H
    assert cfg.architectures[0] == "LlamaForCausalLMEagle" and "EagleLlamaForCausalLM" in cfg.architectures
    assert not cfg.tie_word_embeddings

    w = load_file(str(out / "model.safetensors"))
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")})
    ids = prompt_ids(target)
    T = ids.shape[1]
    f = compute_features(target.model, ids, None, []).last_hidden[:, :-1]  # f_0..f_{m-1}
    x = torch.cat([target.model.get_input_embeddings()(ids[:, 1:]), f], -1) @ w["fc.weight"].T
    pos = torch.arange(T - 1)[None]
    rope = target.model.model.rotary_emb(x, pos)
    mask = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h = layer(x, attention_mask=mask, position_embeddings=rope)
        h = h[0] if isinstance(h, tuple) else h
    torch.testing.assert_close(target.model.lm_head(h[:, -1]), draft(head, target, ids)[0], rtol=1e-4, atol=1e-4)


def test_mtp_merge_files_and_engine_forward(target, finals, tmp_path):
    """vLLM DeepSeekMTP, module 1 at the newest position: block(eh_proj(cat(enorm(embed x_{m}), hnorm(h_{m-1}))))
    read out by shared_head.head(shared_head.norm(.)). The block is the target's decoder layer, loaded from the
    shard the way vLLM rewrites `model.layers.{N}.*` into `mtp_block.*`."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    final, head = finals["mtp"]
    out = export_head(final, tmp_path / "m", "mtp", target=target)
    assert json.loads((out / "merge_into_config.json").read_text()) == {"num_nextn_predict_layers": 2}
    index = json.loads((out / "merge_into_index.json").read_text())["weight_map"]
    assert index == {k: "model-mtp.safetensors" for k in EXPECTED["mtp"]}

    w = load_file(str(out / "model-mtp.safetensors"))
    assert torch.equal(w["model.layers.4.shared_head.head.weight"], target.model.lm_head.weight)
    p = "model.layers.4."
    block = LlamaDecoderLayer(target.config, layer_idx=0)
    block.load_state_dict({k[len(p):]: v for k, v in w.items() if k.startswith(p) and k[len(p):].split(".")[0]
                           in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")})

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps)

    ids = prompt_ids(target)
    T = ids.shape[1]
    h0 = compute_features(target.model, ids, None, []).last_hidden[:, :-1]  # h^0_0..h^0_{m-1}
    emb = target.model.get_input_embeddings()(ids[:, 1:])
    x = torch.cat([rms(emb, w[p + "enorm.weight"]), rms(h0, w[p + "hnorm.weight"])], -1) @ w[p + "eh_proj.weight"].T
    rope = target.model.model.rotary_emb(x, torch.arange(T - 1)[None])
    mask = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h1 = block(x, attention_mask=mask, position_embeddings=rope)
        h1 = h1[0] if isinstance(h1, tuple) else h1
    logits = rms(h1[:, -1], w[p + "shared_head.norm.weight"]) @ w[p + "shared_head.head.weight"].T
    torch.testing.assert_close(logits, draft(head, target, ids)[0], rtol=1e-4, atol=1e-4)
    card = (out / "README.md").read_text()
    assert "merge_into_index.json" in card and '"method": "mtp"' in card and "DeepSeek-V2/V3" in card


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def eagle3_engine_logits(out, weights, prefix, target, ids, aux):
    """vLLM/SGLang Eagle3 first draft step, from the exported files alone: g = fc(cat(aux hidden states))
    (input_norm first with norm_before_fc); x = cat(input_layernorm(embed), hidden_norm(g)); h = g + attn(x)
    (hidden_norm(g) + attn(x) with norm_before_residual); o = h + mlp(post_norm(h)), then through the standard
    decoder layers `layers.{1..}` when num_hidden_layers > 1 (vLLM);
    draft logits = lm_head(norm(o)) scattered to target ids d2t[i] + i (-inf elsewhere)."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = json.loads((out / "config.json").read_text())
    layer_cfg = AutoConfig.for_model("llama", **{k: v for k, v in cfg.get("transformer_layer_config", cfg).items()
                                                 if k not in ("architectures", "model_type")})
    layer = LlamaDecoderLayer(layer_cfg, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(layer.self_attn, name, torch.nn.Linear(2 * H, getattr(layer.self_attn, name).out_features, bias=False))
    layer.hidden_norm = type(layer.input_layernorm)(H, eps=layer_cfg.rms_norm_eps)
    layer.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
    norm = type(layer.input_layernorm)(H, eps=layer_cfg.rms_norm_eps)
    norm.load_state_dict({"weight": weights["norm.weight"]})

    T = ids.shape[1]
    hs = target.model(ids, output_hidden_states=True).hidden_states
    stacked = torch.cat([hs[a][:, :-1] for a in aux], -1)
    if cfg.get("norm_before_fc"):  # EAGLE 3.1: input_norm over the concatenated aux states
        stacked = rms_norm(stacked, weights["input_norm.weight"], layer_cfg.rms_norm_eps)
    g = stacked @ weights["fc.weight"].T
    emb = torch.nn.functional.embedding(ids[:, 1:], weights["embed_tokens.weight"])  # the export's own copy
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(g)], -1)
    rope = target.model.model.rotary_emb(x, torch.arange(T - 1)[None])
    mask = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
    residual = layer.hidden_norm(g) if cfg["norm_before_residual"] else g
    h = residual + layer.self_attn(hidden_states=x, position_embeddings=rope, attention_mask=mask)[0]
    o = h + layer.mlp(layer.post_attention_layernorm(h))
    for i in range(1, layer_cfg.num_hidden_layers):  # vLLM's layers 1..: standard decoder layers over o
        upper = LlamaDecoderLayer(layer_cfg, layer_idx=i)
        upper.load_state_dict({k[len(f"layers.{i}."):]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")})
        o = upper(o, attention_mask=mask, position_embeddings=rope)
    draft = norm(o[:, -1]) @ weights["lm_head.weight"].T  # [1, Vd]
    full = torch.full((1, V), float("-inf"))
    full[:, torch.arange(VD) + weights["d2t"]] = draft
    assert weights["t2d"].sum() == VD and weights["t2d"][torch.arange(VD) + weights["d2t"]].all()
    return full


EAGLE31 = dict(norm_before_fc=True, norm_before_residual=True, norm_output=True)


def export_random_eagle3(target, tmp_path, fmt: str, seed: int, **options):
    """An EAGLE-3 head with the EAGLE 3.1 norms, weights far from their initialisation and a draft vocabulary that
    is not the first ids, saved and exported in `fmt` -> (head, export folder)."""
    torch.manual_seed(seed)
    head = build_head("eagle3", target, **HEADS["eagle3"], **EAGLE31, **options)
    head.init_from_data(torch.randint(0, 1000, (V,)))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    save_head(head, tmp_path / "final")
    return head, export_head(tmp_path / "final", tmp_path / "export", fmt, target=target, base_model="org/target")


@pytest.mark.parametrize("fmt", ["eagle3", "eagle3-speculators"])
def test_eagle31_norms_are_exported_as_the_engines_read_them(fmt, target, tmp_path):
    """A head trained with the EAGLE 3.1 norms ships input_norm.weight and the three keys vLLM/speculators
    read; the engine's first step computed from the files alone equals the head's draft, and the reloaded
    export drafts (two levels: the second reads the normed recurrent output) equal the head's."""
    head, out = export_random_eagle3(target, tmp_path, fmt, seed=1)
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg.get(k) for k in EAGLE31} == EAGLE31
    w = load_file(str(out / "model.safetensors"))
    assert list(w["input_norm.weight"].shape) == [3 * H]
    ids = prompt_ids(target)
    with torch.no_grad():
        want = eagle3_engine_logits(out, w, "midlayer." if fmt == "eagle3" else "layers.0.", target, ids,
                                    cfg["eagle_aux_hidden_state_layer_ids"])
    got, got2 = draft(head.eval(), target, ids)
    torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()], rtol=1e-4, atol=1e-4)
    back, back2 = draft(load_export(out, target=target), target, ids)
    torch.testing.assert_close((back, back2), (got, got2))


def test_eagle31_norm_output_feeds_the_normed_output_forward(target):
    """norm_output changes what the next step reads (norm(o) instead of o): same weights, same first draft,
    different second-level drafts."""
    torch.manual_seed(2)
    plain = build_head("eagle3", target, **HEADS["eagle3"])
    normed = build_head("eagle3", target, **HEADS["eagle3"], norm_output=True)
    normed.load_state_dict(plain.state_dict())
    ids = prompt_ids(target)
    (a1, a2), (b1, b2) = draft(plain.eval(), target, ids), draft(normed.eval(), target, ids)
    torch.testing.assert_close(a1, b1)
    assert not torch.allclose(a2[~a2.isinf()], b2[~b2.isinf()])


@pytest.mark.parametrize("fmt", ["eagle3", "eagle3-speculators"])
def test_eagle3_configs_and_engine_forward(fmt, target, finals, tmp_path):
    from transformers import AutoConfig

    final, head = finals["eagle3"]
    out = export_head(final, tmp_path / "e3", fmt, target=target, base_model="org/target", num_speculative_tokens=3)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["norm_before_residual"]) == (VD, H, False)
    assert "norm_before_fc" not in cfg and "norm_output" not in cfg  # SpecForge reads norm_output otherwise
    vllm_ids = cfg["eagle_aux_hidden_state_layer_ids"]
    assert vllm_ids == [1, 2, 3]  # vLLM: input of decoder layer i = hidden_states[i]
    if fmt == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["vocab_size"] == V
        assert not cfg["tie_word_embeddings"] and cfg["num_hidden_layers"] == 1
        # SGLang: capture before layer id + 1, i.e. the output of layer id
        assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
        assert AutoConfig.from_pretrained(out).num_hidden_layers == 1
        sglang_ids = [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        assert sglang_ids == vllm_ids  # both engines feed fc the same hidden states
        prefix = "midlayer."
    else:
        assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
        spec = cfg["speculators_config"]
        assert spec["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
        assert spec["proposal_methods"][0]["speculative_tokens"] == 3
        assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
        prefix = "layers.0."
    w = load_file(str(out / "model.safetensors"))
    ids = prompt_ids(target)
    with torch.no_grad():
        want = eagle3_engine_logits(out, w, prefix, target, ids, vllm_ids)
    got = draft(head, target, ids)[0]
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["eagle3", "eagle3-speculators"])
def test_eagle3_with_two_layers_is_exported_as_vllm_reads_it(fmt, target, tmp_path):
    """A two-layer head ships `layers.1.*` beside the first layer and num_hidden_layers 2; vLLM's forward from the
    files alone (first layer, then a standard decoder layer) equals the head's draft, and the export reloads
    into the same head. SGLang's drafter has one layer, so the card names vLLM only."""
    head, out = export_random_eagle3(target, tmp_path, fmt, seed=3, num_layers=2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("transformer_layer_config", cfg)["num_hidden_layers"] == 2
    w = load_file(str(out / "model.safetensors"))
    first = "midlayer." if fmt == "eagle3" else "layers.0."
    assert {k[len("layers.1."):] for k in w if k.startswith("layers.1.")} == set(LAYER) | {"input_layernorm.weight"}
    assert {k[len(first):] for k in w if k.startswith(first)} == set(EAGLE3_LAYER)
    ids = prompt_ids(target)
    with torch.no_grad():
        want = eagle3_engine_logits(out, w, first, target, ids, cfg["eagle_aux_hidden_state_layer_ids"])
    got, got2 = draft(head.eval(), target, ids)
    torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()], rtol=1e-4, atol=1e-4)
    back, back2 = draft(load_export(out, target=target), target, ids)
    torch.testing.assert_close((back, back2), (got, got2))
    if fmt == "eagle3":
        card = (out / "README.md").read_text()
        assert "sglang.launch_server" not in card and "serve it with vLLM" in card


def test_eagle3_aux_layers_engines_cannot_capture_are_refused(target, tmp_path):
    torch.manual_seed(0)
    for aux in ([2, 2, 1], [0, 2, 3], [1, 2, 4], [3, 1, 2], [1, 3]):
        head = build_head("eagle3", target, aux_layers=aux, draft_vocab_size=VD)
        save_head(head, tmp_path / "final", extra={})
        with pytest.raises(ExportError, match=r"cannot be served: vLLM and SGLang capture each decoder-layer input once"):
            export_head(tmp_path / "final", tmp_path / "out", "eagle3", target=target)
        assert not (tmp_path / "out").exists()


def test_attention_biases_the_engines_drop_are_refused(tmp_path):
    biased = load_target({"path": "tiny-random", "name": "tiny-biased", "tiny": {"attention_bias": True}})
    for kind, options in (("eagle", {}), ("eagle3", HEADS["eagle3"])):
        save_head(build_head(kind, biased, **options), tmp_path / kind)
        with pytest.raises(ExportError, match=f"format={kind} cannot carry attention biases"):
            export_head(tmp_path / kind, tmp_path / f"{kind}-out", kind, target=biased)
        assert not (tmp_path / f"{kind}-out").exists()


def test_eagle_zero_fc_bias_for_sglang(target, finals, tmp_path):
    """SGLang's LlamaForCausalLMEagle builds fc with a bias and keeps a random one unless the file has it."""
    final, head = finals["eagle"]
    out = export_head(final, tmp_path / "e", "eagle", target=target)
    w = load_file(str(out / "model.safetensors"))
    assert "fc.bias" in w and w["fc.bias"].shape == (H,) and not w["fc.bias"].any()
    back = load_export(out, target=target)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())


def test_eagle3_exports_carry_the_target_embedding(target, finals, tmp_path):
    """speculators (NaN-initialised embed_tokens) and SpecForge's warm start read embed_tokens.weight."""
    final, _ = finals["eagle3"]
    for fmt in ("eagle3", "eagle3-speculators"):
        out = export_head(final, tmp_path / fmt, fmt, target=target, base_model="org/target")
        w = load_file(str(out / "model.safetensors"))
        assert torch.equal(w["embed_tokens.weight"], target.model.get_input_embeddings().weight)


def test_eagle3_full_vocabulary_has_no_vocab_maps(target, tmp_path):
    """With Vd = V vLLM has no parameter for d2t (it refuses the draft) and speculators builds no d2t/t2d
    buffers (unexpected keys): both layouts leave them out and read them back as the identity."""
    torch.manual_seed(0)
    head = build_head("eagle3", target, aux_layers=[1, 2, 3], draft_vocab_size=V)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    save_head(head, tmp_path / "final")
    for fmt in ("eagle3", "eagle3-speculators"):
        out = export_head(tmp_path / "final", tmp_path / fmt, fmt, target=target, base_model="org/target")
        assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
        back = load_export(out, target=target)
        for name, value in head.state_dict().items():
            assert torch.equal(back.state_dict()[name], value), name


def test_speculators_verifier_is_a_loadable_reference(target, finals, tmp_path, monkeypatch):
    """speculators and `vllm serve DIR` load the verifier named in the config: a Hub id or an absolute path,
    never a short local name; a target built in code needs base_model=."""
    final, _ = finals["eagle3"]
    with pytest.raises(ExportError, match="format=eagle3-speculators .* pass base_model="):
        export_head(final, tmp_path / "refused", "eagle3-speculators", target=target)
    assert not (tmp_path / "refused").exists()

    folder = tmp_path / "models" / "my-target"  # the target saved as a transformers folder, named relatively
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    local = load_target({"path": str(folder), "name": "my-target"})
    torch.manual_seed(0)
    save_head(build_head("eagle3", local, **HEADS["eagle3"]), tmp_path / "local-final")
    monkeypatch.chdir(tmp_path)
    relative = dict(json.loads((tmp_path / "local-final" / "config.json").read_text()),
                    target={"path": "models/my-target", "name": "my-target"})
    (tmp_path / "local-final" / "config.json").write_text(json.dumps(relative))
    for base_model in (None, "models/my-target"):
        out = export_head(tmp_path / "local-final", tmp_path / "spec", "eagle3-speculators", target=local,
                          base_model=base_model, overwrite=True)
        verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
        assert verifier["name_or_path"] == str(folder.resolve())
        assert "base_model" not in ModelCard.load(out / "README.md").data.to_dict()  # a path is no Hub id


# ------------------------------------------------------------------------------------- model card

def test_card_carries_the_measured_table(target, finals, tmp_path):
    final, _ = finals["eagle"]
    evals = []
    for temp, tau in ((0.0, 2.41), (1.0, 1.87)):
        path = tmp_path / f"eval_t{temp}.json"
        path.write_text(json.dumps({
            "target": "tiny-random", "head": "eagle", "temperature": temp, "num_prompts": 12, "tau": tau,
            "acceptance_by_depth": [0.61, 0.44], "by_category": {"code": {"tau": tau + 0.1, "num_prompts": 6}},
            "tokens_per_second": {"speculative": 90.5, "vanilla": 60.2, "hf_generate": 55.0},
            "speedup_vs_vanilla": 1.5, "speedup_vs_hf_generate": 1.65, "greedy_match": 1.0, "hardware": "2-core CPU",
            **({"tau_ci95": [2.30, 2.52]} if temp == 0 else {})}))  # older eval.json files have no interval
        evals.append(str(path))
    out = export_head(final, tmp_path / "e", "eagle", target=target, eval_path=evals, base_model="org/target",
                      where="org/head")
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "org/target"
    assert "| eval_t0.0 | 0.0 | 2.41 (2.30-2.52) | 0.61, 0.44 |" in card.text and "| eval_t1.0 | 1.0 | 1.87 |" in card.text
    assert "2-core CPU" in card.text and "| code | 2.51 | 6 |" in card.text
    assert '"model": "org/head"' in card.text and "vllm serve org/target" in card.text
    assert "--speculative-draft-model-path org/head" in card.text


def test_eval_json_next_to_the_checkpoint_is_found(target, finals, tmp_path):
    import shutil

    final = tmp_path / "run" / "final"
    shutil.copytree(finals["medusa"][0], final)
    for name, temp, tau in (("chat-t0", 0.0, 3.25), ("chat-t1", 1.0, 2.5)):  # infer.evaluate's default
        (final.parent / "eval" / name).mkdir(parents=True)
        (final.parent / "eval" / name / "eval.json").write_text(json.dumps({"temperature": temp, "tau": tau}))
    out = export_head(final, tmp_path / "m", "medusa", target=target)
    card = (out / "README.md").read_text()
    assert "| chat-t0 | 0.0 | 3.25 |" in card and "| chat-t1 | 1.0 | 2.50 |" in card


# -------------------------------------------------------------------------------------- bad input

def test_format_that_does_not_fit_the_head(target, finals, tmp_path):
    with pytest.raises(ExportError, match="format=medusa holds medusa heads, but the checkpoint holds a eagle head"):
        export_head(finals["eagle"][0], tmp_path / "x", "medusa", target=target)
    with pytest.raises(ExportError, match="unknown format='medusa2'"):
        export_head(finals["eagle"][0], tmp_path / "x", "medusa2", target=target)
    assert not (tmp_path / "x").exists()


def test_existing_output_is_refused_unless_overwrite(target, finals, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty: pass overwrite=true"):
        export_head(finals["medusa"][0], out, "medusa", target=target)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    export_head(finals["medusa"][0], out, "medusa", target=target, overwrite=True)
    assert (out / "model.safetensors").is_file() and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp folders left behind


def test_failure_midway_leaves_nothing(target, finals, tmp_path, monkeypatch):
    import headway.heads.formats.io as io

    def broken(*args, **kwargs):
        raise ExportError("disk full")

    monkeypatch.setattr(io, "save_tensors", broken)
    with pytest.raises(ExportError, match="disk full"):
        export_head(finals["medusa"][0], tmp_path / "out", "medusa", target=target)
    assert list(tmp_path.iterdir()) == []


def test_corrupted_export_is_refused_on_read(target, finals, tmp_path):
    out = export_head(finals["eagle"][0], tmp_path / "e", "eagle", target=target)
    w = load_file(str(out / "model.safetensors"))
    w["layers.0.input_layernorm.weight"] = torch.ones(H)  # a stray tensor the layout does not have
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match=r"unexpected \['layers.0.input_layernorm.weight'\]"):
        load_export(out, target=target)
    (out / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ExportError, match="corrupted or unreadable"):
        load_export(out, target=target)


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def export_script():
    """The export command as a module (importing it registers the config schema)."""
    from headway.heads.formats import export_cli

    return export_cli


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    export_script()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose("export", overrides=list(overrides))


def test_cli_exports(finals, tmp_path):
    res = run_cli(f"checkpoint={finals['medusa'][0]}", f"output={tmp_path / 'm'}", "format=medusa-original")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith(str(tmp_path / "m"))
    assert (tmp_path / "m" / "medusa_lm_head.safetensors").is_file() and not (ROOT / "export.log").exists()


def test_bad_input_gives_one_clear_line(finals, tmp_path, capsys):
    export = export_script()

    final = finals["medusa"][0]
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text((final / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00" * 16)
    half = tmp_path / "half"
    half.mkdir()
    (half / "model.safetensors").write_bytes((final / "model.safetensors").read_bytes())
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    cases = {
        (f"checkpoint={tmp_path / 'nope'}",): "is not a head folder: it needs config.json and model.safetensors",
        (f"checkpoint={half}",): "is not a head folder",
        (f"checkpoint={bad}",): "model.safetensors is corrupted or unreadable",
        (f"checkpoint={final}", "format=eagle"): "format=eagle holds eagle heads, but the checkpoint holds a medusa",
        (f"checkpoint={final}", f"output={tmp_path / 'used'}"): "exists and is not empty: pass overwrite=true",
        (f"checkpoint={final}", "eval=/no/eval.json"): "eval=/no/eval.json does not exist",
    }
    for args, message in cases.items():
        overrides = list(args) + ([f"output={tmp_path / 'fresh'}"] if not any("output=" in a for a in args) else [])
        assert export.run(compose(*overrides)) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("export error:") and message in lines[0], (args, lines)
    assert not (tmp_path / "fresh").exists() and [p.name for p in (tmp_path / "used").iterdir()] == ["x"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "half", "used"]


def test_every_layout_module_registers_itself_on_import():
    """A new head's export is one file in heads/formats/: importing the package imports every module."""
    import dataclasses
    import pkgutil

    from headway.heads import formats

    modules = {m.name for m in pkgutil.iter_modules(formats.__path__)}
    assert all(f"headway.heads.formats.{name}" in sys.modules for name in modules)
    assert {layout.head_kind for layout in LAYOUTS.values()} == {"medusa", "eagle", "eagle3", "mtp"}
    clash = dataclasses.replace(LAYOUTS["eagle"], head_kind="medusa")
    with pytest.raises(ExportError, match="'eagle' is already registered"):
        formats.register_layout(clash)
    assert LAYOUTS["eagle"].head_kind == "eagle"
