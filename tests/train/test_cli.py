"""The command line as users run it: bad input fails cleanly; DDP and DeepSpeed ZeRO-2 (two CPU processes
each) train and save a loadable head in one shared run dir."""

import json
import sys

import pytest

from headway.heads.base import load_head, read_head_config
from train_helpers import accelerate_launch, launch

# a couple of steps are enough to exercise prepare, the collective step, validation, save_state and final/
SHORT = ["experiment=smoke", "train.max_steps=2", "train.eval_every=2", "train.save_every=2"]


@pytest.mark.parametrize("args, named", [
    (["head=nope"], "head 'nope'"),
    (["head=eagle", "experiment=smoke", "target.path=/no/such/model"], "/no/such/model"),
    (["head=medusa", "experiment=smoke", "optim.lr=0"], "optim.lr"),
    (["head=eagle", "experiment=smoke", "init_from=/no/such/head"], "init_from=/no/such/head"),
])
def test_bad_input_exits_nonzero_with_one_clear_line_and_no_head(args, named, tmp_path):
    run_dir = tmp_path / "run"
    done = launch([sys.executable, "train/main.py", *args, f"hydra.run.dir={run_dir}"], timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (run_dir / "final").exists() and not (run_dir / "checkpoints").exists()


def check_distributed_run(done, run_dir, head: str):
    assert done.returncode == 0, done.stderr[-3000:]
    config = read_head_config(run_dir / "final")
    assert config["head_kind"] == head and config["training"]["processes"] == 2
    load_head(run_dir / "final")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "val" and "sim_tau" in r for r in rows)
    assert (run_dir / ".hydra" / "config.yaml").is_file()  # rank 0's Hydra output, in the one run dir
    assert (run_dir / "checkpoints" / "step_0000002" / "trainer_state.json").is_file()


def test_ddp_with_two_cpu_processes(tmp_path):
    run_dir = tmp_path / "run"
    done = accelerate_launch("--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                             "--mixed_precision", "no", "--dynamo_backend", "no",
                             "train/main.py", "head=eagle3", *SHORT, f"hydra.run.dir={run_dir}")
    check_distributed_run(done, run_dir, "eagle3")


def test_deepspeed_zero2_with_two_cpu_processes(tmp_path):
    run_dir = tmp_path / "run"
    done = accelerate_launch("--use_deepspeed", "--zero_stage", "2", "--num_processes", "2",
                             "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                             "train/main.py", "head=mtp", *SHORT, "train.grad_accum=2", "optim.name=muon",
                             f"hydra.run.dir={run_dir}")
    check_distributed_run(done, run_dir, "mtp")
    assert (run_dir / "checkpoints" / "step_0000002" / "pytorch_model").is_dir()  # DeepSpeed's layout
    # Muon (head=eagle3's default) needs whole matrices, which ZeRO shards: the run says so and takes AdamW
    assert "trains with AdamW" in done.stderr + done.stdout
