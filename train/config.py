"""The training job's config schema (Hydra structured configs) and the checks a type cannot express.

`conf/train.yaml` starts its defaults list with `train_schema`, the `TrainConfig` registered here, so
Hydra merges every YAML and command-line override into typed nodes: a misspelled key or a value of the
wrong type fails while the config is composed, before anything is loaded. Values live in the YAML files
(conf/train.yaml, conf/optim/, conf/logger/, ...); the schema holds types and the meaning of each field.
`check_config` then rejects values that are well-typed but meaningless (lr <= 0, max_steps < 1, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from headway.heads.target import TargetSpec
from headway.train.data.config import DataConfig


class ConfigError(ValueError):
    """A config value that composes but cannot work; the message names the key and what to use."""


class TrainingError(ConfigError):
    """Training that cannot go on (a NaN loss or gradient); the message says what to do."""


@dataclass
class HeadConfig:
    kind: str = MISSING  # a registered head: medusa | eagle | eagle3 | mtp
    options: Dict[str, Any] = field(default_factory=dict)  # keyword arguments of the head's constructor


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon on the head's hidden weight matrices, AdamW on the rest)
    lr: float = MISSING  # peak learning rate (per-head defaults in conf/optim/head/<kind>.yaml)
    betas: List[float] = MISSING  # AdamW (beta1, beta2)
    eps: float = MISSING
    weight_decay: float = MISSING  # on weight matrices only, never on norms and biases
    schedule: str = MISSING  # cosine | linear (decay to lr * min_lr_ratio) | constant, after a linear warmup
    warmup_steps: Optional[int] = MISSING  # wins over warmup_ratio when set
    warmup_ratio: float = MISSING  # share of train.max_steps spent warming up
    min_lr_ratio: float = MISSING  # cosine ends at lr * min_lr_ratio
    grad_clip: float = MISSING  # max global grad norm (0 disables clipping)
    readout_lr_scale: float = 1.0  # lr of trained read-outs (lm_head rows started from the target's) = lr x this
    muon_lr_scale: float = 1.0  # optim.name=muon: the Muon matrices' lr = lr x this
    muon_weight_decay: Optional[float] = None  # optim.name=muon: the Muon matrices' weight decay (None: weight_decay)
    muon_ns_steps: int = 5  # optim.name=muon: Newton-Schulz iterations per step (fewer: cheaper, rougher)


@dataclass
class LoopConfig:
    max_steps: int = MISSING  # optimizer steps
    batch_size: int = MISSING  # sequences per process per micro-step
    grad_accum: int = MISSING  # micro-steps per optimizer step (effective batch = batch x accum x procs)
    max_length: int = MISSING  # tokens per sequence (longer conversations are truncated)
    group_by_length: bool = True  # batches of similar-length conversations (less padding), still shuffled
    loss_on: str = "all"  # tokens learned in training: assistant (the replies) | all (prompt tokens too: the
    # target's distribution is a soft label at every position); validation always scores the replies
    eval_every: int = MISSING  # validate every N steps (and at the end); 0 = only at the end
    eval_batches: Optional[int] = MISSING  # validation batches per process (null = the whole split)
    save_every: int = MISSING  # full checkpoint every N steps (0 = none); a run always saves final/
    keep_checkpoints: int = MISSING  # periodic checkpoints kept on disk (best/ is kept apart)
    log_every: int = MISSING  # train rows in metrics.jsonl every N steps
    seed: int = MISSING
    stop_after: Optional[int] = MISSING  # end this job after N steps (checkpoint first) without
    #                                      finishing the schedule; continue later with resume=latest
    ema_decay: Optional[float] = None  # validate and ship an exponential moving average of the weights with
    #                                    this decay (null: the weights as trained); train/ema.py


@dataclass
class LoggerConfig:
    kind: str = MISSING  # none | wandb (metrics.jsonl is always written)
    project: str = "headway"
    entity: Optional[str] = None
    name: Optional[str] = None  # run name (null: wandb picks one)
    mode: Optional[str] = None  # online | offline | disabled (null: $WANDB_MODE, else online)
    tags: List[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    head: HeadConfig = MISSING
    target: TargetSpec = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    train: LoopConfig = MISSING
    logger: LoggerConfig = MISSING
    resume: Optional[str] = None  # null | latest (newest checkpoint of this run dir) | a checkpoint or run dir
    init_from: Optional[str] = None  # a trained head folder to start from (fine-tuning; train/warm_start.py)
    device: str = "auto"  # auto (GPU when present) | cpu
    precision: str = "auto"  # mixed precision: auto (bf16 on GPU and on a CPU with AMX or AVX512-BF16, else none) | no | bf16 | fp16
    cpu_threads: str = "auto"  # on CPU: auto (physical cores / local processes) | N threads per process
    output_dir: str = MISSING  # the run dir; conf/train.yaml sets it to Hydra's output dir


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


register_configs()


# ------------------------------------------------------------------------------------- value checks

SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "muon")
LOSS_ON = ("assistant", "all")
PRECISIONS = ("auto", "no", "bf16", "fp16")
DEVICES = ("auto", "cpu")
LOGGERS = ("none", "wandb")

# (key, is the value fine?, what a fine value is)
RULES = [
    ("optim.name", lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
    ("optim.lr", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("optim.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1)"),
    ("optim.eps", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("optim.weight_decay", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("optim.schedule", lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
    ("optim.warmup_steps", lambda v: v is None or v >= 0, ">= 0 or null"),
    ("optim.warmup_ratio", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.grad_clip", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ("optim.readout_lr_scale", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("optim.muon_lr_scale", lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    ("optim.muon_weight_decay", lambda v: v is None or (math.isfinite(v) and v >= 0), "null or a finite number >= 0"),
    ("optim.muon_ns_steps", lambda v: v >= 1, "an integer >= 1"),
    ("train.max_steps", lambda v: v >= 1, ">= 1"),
    ("train.batch_size", lambda v: v >= 1, ">= 1"),
    ("train.grad_accum", lambda v: v >= 1, ">= 1"),
    ("train.max_length", lambda v: v >= 2, ">= 2"),
    ("train.loss_on", lambda v: v in LOSS_ON, f"one of {', '.join(LOSS_ON)}"),
    ("train.eval_every", lambda v: v >= 0, ">= 0 (0 = only at the end)"),
    ("train.eval_batches", lambda v: v is None or v >= 1, ">= 1 or null (the whole split)"),
    ("train.save_every", lambda v: v >= 0, ">= 0 (0 = no periodic checkpoints)"),
    ("train.keep_checkpoints", lambda v: v >= 1, ">= 1"),
    ("train.log_every", lambda v: v >= 1, ">= 1"),
    ("train.stop_after", lambda v: v is None or v >= 1, ">= 1 or null"),
    ("train.ema_decay", lambda v: v is None or 0 < v < 1, "in (0, 1) or null (no average)"),
    ("logger.kind", lambda v: v in LOGGERS, f"one of {', '.join(LOGGERS)}"),
    ("device", lambda v: v in DEVICES, f"one of {', '.join(DEVICES)}"),
    ("precision", lambda v: v in PRECISIONS, f"one of {', '.join(PRECISIONS)}"),
    ("cpu_threads", lambda v: str(v) == "auto" or (str(v).isdigit() and int(v) >= 1), "auto or a whole number >= 1"),
]


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError naming the first value that is well-typed but unusable."""
    for key, ok, wanted in RULES:
        value = OmegaConf.select(cfg, key)
        if not ok(value):
            shown = list(value) if isinstance(value, ListConfig) else value
            raise ConfigError(f"{key}={shown} is invalid: it must be {wanted}")


def check_fits_context(max_length: int, target_config) -> None:
    """Rows are truncated to train.max_length; that must fit the target's positions, or the target would
    be run past its context (its features there are meaningless) without anyone saying so."""
    limit = getattr(target_config, "max_position_embeddings", None)
    if limit and max_length > limit:
        raise ConfigError(f"train.max_length={max_length} exceeds the target's context of {limit} positions "
                          f"(max_position_embeddings): set train.max_length<={limit} (longer conversations are "
                          f"truncated to it)")
