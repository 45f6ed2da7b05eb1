"""Helpers for training tests: compose conf/train.yaml like `train/main.py` does; launch the CLI."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import headway.train.config  # noqa: F401  (registers the schema)

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
HEADS = sorted(p.stem for p in (CONF / "head").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))

torch.set_num_threads(1)


def compose_train(*overrides: str, run_dir=None):
    """The config `python train/main.py <overrides>` would run (run dir = `run_dir`)."""
    extra = [f"output_dir={run_dir}"] if run_dir is not None else []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides) + extra)


def launch(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repo root the way a user would (one thread per process: 2 shared cores)."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    return subprocess.run(args, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def accelerate_launch(*args: str, **kwargs) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("accelerate")
    return launch([str(exe), "launch", *args], **kwargs)
