"""Resume trusts only what it can check: the same head and target (weights included), intact checkpoints
(checksums; the newest intact one wins, with a warning), a metrics log cut short by a kill. Training stops at
the first non-finite gradient and never writes a NaN final/. Bad values fail before anything runs."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from train_helpers import ROOT, compose_train, launch

from headway.train.checkpoints import CHECKSUMS, STATE_FILE, checksums, find_checkpoint, identity_mismatch, step_dirs
from headway.train.config import ConfigError, TrainingError
from headway.train.loop import train
from tests.read_only import READ_ONLY, read_only_command

SMOKE = ["head=eagle", "experiment=smoke", "train.max_steps=4", "train.save_every=1", "train.keep_checkpoints=3",
         "train.eval_every=0"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run killed after step 3, with checkpoints at steps 1, 2 and 3."""
    run = tmp_path_factory.mktemp("stopped")
    train(compose_train(*SMOKE, "train.stop_after=3", run_dir=run))
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return run


def copy_of(stopped, tmp_path):
    return shutil.copytree(stopped, tmp_path / "run")


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_checkpoint_records_checksums(stopped):
    assert [p.name for p in step_dirs(stopped)] == ["step_0000001", "step_0000002", "step_0000003"]
    for ckpt in step_dirs(stopped):
        recorded = json.loads((ckpt / CHECKSUMS).read_text())
        assert recorded == checksums(ckpt) and {"model.safetensors", STATE_FILE} <= set(recorded)


def test_resume_falls_back_to_the_newest_intact_checkpoint_and_tolerates_a_torn_log(stopped, tmp_path, caplog):
    run = copy_of(stopped, tmp_path)
    newest = step_dirs(run)[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated copy
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"split": "train", "step": 4, "lo')  # a kill mid-write
    with caplog.at_level("WARNING"):
        train(compose_train(*SMOKE, "resume=latest", run_dir=run))
    assert "step_0000003 is damaged (model.safetensors is corrupted" in caplog.text
    assert "resumed from" in caplog.text or (run / "final").is_dir()
    rows = metrics(run)  # steps after the checkpoint used (2) were redone once: no duplicates, no torn line
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4]
    assert (run / "final" / "model.safetensors").is_file()


def test_a_target_with_other_weights_is_refused_naming_the_field(stopped, tmp_path):
    run = copy_of(stopped, tmp_path)
    with pytest.raises(ConfigError, match=r"target_identity\.weights: checkpoint '[0-9a-f]+', this run '[0-9a-f]+'"):
        train(compose_train(*SMOKE, "resume=latest", "target.seed=1", run_dir=run))
    assert not (run / "final").exists()


def make_checkpoints(run, steps, damage=None):
    for step in steps:
        ckpt = run / "checkpoints" / f"step_{step:07d}"
        ckpt.mkdir(parents=True)
        (ckpt / STATE_FILE).write_text(json.dumps({"step": step}))
        (ckpt / "model.safetensors").write_bytes(b"weights %d" % step)
        (ckpt / "random_states_0.pkl").write_bytes(b"rng %d" % step)
        (ckpt / CHECKSUMS).write_text(json.dumps(checksums(ckpt)))
    for step, name in (damage or {}).items():
        (run / "checkpoints" / f"step_{step:07d}" / name).write_bytes(b"flipped")


def test_the_choice_among_damaged_checkpoints(tmp_path, caplog):
    make_checkpoints(tmp_path / "a", [1, 2, 3], {3: "model.safetensors", 2: "random_states_0.pkl"})
    assert find_checkpoint("latest", tmp_path / "a").name == "step_0000001"  # the newest fully intact one
    make_checkpoints(tmp_path / "b", [1, 2], {1: "model.safetensors", 2: "random_states_0.pkl"})
    with caplog.at_level("WARNING"):  # nothing fully intact: the one that only lost its random state
        assert find_checkpoint("latest", tmp_path / "b").name == "step_0000002"
    assert "without its random state" in caplog.text
    make_checkpoints(tmp_path / "c", [1, 2], {1: "model.safetensors", 2: STATE_FILE})
    with pytest.raises(ConfigError, match="no intact checkpoint .*resume=null"):
        find_checkpoint("latest", tmp_path / "c")
    with pytest.raises(ConfigError, match="step_0000003 is damaged .*model.safetensors is corrupted"):
        find_checkpoint(str(tmp_path / "a" / "checkpoints" / "step_0000003"), tmp_path / "a")


def test_identity_mismatch_names_the_field():
    saved = {"head": "eagle", "target_identity": {"name": "t", "architecture": {"hidden_size": 64}}}
    assert identity_mismatch(saved, {"head": "eagle", "target_identity": {"name": "t", "architecture":
                                                                          {"hidden_size": 32}}}) == \
        "target_identity.architecture.hidden_size: checkpoint 64, this run 32"
    assert identity_mismatch({"head": "eagle"}, {"head": "eagle", "target_identity": {}}) is None  # older ckpt


def test_divergence_stops_at_the_first_non_finite_gradient(tmp_path):
    """lr = 1e30 is finite, so the config passes; the first step blows the weights up and the second step's
    gradient is not finite: an error, no final/, no NaN row in metrics.jsonl."""
    with pytest.raises(TrainingError, match="step 2: the gradient norm is (nan|inf)"):
        train(compose_train(*SMOKE, "optim.lr=1e30", "optim.warmup_steps=0", "train.log_every=1", run_dir=tmp_path))
    assert not (tmp_path / "final").exists()
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"metrics.jsonl holds {c}"))


@pytest.mark.parametrize("override, message", [
    ("optim.lr=inf", "optim.lr=inf is invalid: it must be a finite number > 0"),
    ("optim.lr=nan", "optim.lr=nan is invalid"),
    ("train.max_length=4096", "train.max_length=4096 exceeds the target's context of 2048 positions"),
])
def test_bad_values_fail_before_training(override, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(compose_train(*SMOKE, override, run_dir=tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final").exists()


def cli(*args, run_dir, **kwargs):
    return launch([sys.executable, "train/main.py", *SMOKE, f"hydra.run.dir={run_dir}", *args], **kwargs)


def one_error_line(res) -> str:
    """The one `error: ...` line (a progress bar on stderr may precede it on the same line)."""
    assert res.returncode == 2, res.stderr[-3000:]
    errors = re.findall(r"error: [^\n]*", res.stderr)
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return errors[0]


def test_a_run_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("x")
    line = one_error_line(cli(run_dir=tmp_path / "a_file" / "run"))
    assert "cannot create the run dir" in line and "Not a directory" in line


def test_a_read_only_run_dir_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    argv = read_only_command(locked, [sys.executable, "train/main.py", *SMOKE, f"hydra.run.dir={locked / 'run'}"])
    if argv is None:
        pytest.skip("no way to make a folder read-only here")
    line = one_error_line(launch(argv))
    assert re.search(READ_ONLY, line) and "hydra.run.dir" in line
    assert list(locked.iterdir()) == []


def test_a_disk_that_fills_up_mid_run_is_one_line_and_leaves_whole_checkpoints(tmp_path):
    """Files stop growing past 64 KiB (EFBIG, what a full disk looks like to a writer): the first checkpoint
    save fails; nothing half-written is left where resume looks."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "train/main.py", *SMOKE, f"hydra.run.dir={run}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, preexec_fn=small_files,
                         env=dict(__import__("os").environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    line = one_error_line(res)
    assert "cannot write" in line and "too large" in line.lower() and "resume=latest" in line
    assert step_dirs(run) == [] and not (run / "final").exists()
