"""Load a headway `eagle3` export with SpecForge's own loaders and run its EAGLE-3 forward.

Runs inside SpecForge's virtual environment, started by scripts/serve_check.py:

    VENV/bin/python scripts/peers/specforge_load.py EXPORT INPUTS.safetensors OUT.json

Loads the export twice, as SpecForge does: `AutoDraftModel.from_pretrained` (its loading info gives the missing
and unexpected tensors) and `warm_start_draft_model` into a fresh draft (it refuses a draft missing required
tensors, the embedding included); the forward runs on the warm-started draft. INPUTS/OUT as in
speculators_load.py. torch.compile is off: SpecForge
compiles its RMSNorm, which on CPU needs a C++ toolchain and changes nothing numerically that matters here.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main(export: str, inputs_path: str, out_path: str) -> int:
    import torch
    from safetensors.torch import load_file
    from specforge.modeling.auto import AutoDraftModel
    from specforge.training.model_loading import load_draft_config_source, warm_start_draft_model

    config = load_draft_config_source(f"{export}/config.json", cache_dir=None, trust_remote_code=False)
    loaded, info = AutoDraftModel.from_pretrained(export, config=config, output_loading_info=True)
    report = {"missing": sorted(info.get("missing_keys") or []), "unexpected": sorted(info.get("unexpected_keys") or []),
              "warnings": [], "logits": {}}
    report["uninitialised"] = sorted(set(loaded.state_dict()) - set(load_file(f"{export}/model.safetensors")))
    model = AutoDraftModel.from_config(config)
    try:
        warm = warm_start_draft_model(model, export, draft_config=config, strategy="eagle3")
    except ValueError as exc:
        report["warnings"].append(f"warm start refused: {exc}")
        warm = None
    # from_pretrained (transformers 5.8.1) leaves the rotary embedding's non-persistent buffers (inv_freq,
    # cos/sin caches) as uninitialised memory; the warm-started draft, built by from_config, computes them.
    fresh_inv_freq = model.midlayer.self_attn.rotary_emb.inv_freq
    report["info"] = {"warm_start_loaded": warm and warm.loaded_keys, "warm_start_embedding": warm and warm.loaded_embedding,
                      "from_pretrained_rotary_ok": bool(torch.equal(loaded.midlayer.self_attn.rotary_emb.inv_freq,
                                                                    fresh_inv_freq))}
    model = model.float().eval()

    inputs = load_file(inputs_path)
    for i in sorted({k.split(".")[0] for k in inputs}, key=int):
        ids, aux = inputs[f"{i}.input_ids"], inputs[f"{i}.aux_hidden_states"]
        with torch.no_grad():
            normed = model(hidden_states=aux, inputs_embeds=model.embed_input_ids(ids))  # norm(midlayer(...))
            logits = model.lm_head(normed)  # [1, n, Vd]
        report["logits"][i] = logits[0, -1].float().tolist()
    with open(out_path, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
