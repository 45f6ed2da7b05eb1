"""Self-distillation: regenerate a dataset's assistant turns with the frozen target.

    python scripts/prepare_data.py                                  # build the embedded default (data=default)
    python scripts/prepare_data.py default_set.regen.self_prompts=600 capture_head=eagle3   # a bigger one
    python scripts/prepare_data.py input=conv.jsonl output=distilled.jsonl generation.temperature=0.7
    python scripts/prepare_data.py input=HuggingFaceH4/ultrachat_200k split=train_sft \
        max_conversations=20000 output=ultrachat-distilled.jsonl target=llama-3.1-8b-instruct

With input=builtin:default (and no output) it builds exactly what `data=default` builds on first use, with the
settings of conf/data/default.yaml (override them as default_set.regen.*), and stores the features of the
head kind `capture_head` (null: none) in the hidden-state cache training reads, in the same pass.
Otherwise `input` holds prompts ({"prompt"} rows) or conversations (messages / ShareGPT); every user turn is
answered by the target (settings: generation.*). The output is a messages-format JSONL (train on it with data.source=<output>) with the
prompt, the response and provenance (target, sampling settings). Killed? Run the same command again: it
keeps what was written and continues.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from headway.heads.kernels.allocator import keep_freed_memory
from headway.heads.target import TargetError, TargetSpec, load_target
from headway.train.data.config import DataConfig, DataError, RegenConfig
from headway.train.data.regenerate import GenerationSettings, prompt_rows, regenerate


@dataclass
class PrepareConfig:
    input: str = "builtin:default"  # builtin:default (the default prompt set) | local file/dir | hub dataset
    subset: Optional[str] = None  # hub dataset config name
    data_files: Optional[str] = None
    split: str = "train"
    format: str = "auto"  # auto | messages | sharegpt (prompt rows {"prompt"} are always understood)
    max_conversations: Optional[int] = None  # the first N rows of the input
    output: Optional[str] = None  # JSONL to write; null with input=builtin:default: data=default's cache file
    device: str = "auto"  # auto (GPU when present) | cpu
    target: TargetSpec = MISSING
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    default_set: DataConfig = field(default_factory=DataConfig)  # conf/data/default.yaml (input=builtin:default)
    capture_head: Optional[str] = "eagle"  # builtin:default: cache the features this head kind reads (null: none)
    max_length: int = 512  # train.max_length of the training that will read the captured features


ConfigStore.instance().store(name="prepare_data_schema", node=PrepareConfig)


def load_input(cfg: PrepareConfig) -> list[dict]:
    if cfg.input == "builtin:default":
        from headway.train.data.default_set import default_prompts

        return default_prompts(cfg.max_conversations, cfg.default_set.regen.extra_prompts)
    from headway.train.data.build import load_raw

    raw = load_raw(DataConfig(source=cfg.input, subset=cfg.subset, data_files=cfg.data_files,
                              split=cfg.split), cfg.input)
    if cfg.max_conversations:
        raw = raw.select(range(min(cfg.max_conversations, len(raw))))
    return list(raw)


def prepare(cfg: PrepareConfig) -> dict:
    """Regenerate and return a report: counts, tokens and seconds."""
    import torch

    g = cfg.generation
    if g.max_new_tokens < 1 or g.batch_size < 1:
        raise DataError("generation.max_new_tokens and generation.batch_size must be >= 1")
    from headway.train.data.config import check_precision
    from headway.train.data.decode import resolve_precision
    from headway.train.data.vllm_decode import resolve_backend

    regen_cfg = cfg.default_set.regen
    check_precision(g.precision, "generation.precision")
    check_precision(regen_cfg.precision, "default_set.regen.precision")
    resolve_backend(g.backend, g.vllm_python)  # a bad choice fails before any model loads
    resolve_backend(regen_cfg.backend, regen_cfg.vllm_python)
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if cfg.device == "auto" else cfg.device)
    if device == "cpu":  # decoding allocates the same large tensors every step (heads/kernels/allocator.py)
        keep_freed_memory()
    g = replace(g, precision=resolve_precision(g.precision, device))  # rows record what wrote them
    started = time.perf_counter()
    if cfg.input == "builtin:default" and not cfg.output:  # exactly what data=default builds on first use
        from headway.train.data.default_set import ensure_default_dataset, report_path

        regen = RegenConfig(**{**vars(cfg.default_set.regen), "num_prompts": cfg.max_conversations})
        final = ensure_default_dataset(regen, device, default_set_capture(cfg, regen, device))
        report = dict(json.loads(report_path(final).read_text()), output=str(final))
    else:
        if not cfg.output:
            raise DataError(f"output=<file.jsonl> is required when input={cfg.input!r}")
        rows, skipped = prompt_rows(load_input(cfg), cfg.format)
        if not rows:
            raise DataError(f"input {cfg.input!r} has no usable prompt (skipped: {skipped})")
        target = load_target(cfg.target, device=device)
        final = Path(cfg.output).expanduser()
        report = dict(regenerate(rows, target, final, g), output=str(final), skipped=skipped)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    return report


def default_set_capture(cfg: PrepareConfig, regen: RegenConfig, device: str):
    """The capture a later `train/main.py head=<capture_head>` on this target reads (None when off, or
    when the target is not the one that writes the data)."""
    if not cfg.capture_head or (cfg.target.path, cfg.target.name) != (regen.target, regen.target_name):
        return None
    from headway.heads.base import build_head
    from headway.train.data.capture import capture_plan

    head_conf = ROOT / "conf" / "head" / f"{cfg.capture_head}.yaml"
    if not head_conf.is_file():
        raise DataError(f"capture_head={cfg.capture_head!r} is unknown: use one of "
                        f"{sorted(p.stem for p in head_conf.parent.glob('*.yaml'))} or null")
    target = load_target(cfg.target, device=device)
    options = OmegaConf.to_container(OmegaConf.load(head_conf).get("options") or {}, resolve=True)
    layers = build_head(cfg.capture_head, target, **options).feature_layers()
    data = cfg.default_set
    return capture_plan(DataConfig(**{**vars(data), "hidden_states": "offline"}), target, layers, cfg.max_length)


@hydra.main(config_path="../conf", config_name="prepare_data", version_base="1.3")
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[%(asctime)s][%(name)s] %(message)s")
    schema: PrepareConfig = OmegaConf.to_object(cfg)
    try:
        report = prepare(schema)
    except (DataError, TargetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
