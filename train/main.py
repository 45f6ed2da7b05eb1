"""Train a draft head:  accelerate launch train/main.py head=eagle   (or: python train/main.py head=eagle)

A thin Hydra entry point: compose conf/train.yaml with the command-line overrides, then `train(cfg)`.
Bad input (an unknown head or target, a misspelled key, lr=0 or inf, a missing target path, an empty or
unreadable dataset, a run dir that cannot be written) ends with one line on stderr naming the problem and
exit code 2, before anything is written; so does a NaN loss or gradient (nothing is saved after it) and a
disk that fills up mid-run (checkpoints are written whole or not at all: continue with resume=latest).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path


import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from safetensors import SafetensorError

from headway.heads.base import HeadError
from headway.heads.cli import config_error
from headway.heads.target import TargetError
from headway.train.config import ConfigError  # registers the config schema
from headway.train.data import DataError

USER_ERRORS = (ConfigError, HeadError, TargetError, DataError)
FULL_ERRORS = bool(os.environ.get("HYDRA_FULL_ERROR"))  # the user asked for Hydra's tracebacks


CONF = str(Path(__file__).resolve().parents[1] / "conf")  # a path: run as a script or as headway-train


@hydra.main(config_path=CONF, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from headway.train.loop import train
    from headway.train.warm_start import inherit_head_options

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # not a line per checkpoint file
    try:
        # init_from: the folder's head options, except those the command line names
        inherit_head_options(cfg, HydraConfig.get().overrides.task)
        train(cfg)
    except USER_ERRORS as exc:
        fail(str(exc))
    except (OSError, SafetensorError) as exc:  # a disk that fills up or turns read-only mid-run; the
        if FULL_ERRORS:                          # checkpoints on disk stay whole (temp folder, then rename)
            raise
        reason = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0]
        fail(f"cannot write {getattr(exc, 'filename', None) or 'the run dir'}: {reason}: free some space (or "
             f"pass hydra.run.dir=<a writable folder>), then continue with resume=latest")


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def rank_overrides(argv: list[str]) -> list[str]:
    """Every rank of a distributed launch runs Hydra. Ranks > 0 must not write a run dir of their own
    (with `${now:}` theirs can differ from rank 0's): give them an empty scratch dir, no output or log
    files; `train` then uses rank 0's run dir, broadcast."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        return argv
    scratch = tempfile.mkdtemp(prefix=f"headway-rank{rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    quiet = [f"hydra.run.dir={scratch}", "hydra.output_subdir=null", "hydra/job_logging=disabled",
             "hydra/hydra_logging=disabled"]
    return [a for a in argv if not a.startswith(("hydra.run.dir=", "hydra.output_subdir="))] + quiet


if __name__ == "__main__":
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing; we print one line below
    sys.argv = sys.argv[:1] + rank_overrides(sys.argv[1:])
    try:
        main()
    except (HydraException, OmegaConfBaseException) as exc:
        if FULL_ERRORS:
            raise
        fail(config_error(exc, hint="see the keys with: python train/main.py --cfg job"))
    except OSError as exc:  # Hydra could not create the run dir (under a file, read-only, full)
        if FULL_ERRORS:
            raise
        fail(f"cannot create the run dir {exc.filename or ''}: {exc.strerror or exc}: pass "
             f"hydra.run.dir=<a writable folder>")
