"""A run's checkpoints: full training state for resume, and self-describing head folders.

run_dir/checkpoints/step_0000200/   accelerate `save_state` (head weights, optimizer, RNG of every rank,
                                    dataloader sampler) + trainer_state.json (step, tokens seen, best tau,
                                    the head and target identity) + checksums.json (sha256 of every file)
run_dir/checkpoints/best/           the head with the best simulated tau so far (a `save_head` folder)
run_dir/final/                      the head at the end of training (a `save_head` folder)

Every folder is written under a temporary name and renamed when complete, so a killed run never leaves a
half-written checkpoint that `resume=latest` would pick up. A checkpoint damaged later (a truncated copy,
flipped bytes) fails its checksums: resume then falls back, with a warning, to the newest intact one. Only
a damaged random state is tolerated when nothing better is left (a warning says the random draws will
differ from an uninterrupted run's). Resume also checks the checkpoint was saved by the same head on the
same target: name, revision, architecture and a fingerprint of its weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from headway.heads.base import save_head, unwrap
from headway.heads.files import file_sha256, swap_in
from headway.train.config import ConfigError, TrainingError

log = logging.getLogger(__name__)  # plain logging: find_checkpoint also runs without an Accelerator

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"
CHECKSUMS = "checksums.json"  # {relative path: sha256} of every other file of a step checkpoint
RNG_STATE = re.compile(r"^random_states_\d+\.pkl$")  # accelerate's per-rank random state
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dirs(run_dir: Path) -> list[Path]:
    """Complete periodic checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [p for p in root.glob("step_*") if STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def find_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """`resume`: null (start fresh), `latest` (newest intact checkpoint of this run dir, if any), a checkpoint
    folder (refused when damaged), or a run dir (its newest intact checkpoint)."""
    if resume is None:
        return None
    if resume == "latest":
        found = step_dirs(run_dir)
        return newest_intact(found, run_dir) if found else None
    path = Path(resume).expanduser()
    if (path / STATE_FILE).is_file():
        problems = damage(path)
        if problems and not all(rng_only(p) for p in problems):
            raise ConfigError(f"checkpoint {path} is damaged ({problems[0]}): resume from its run dir "
                              f"(resume=<run dir>) to take the newest intact checkpoint")
        if problems:
            log.warning(f"checkpoint {path}: {problems[0]}: the resumed run's random draws will differ from an "
                        f"uninterrupted run's")
        return path
    found = step_dirs(path)
    if found:
        return newest_intact(found, path)
    raise ConfigError(f"resume={resume!r} is neither a checkpoint (a folder with {STATE_FILE}) nor a run dir "
                      f"with one under {CHECKPOINTS}/: pass resume=latest with the run's hydra.run.dir, or a "
                      f"path from <run dir>/{CHECKPOINTS}/")


def resume_point(accelerator: Accelerator, resume: str | None, run_dir: Path) -> Path | None:
    """find_checkpoint on rank 0 (it reads every file once), the answer (or its error) shared with all ranks."""
    box = [None, None]
    if accelerator.is_main_process:
        try:
            found = find_checkpoint(resume, run_dir)
            box[0] = None if found is None else str(found)
        except ConfigError as exc:
            box[1] = str(exc)
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    if box[1] is not None:
        raise ConfigError(box[1])
    return None if box[0] is None else Path(box[0])


# ----------------------------------------------------------------------------------------- integrity

def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): file_sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != CHECKSUMS}


def damage(folder: Path) -> list[str]:
    """What is wrong with a step checkpoint: [] when every file matches checksums.json and the trainer state
    reads. Checkpoints saved before checksums were recorded are judged by their trainer state alone."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{STATE_FILE} is unreadable ({type(exc).__name__})"]
    if not (folder / CHECKSUMS).is_file():
        return []
    try:
        recorded = json.loads((folder / CHECKSUMS).read_text())
    except (OSError, ValueError) as exc:
        return [f"{CHECKSUMS} is unreadable ({type(exc).__name__})"]
    problems = []
    for name, digest in recorded.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_sha256(path) != digest:
            problems.append(f"{name} is corrupted (checksum mismatch)")
    return problems


def rng_only(problem: str) -> bool:
    """A damaged random state loses reproducibility, not the training: tolerable when nothing better is left."""
    return bool(RNG_STATE.match(problem.split(" ", 1)[0]))


def newest_intact(found: list[Path], run_dir: Path) -> Path:
    """The newest checkpoint with no damage; failing that, the newest whose only damage is a random state."""
    report = [(ckpt, damage(ckpt)) for ckpt in reversed(found)]
    for ckpt, problems in report:
        if not problems:
            break
        log.warning(f"checkpoint {ckpt} is damaged ({'; '.join(problems[:3])}): falling back to an older one")
    else:
        usable = [(c, p) for c, p in report if all(rng_only(x) for x in p)]
        if not usable:
            raise ConfigError(f"no intact checkpoint under {Path(run_dir) / CHECKPOINTS} (newest: {report[0][0].name}, "
                              f"{report[0][1][0]}): start fresh (resume=null, or another hydra.run.dir)")
        ckpt = usable[0][0]
        log.warning(f"resuming from {ckpt} without its random state: the resumed run's random draws will differ "
                    f"from an uninterrupted run's")
    return ckpt


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
        (tmp / CHECKSUMS).write_text(json.dumps(checksums(tmp), indent=1) + "\n")
        swap_in(tmp, final)  # every rank wrote into tmp: its name is fixed, not atomic_path's
        for old in step_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def run_identity(kind: str, options: dict, target) -> dict:
    """What a checkpoint must match to be resumed: the head and the full target identity."""
    from headway.heads.target import target_identity

    return {"head": kind, "head_options": options, "target": target.spec.name,
            "target_identity": target_identity(target)}


def identity_mismatch(saved: dict, expect: dict, prefix: str = "") -> str | None:
    """The first field (dotted) whose saved value differs from this run's, as "field: saved X, this run Y".
    Fields a checkpoint does not record (saved before they were) are not compared."""
    for key, want in expect.items():
        if key not in saved:
            continue
        have = saved[key]
        if isinstance(want, dict) and isinstance(have, dict):
            found = identity_mismatch(have, want, f"{prefix}{key}.")
            if found:
                return found
        elif have != want:
            return f"{prefix}{key}: checkpoint {have!r}, this run {want!r}"
    return None


def load_checkpoint(accelerator: Accelerator, path: Path, expect: dict) -> dict:
    """Restore head, optimizer, RNG and sampler states (every rank) and return the trainer state, after
    checking it was saved by the same head on the same target (`expect`: run_identity, or a part of it)."""
    state = json.loads((Path(path) / STATE_FILE).read_text())
    different = identity_mismatch(state, expect)
    if different:
        raise ConfigError(f"checkpoint {path} was saved by another head or target ({different}): resume with the "
                          f"same head and target, or start fresh (resume=null or another hydra.run.dir)")
    rng = Path(path) / f"random_states_{accelerator.process_index}.pkl"
    if not readable_rng_state(rng):
        log.warning(f"{rng} is missing or unreadable: the resumed run's random draws will differ from an "
                    f"uninterrupted run's")
    accelerator.load_state(str(path))
    return state


def readable_rng_state(path: Path) -> bool:
    """Whether accelerate can restore this random state (it skips one it cannot, saying so only at INFO)."""
    from accelerate.utils import load

    try:
        return isinstance(load(path), dict)
    except Exception:  # missing, truncated, or a pickle the safe (weights_only) loader refuses
        return False


def save_head_folder(accelerator: Accelerator, model, directory: Path, extra: dict) -> None:
    """Write a `save_head` folder from rank 0. Call on every rank: under ZeRO-3 the weights are sharded
    and gathering them is collective."""
    with gathered_weights(accelerator, model):
        bad = [n for n, p in unwrap(model).named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:  # every rank sees the same weights here, so every rank stops
            raise TrainingError(f"the head's weights hold NaN or infinite values ({', '.join(bad[:3])}): "
                                f"{directory} is not written; lower optim.lr or resume from an earlier checkpoint")
        if accelerator.is_main_process:
            save_head(unwrap(model), directory, extra=extra)
    accelerator.wait_for_everyone()


def gathered_weights(accelerator: Accelerator, model):
    plugin = accelerator.state.deepspeed_plugin
    if accelerator.distributed_type != DistributedType.DEEPSPEED or plugin is None or plugin.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(unwrap(model).parameters()), modifier_rank=None)
