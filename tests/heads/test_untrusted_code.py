"""A head, an export or a checkpoint someone else wrote never makes headway run Python from it.

The plant: a target folder (the tiny target, saved) whose config.json maps AutoConfig to a module of its own
that writes a marker file when imported, and files that point at it with "trust_remote_code": true (a head's
config.json, an export's headway.json, a checkpoint's random state). The positive control shows the plant
runs when the user asks for it; evaluate, export, load_export and resume must never import it."""

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from headway.heads.base import build_head, save_head
from headway.heads.formats.io import export_head, load_export
from headway.heads.target import build_tiny_random, load_target

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "train"))
sys.path.insert(0, str(ROOT / "tests" / "infer"))
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
torch.set_num_threads(1)

TINY = {"path": "tiny-random", "name": "tiny-random"}
PLANT = '''
from pathlib import Path
Path({marker!r}).write_text("planted code ran")
from transformers import LlamaConfig


class PlantedConfig(LlamaConfig):
    pass
'''


@pytest.fixture(scope="module")
def plant(tmp_path_factory):
    """(target folder with planted code, marker path the code writes)."""
    root = tmp_path_factory.mktemp("plant")
    folder, marker = root / "target", root / "marker.txt"
    model, tokenizer = build_tiny_random()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "planted.PlantedConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "planted.py").write_text(PLANT.format(marker=str(marker)))
    return folder, marker


def hostile_spec(folder: Path) -> dict:
    return {"name": "tiny-random", "path": str(folder), "trust_remote_code": True, "dtype": "float32"}


@pytest.fixture(scope="module")
def hostile_head(plant, tmp_path_factory):
    """A head folder whose config.json asks for the planted target with trust_remote_code."""
    folder, _ = plant
    final = save_head(build_head("eagle", load_target(TINY)), tmp_path_factory.mktemp("run") / "final")
    config = json.loads((final / "config.json").read_text())
    config["target"] = hostile_spec(folder)
    (final / "config.json").write_text(json.dumps(config))
    return final


def test_the_plant_runs_when_the_user_asks(plant, tmp_path, monkeypatch):
    """Positive control: the planted module really is imported when trust_remote_code comes from the user."""
    folder, marker = plant
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    copy = tmp_path / "target"
    shutil.copytree(folder, copy)
    own_marker = tmp_path / "own-marker.txt"
    (copy / "planted.py").write_text(PLANT.format(marker=str(own_marker)))
    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(copy), trust_remote_code=True)
    assert own_marker.read_text() == "planted code ran"


def test_evaluate_never_runs_a_checkpoints_code(plant, hostile_head, tmp_path):
    from test_evaluate import make_cfg, quiet

    from headway.infer import evaluate as ev

    _, marker = plant
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    res = ev.evaluate(make_cfg(f"checkpoint={hostile_head}", f"prompts={prompts}", "max_new_tokens=3",
                               "baselines=[]", "plot=false", "budget=static", f"output={tmp_path / 'out'}"), out=quiet)
    assert res["num_prompts"] == 1  # it evaluated, with the folder's weights, through transformers' own Llama
    assert not marker.exists()


def test_export_never_runs_a_checkpoints_code(plant, hostile_head, tmp_path):
    from test_export import compose, export_script

    _, marker = plant
    assert export_script().run(compose(f"checkpoint={hostile_head}", f"output={tmp_path / 'e'}")) == 0
    assert (tmp_path / "e" / "headway.json").is_file() and not marker.exists()


def test_load_export_never_runs_an_exports_code(plant, hostile_head, tmp_path):
    folder, marker = plant
    out = export_head(hostile_head, tmp_path / "e", target=load_target(TINY))
    prov = json.loads((out / "headway.json").read_text())
    prov["target"] = hostile_spec(folder)
    (out / "headway.json").write_text(json.dumps(prov))
    head = load_export(out)
    assert head.target_spec.trust_remote_code is False and not marker.exists()


class Planted:
    """A pickle that imports the planted module when unpickled without restrictions."""

    def __init__(self, folder):
        self.folder = str(folder)

    def __reduce__(self):
        return (exec, (f"import sys; sys.path.insert(0, {self.folder!r}); import planted",))


def test_resume_never_runs_a_checkpoints_code(plant, tmp_path, caplog):
    """A checkpoint whose random state is a code-running pickle (checksums updated to match) and whose trainer
    state asks for the planted target: resume loads neither, and says the random state was not restored."""
    from headway.train.checkpoints import CHECKSUMS, STATE_FILE, checksums, step_dirs
    from headway.train.loop import train
    from train_helpers import compose_train

    folder, marker = plant
    common = ["head=eagle", "experiment=smoke", "train.max_steps=3", "train.save_every=1", "train.eval_every=0"]
    train(compose_train(*common, "train.stop_after=1", run_dir=tmp_path))
    ckpt = step_dirs(tmp_path)[-1]
    (ckpt / "random_states_0.pkl").write_bytes(pickle.dumps(Planted(folder)))
    state = json.loads((ckpt / STATE_FILE).read_text())
    state["target_spec"] = hostile_spec(folder)  # nothing reads a target from a checkpoint
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    (ckpt / CHECKSUMS).write_text(json.dumps(checksums(ckpt)))
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with caplog.at_level("WARNING"):
        train(compose_train(*common, "resume=latest", run_dir=tmp_path))
    assert (tmp_path / "final" / "model.safetensors").is_file() and not marker.exists()
    assert "random_states_0.pkl is missing or unreadable" in caplog.text
