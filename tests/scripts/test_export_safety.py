"""scripts/export.py never destroys its source, never ships NaN weights, and a read-only or full disk is one
`export error:` line with nothing half-written."""

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import compose, export_script

from headway.heads.base import build_head, save_head
from headway.heads.formats import ExportError
from headway.heads.formats.io import export_head
from headway.heads.target import load_target
from tests.read_only import READ_ONLY, read_only_command

ROOT = Path(__file__).resolve().parents[2]
TINY = {"path": "tiny-random", "name": "tiny-random"}
torch.set_num_threads(1)


@pytest.fixture
def run(tmp_path):
    """A run directory as training leaves it: metrics, checkpoints/, final/."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"split": "train", "step": 1, "loss": 1.0}\n')
    save_head(build_head("medusa", load_target(TINY), num_heads=2), run / "final")
    save_head(build_head("medusa", load_target(TINY), num_heads=2), run / "checkpoints" / "best")
    return run


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("checkpoint, output, how", [
    ("final", "final", "is the checkpoint folder"),
    ("final", ".", "contains the checkpoint folder"),
    ("final", "final/export", "lies inside the checkpoint folder"),
    ("final", "exports/medusa", "lies inside the checkpoint's run directory"),
    ("checkpoints/best", ".", "contains the checkpoint folder"),
    ("checkpoints/best", "checkpoints", "contains the checkpoint folder"),
    ("checkpoints/best", "final", "lies inside the checkpoint's run directory"),
])
def test_an_output_over_the_source_is_refused_even_with_overwrite(run, checkpoint, output, how, capsys):
    before = snapshot(run)
    export = export_script()
    assert export.run(compose(f"checkpoint={run / checkpoint}", f"output={run / output}", "overwrite=true")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export error:") and how in lines[0], lines
    assert snapshot(run) == before  # not a byte changed, no temp folder left


def test_an_output_beside_the_run_is_fine(run, tmp_path):
    out = export_head(run / "final", tmp_path / "export", target=load_target(TINY))
    assert (out / "headway.json").is_file()


def test_nan_weights_are_not_exported(run, tmp_path):
    weights = load_file(str(run / "final" / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name][0] = float("nan")
    save_file(weights, str(run / "final" / "model.safetensors"))
    with pytest.raises(ExportError, match=f"NaN or infinite weights \\({name}"):
        export_head(run / "final", tmp_path / "export", target=load_target(TINY))
    assert not (tmp_path / "export").exists()


def test_an_output_under_a_file_is_one_error(run, tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ExportError, match="cannot write output=.*a_file/out: .*a_file is a file, not a folder"):
        export_head(run / "final", tmp_path / "a_file" / "out", target=load_target(TINY))


def run_export(args, cwd, preexec_fn=None, read_only=None):
    argv = [sys.executable, str(ROOT / "scripts" / "export.py"), *args]
    if read_only is not None:
        argv = read_only_command(read_only, argv)
        if argv is None:
            pytest.skip("no way to make a folder read-only here")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=preexec_fn)


def test_a_read_only_output_is_one_line(run, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    res = run_export([f"checkpoint={run / 'final'}", f"output={locked / 'out'}"], tmp_path, read_only=locked)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write output=" in lines[0] and re.search(READ_ONLY, lines[0]), lines
    assert list(locked.iterdir()) == []


def test_a_full_disk_is_one_line_and_leaves_nothing(run, tmp_path):
    """The weights file hits the file-size limit (EFBIG): what a disk that fills up looks like to a writer."""
    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = tmp_path / "exports"
    out.mkdir()
    res = run_export([f"checkpoint={run / 'final'}", f"output={out / 'medusa'}"], tmp_path, preexec_fn=small_files)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export error: cannot write output=") and "too large" in lines[0]
    assert list(out.iterdir()) == []  # no half-written export, no temp folder
