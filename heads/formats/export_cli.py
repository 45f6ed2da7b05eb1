"""Export a trained head for vLLM / SGLang / Medusa tooling, with a model card, optionally pushed to the Hub.

    python scripts/export.py checkpoint=RUN/final format=auto output=DIR [overwrite=true]
                             [push=true repo_id=ORG/NAME private=true] [eval=PATH/eval.json]

The layouts and what loads them: heads/formats/ (one module per layout). Bad input (a missing or corrupted
final/, a format that does not fit the head, a non-empty output without overwrite=true, an output that is,
contains or lies inside the checkpoint or its run directory, NaN weights, a read-only or full disk, no Hub
token) ends with one error line and exit code 2; the output folder is written to a temp folder and renamed,
so it is never half-written. The target's own Python runs only with trust_remote_code=true on this command line.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


log = logging.getLogger("export")


@dataclass
class ExportConfig:
    checkpoint: str = MISSING  # a head folder: a run's final/ (or checkpoints/best/)
    output: str = MISSING  # folder to write; refused when it exists and is not empty, unless overwrite
    format: str = "auto"  # auto (the head's primary layout) | a layout registered in heads/formats/
    overwrite: bool = False
    eval: Any = None  # eval.json path(s) from infer.evaluate (default: eval*.json found next to checkpoint)
    base_model: Optional[str] = None  # Hub id or local folder of the target (default: from the checkpoint's target spec)
    num_speculative_tokens: Optional[int] = None  # draft length in the serving commands (default: head depth)
    license: Optional[str] = "apache-2.0"  # model-card license: follow the target's license terms
    push: bool = False  # upload output= to the Hub (create_repo(exist_ok=True) + upload_folder)
    repo_id: Optional[str] = None  # ORG/NAME, required with push=true
    private: bool = False
    commit_message: Optional[str] = None
    trust_remote_code: bool = False  # let transformers run the target folder's own Python (yours to decide:
    #                                  a trust_remote_code recorded in the checkpoint is never honoured)


ConfigStore.instance().store(name="export_schema", node=ExportConfig)


def export(cfg: DictConfig) -> Path:
    """Run one export described by a composed conf/export.yaml; returns the output folder."""
    from headway.heads.formats.hub import check_repo_id, hub_token, push_folder
    from headway.heads.formats.io import export_head

    if cfg.push:  # check what can fail cheaply before the target loads
        check_repo_id(cfg.repo_id)
        hub_token()
    eval_path = OmegaConf.to_container(cfg.eval) if OmegaConf.is_config(cfg.eval) else cfg.eval
    out = export_head(cfg.checkpoint, cfg.output, cfg.format, overwrite=cfg.overwrite, eval_path=eval_path,
                      base_model=cfg.base_model, num_speculative_tokens=cfg.num_speculative_tokens,
                      license=cfg.license, where=cfg.repo_id if cfg.push else None,
                      trust_remote_code=cfg.trust_remote_code)
    log.info("exported %s -> %s", cfg.checkpoint, out)
    if cfg.push:
        url = push_folder(out, cfg.repo_id, private=cfg.private, commit_message=cfg.commit_message)
        log.info("pushed %s -> %s", out, url)
    return out


def run(cfg: DictConfig) -> int:
    """Export, printing the output folder; bad input -> one `export error: ...` line on stderr, exit code 2."""
    from headway.heads.base import HeadError
    from headway.heads.formats.common import ExportError
    from headway.heads.target import TargetError

    try:
        out = export(cfg)
    except (ExportError, HeadError, TargetError) as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


@hydra.main(version_base=None, config_path=str(Path(__file__).resolve().parents[2] / "conf"), config_name="export")
def main(cfg: DictConfig) -> None:
    sys.exit(run(cfg))


if __name__ == "__main__":
    main()
