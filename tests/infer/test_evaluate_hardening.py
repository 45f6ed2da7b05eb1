"""infer.evaluate on hostile or broken input: NaN/inf/tiny temperatures, an output folder that cannot be
written (found before measuring), a full disk at the end, a target of other shapes, non-UTF-8 prompts."""

import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from test_evaluate import TINY, make_cfg, quiet

from headway.heads.base import build_head, save_head
from headway.heads.target import TargetSpec, load_target
from headway.infer import evaluate as ev
from headway.infer.engine import EngineError, Engine
from headway.heads.sampling import warp_probs

REPO = ev.Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    target = load_target(TINY)
    return save_head(build_head("eagle", target), tmp_path_factory.mktemp("run") / "final")


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Name three colours."}) + "\n")
    return path


def evaluate_lines(cfg):
    lines = []
    ev.evaluate(cfg, out=lines.append)
    return lines


@pytest.mark.parametrize("temperature", ["nan", "inf", "-inf"])
def test_nan_or_infinite_temperature_is_refused(temperature, eagle_dir, prompts, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ev.EvalError, match="temperature must be a finite number"):
        ev.evaluate(make_cfg(f"checkpoint={eagle_dir}", f"prompts={prompts}", f"temperature={temperature}",
                             f"output={out}"), out=quiet)
    assert not out.exists()
    with pytest.raises(ValueError, match="finite"):
        warp_probs(torch.zeros(4), float(temperature))


@pytest.mark.parametrize("device, why", [("gpu", "is not a device"), ("cuda", "sees no CUDA device")])
def test_a_device_that_is_not_there_is_one_clear_error(device, why, eagle_dir, prompts, tmp_path):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    with pytest.raises(ev.EvalError, match=why):
        ev.evaluate(make_cfg(f"checkpoint={eagle_dir}", f"prompts={prompts}", f"device={device}", f"output={out}"),
                    out=quiet)
    assert not out.exists()


def test_a_vanishing_temperature_decodes_greedily(eagle_dir, prompts, tmp_path):
    """1e-39 used to divide logits into inf - inf = NaN probabilities; now it is greedy decoding, reported
    with a greedy match, and eval.json is strict JSON."""
    logits = torch.tensor([1.0, 3.0, 3.0, -2.0])
    assert torch.equal(warp_probs(logits, 1e-39), warp_probs(logits, 0.0))
    target = load_target(TINY)
    engine = Engine(target, budget="static")
    tiny = engine.generate([[5, 6, 7]], max_new_tokens=6, temperature=1e-39, seed=0).tokens
    assert tiny == engine.generate([[5, 6, 7]], max_new_tokens=6, temperature=0.0).tokens
    with pytest.raises(EngineError, match="finite"):
        engine.generate([[5, 6, 7]], max_new_tokens=6, temperature=float("nan"))

    out = tmp_path / "out"
    res = ev.evaluate(make_cfg(f"checkpoint={eagle_dir}", f"prompts={prompts}", "temperature=1e-39",
                               "max_new_tokens=6", "baselines=[vanilla]", "plot=false", f"output={out}"), out=quiet)
    assert res["greedy_match"] == 1.0
    text = (out / "eval.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"eval.json holds {c}"))


def test_results_never_hold_infinity():
    assert ev.finite_or_null({"a": [1.0, float("inf")], "b": {"c": float("nan")}, "d": 2}) == \
        {"a": [1.0, None], "b": {"c": None}, "d": 2}


def test_an_unwritable_output_is_refused_before_measuring(eagle_dir, prompts, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    printed = []
    with pytest.raises(ev.EvalError, match="cannot write the results to .*a_file/out.*Not a directory"):
        ev.evaluate(make_cfg(f"checkpoint={eagle_dir}", f"prompts={prompts}", f"output={blocker / 'out'}"),
                    out=printed.append)
    assert printed == []  # nothing was loaded or measured
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "prompts.jsonl"]


def test_a_full_disk_at_the_end_is_one_line_and_leaves_no_file(eagle_dir, prompts, tmp_path):
    """The results file hits the file-size limit (EFBIG, what a full disk looks like to a writer)."""
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run([sys.executable, "-m", "headway.infer.evaluate", f"checkpoint={eagle_dir}", f"prompts={prompts}",
                           "max_new_tokens=4", "baselines=[]", "plot=false", "budget=static",
                           "weight_layout=stock", f"output={out}"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600, preexec_fn=small_files)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot write the results") and "too large" in lines[0]
    assert not list(out.glob("*")) if out.exists() else True


def test_a_target_of_other_layer_shapes_is_one_clear_error(eagle_dir, prompts, tmp_path):
    """Same hidden size and vocabulary, another intermediate size: EAGLE's decoder layer cannot load."""
    cfg = make_cfg(f"checkpoint={eagle_dir}", f"prompts={prompts}", f"output={tmp_path / 'out'}")
    cfg.target = TargetSpec(**TINY, tiny={"intermediate_size": 96})
    with pytest.raises(ev.ERRORS, match=r"tensor .*mlp.* is \[64, 128\], but a eagle head on this target needs "
                                        r"\[64, 96\]"):
        ev.evaluate(cfg, out=quiet)
    assert not (tmp_path / "out").exists()


def test_non_utf8_prompts_name_the_file_and_line(eagle_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')  # latin-1, not UTF-8
    with pytest.raises(ev.EvalError, match=f"{path}:2 is not UTF-8"):
        ev.evaluate(make_cfg(f"checkpoint={eagle_dir}", f"prompts={path}", f"output={tmp_path / 'o'}"), out=quiet)
