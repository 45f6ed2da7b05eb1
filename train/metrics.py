"""Where metrics go: `metrics.jsonl` in the run dir (always, rank 0 only) and wandb when `logger=wandb`.

Rows are flat JSON objects: {"split": "train", "step": 10, "loss": ..., "lr": ..., ...} and
{"split": "val", "step": 100, "loss": ..., "sim_tau": ..., "acc_depth_1": ..., ...}.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from accelerate import Accelerator
from omegaconf import DictConfig, OmegaConf

from headway.heads.files import write_text_atomic

METRICS_FILE = "metrics.jsonl"
log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, accelerator: Accelerator, run_dir: Path, cfg: DictConfig, resumed_step: int | None):
        """`resumed_step`: the step this run starts from (0 when fresh); None keeps every row."""
        self.accelerator = accelerator
        self.path = Path(run_dir) / METRICS_FILE
        if accelerator.is_main_process and resumed_step is not None:
            self._forget_after(resumed_step)
        if cfg.logger.kind == "wandb":
            init = {"dir": os.environ.get("WANDB_DIR", str(run_dir)), "tags": list(cfg.logger.tags)}
            init.update({k: cfg.logger[k] for k in ("entity", "name", "mode") if cfg.logger[k] is not None})
            accelerator.init_trackers(cfg.logger.project, config=OmegaConf.to_container(cfg, resolve=True),
                                      init_kwargs={"wandb": init})

    def write(self, row: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        split = row["split"]
        values = {f"{split}/{k}": v for k, v in row.items() if k not in ("split", "step")}
        self.accelerator.log(values, step=row["step"])

    def _forget_after(self, step: int) -> None:
        """A run (re)starting at `step` redoes the steps after it: drop the earlier run's rows for them (all
        rows when it starts fresh), and a line a kill cut short."""
        if not self.path.is_file():
            return
        kept = []
        for n, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                log.warning("%s:%d is not a complete JSON row (cut short by a kill?): dropped", self.path, n)
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                kept.append(line)
        write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def close(self) -> None:
        self.accelerator.end_training()
