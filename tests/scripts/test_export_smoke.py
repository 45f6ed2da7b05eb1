"""Heads of every kind trained by `experiment=smoke` export in every layout that fits them, reload to the same
draft outputs, and carry a model card with the run's recipe."""

import json
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from headway.heads.base import load_head
from headway.heads.formats import LAYOUTS
from headway.heads.formats.io import expected_tensors, export_head, load_export, read_provenance
from headway.heads.target import load_target

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "train"))
from test_export import EXPECTED, draft, prompt_ids  # noqa: E402
from train_helpers import compose_train  # noqa: E402

KINDS = sorted({layout.head_kind for layout in LAYOUTS.values()})
# The tiny target has 4 layers: EAGLE-3's default aux layers [2, N//2, N-3] = [2, 2, 1] collide, which no
# engine can capture (tested in test_export.py), so the smoke run names three distinct ones.
OVERRIDES = {"eagle3": ["+head.options.aux_layers=[1,2,3]"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from headway.train.loop import train

    out = {}
    for kind in KINDS:
        run_dir = tmp_path_factory.mktemp(f"smoke-{kind}")
        out[kind] = train(compose_train(f"head={kind}", "experiment=smoke", "train.max_steps=2", "train.eval_every=2",
                                        "train.save_every=0", *OVERRIDES.get(kind, []), run_dir=run_dir))
    return out


@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
def test_smoke_trained_head_exports_and_reloads(fmt, runs, tmp_path):
    layout = LAYOUTS[fmt]
    final = Path(runs[layout.head_kind]) / "final"
    base_model = "org/target" if fmt == "eagle3-speculators" else None  # the tiny target is built in code
    out = export_head(final, tmp_path / fmt, fmt, base_model=base_model)  # loads the target the run recorded

    target = load_target(read_provenance(out).target)
    head = load_head(final, target)
    tensors = load_file(str(out / layout.weights_file))
    want = expected_tensors(layout, head, read_provenance(out))
    assert {k: (v.shape, v.dtype) for k, v in tensors.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
    if fmt in ("eagle", "medusa-original", "eagle3", "eagle3-speculators"):  # sizes differ from test_export's
        assert len(tensors) == {"eagle": len(EXPECTED["eagle"]), "medusa-original": 4 * 3,  # full vocabulary:
                                # no d2t/t2d; plus input_norm, on in conf/head/eagle3.yaml (EAGLE 3.1 norm_before_fc)
                                "eagle3": len(EXPECTED["eagle3"]) - 2 + 1,
                                "eagle3-speculators": len(EXPECTED["eagle3-speculators"]) - 2 + 1}[fmt]

    back = load_export(out, target=target)
    for name, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    ids = prompt_ids(target)
    for got, ref in zip(draft(back, target, ids), draft(head, target, ids)):
        assert torch.equal(got, ref)

    card = ModelCard.load(out / "README.md")
    assert card.data.tags and "| steps | 2 of 2" in card.text and "`tiny` (`builtin:tiny`)" in card.text
    assert json.loads((out / "headway.json").read_text())["training"]["steps"] == 2
