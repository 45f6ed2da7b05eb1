"""A run's checkpoints: full training state for resume, and self-describing head folders.

run_dir/checkpoints/step_0000200/   accelerate `save_state` (head weights, optimizer, RNG of every rank,
                                    dataloader sampler) + trainer_state.json (step, tokens seen, best tau)
run_dir/checkpoints/best/           the head with the best simulated tau so far (a `save_head` folder)
run_dir/final/                      the head at the end of training (a `save_head` folder)

Every folder is written under a temporary name and renamed when complete, so a killed run never leaves a
half-written checkpoint that `resume=latest` would pick up.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType

from heads.base import save_head, unwrap
from heads.files import swap_in
from train.config import ConfigError

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete periodic checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [p for p in root.glob("step_*") if STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def find_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """`resume`: null (start fresh), `latest` (newest checkpoint of this run dir, if any), a checkpoint
    folder, or a run dir (its newest checkpoint)."""
    if resume is None:
        return None
    if resume == "latest":
        found = step_dirs(run_dir)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if (path / STATE_FILE).is_file():
        return path
    found = step_dirs(path)
    if found:
        return found[-1]
    raise ConfigError(f"resume={resume!r} is neither a checkpoint (a folder with {STATE_FILE}) nor a run dir "
                      f"with one under {CHECKPOINTS}/: pass resume=latest with the run's hydra.run.dir, or a "
                      f"path from <run dir>/{CHECKPOINTS}/")


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Save everything needed to continue at `step`. Call on every rank (collective under DeepSpeed)."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a run killed while saving
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(dict(state, step=step), indent=2) + "\n")
        swap_in(tmp, final)  # every rank wrote into tmp: its name is fixed, not atomic_path's
        for old in step_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, path: Path, expect: dict) -> dict:
    """Restore head, optimizer, RNG and sampler states (every rank) and return the trainer state, after
    checking it was saved by the same head on the same target (`expect`: {"head": ..., "target": ...})."""
    state = json.loads((Path(path) / STATE_FILE).read_text())
    saved = {k: state.get(k, v) for k, v in expect.items()}
    if saved != expect:
        raise ConfigError(f"checkpoint {path} was saved by head={saved['head']} on target={saved['target']}, "
                          f"this run is head={expect['head']} on target={expect['target']}: resume with the "
                          f"same head and target, or start fresh (resume=null or another hydra.run.dir)")
    accelerator.load_state(str(path))
    return state


def save_head_folder(accelerator: Accelerator, model, directory: Path, extra: dict) -> None:
    """Write a `save_head` folder from rank 0. Call on every rank: under ZeRO-3 the weights are sharded
    and gathering them is collective."""
    with gathered_weights(accelerator, model):
        if accelerator.is_main_process:
            save_head(unwrap(model), directory, extra=extra)
    accelerator.wait_for_everyone()


def gathered_weights(accelerator: Accelerator, model):
    plugin = accelerator.state.deepspeed_plugin
    if accelerator.distributed_type != DistributedType.DEEPSPEED or plugin is None or plugin.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(unwrap(model).parameters()), modifier_rank=None)
