"""Load a headway `eagle3-speculators` export with speculators' own loader and run its EAGLE-3 forward.

Runs inside speculators' virtual environment, started by scripts/serve_check.py:

    VENV/bin/python scripts/peers/speculators_load.py EXPORT INPUTS.safetensors OUT.json

INPUTS holds, per prompt i: `i.input_ids` [1, n] (tokens x_1..x_n) and `i.aux_hidden_states` [1, n, 3h] (the
target's aux hidden states at positions 0..n-1). OUT.json: the draft logits (draft vocabulary) at the newest
position per prompt, the tensors speculators expected but the file lacks (`missing`), the file's tensors it has
no place for (`unexpected`), parameters still holding speculators' NaN initialisation (`uninitialised`) and
the loader's warnings about weights.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings

WEIGHT_WORDS = ("missing", "unexpected", "not initialized", "newly initialized", "not used", "were not")


def main(export: str, inputs_path: str, out_path: str) -> int:
    import torch
    from loguru import logger
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    messages = []
    logger.add(lambda m: messages.append(str(m)), level="WARNING")
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = Eagle3SpeculatorConfig.from_pretrained(export)
        config.transformer_layer_config._attn_implementation = "eager"  # no flex attention on CPU
        model = Eagle3DraftModel.from_pretrained(export, config=config).float().eval()
    messages += [str(w.message) for w in caught]

    saved = set(load_file(f"{export}/model.safetensors"))
    state = model.state_dict()
    not_saved = set(getattr(model, "_keys_to_ignore_on_save", None) or [])  # the verifier's, for training
    report = {
        "missing": sorted(set(state) - saved - not_saved),
        "unexpected": sorted(saved - set(state)),
        "uninitialised": sorted(k for k, v in state.items() if v.is_floating_point() and torch.isnan(v).any()),
        "warnings": [m for m in messages if any(w in m.lower() for w in WEIGHT_WORDS)],
        "info": {"verifier": config.speculators_config.verifier.name_or_path,
                 "aux_layer_ids": model.config.eagle_aux_hidden_state_layer_ids,
                 "norm_before_residual": config.norm_before_residual},
        "logits": {},
    }
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output))
    inputs = load_file(inputs_path)
    for i in sorted({k.split(".")[0] for k in inputs}, key=int):
        ids, aux = inputs[f"{i}.input_ids"], inputs[f"{i}.aux_hidden_states"]
        captured.clear()
        with torch.no_grad():
            model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)
        report["logits"][i] = captured[0][0, -1].float().tolist()
    with open(out_path, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
