"""`init_from=<head folder>`: start a run from a trained head instead of a fresh one.

Fine-tuning a head on more or other data (a published head on your domain, a CPU head on a second draw of the
data) keeps what it learnt: the run starts from the folder's weights and its draft vocabulary (the token counts
it was trained with, so its read-out rows keep meaning the same tokens), with a fresh optimizer, learning-rate
schedule and step count. An EAGLE-3 run with another `draft_vocab_size` picks its vocabulary from the same
counts and keeps the trained read-out row of every token both vocabularies hold (a larger vocabulary's new
tokens start from the target's rows carried into the trained read-out's space: heads.eagle3.carry_state).
The run's head options are the folder's own (a 16,384-token head stays one, a head trained with noise keeps it),
except those the command line names (`head.options.draft_vocab_size=32768`): train/main.py merges them before
the run starts. The folder must hold a head of the run's kind, trained for a target of the same shapes; it is
checked before any data is built. `resume` wins: a resumed run continues its own checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from headway.heads.base import DraftHead, HeadError, check_fits_target, load_counts, load_weights, read_head_config
from headway.train.config import ConfigError

log = logging.getLogger(__name__)


def init_folder(init_from: str | None, kind: str) -> Path | None:
    """The head folder to start from (None: a fresh head); a folder that cannot be one is a ConfigError."""
    if init_from is None:
        return None
    folder = Path(init_from).expanduser()
    try:
        config = read_head_config(folder)
    except HeadError as exc:
        raise ConfigError(f"init_from={init_from}: {exc}") from None
    if config["head_kind"] != kind:
        raise ConfigError(f"init_from={init_from} holds a {config['head_kind']} head, but this run trains "
                          f"head={kind}: pass head={config['head_kind']}, or a {kind} head's folder")
    return folder


def named_head_options(overrides: Iterable[str], options: Iterable[str]) -> set[str]:
    """The head options a list of Hydra overrides sets: `head.options.X=...` (also with + or ++) names X;
    `head.options={...}` names them all."""
    named = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("~+")
        if key == "head.options":
            return set(options)
        if key.startswith("head.options."):
            named.add(key.split(".")[2])
    return named


def inherit_head_options(cfg: DictConfig, overrides: Iterable[str]) -> None:
    """With init_from, set cfg.head.options to the folder's head options, except those `overrides` name
    (options the folder's head predates keep this run's value)."""
    folder = init_folder(cfg.init_from, cfg.head.kind)
    if folder is None:
        return
    options = OmegaConf.to_container(cfg.head.options, resolve=True)
    saved = read_head_config(folder)["options"]
    named = named_head_options(overrides, options)
    inherited = {k: saved[k] for k in options if k in saved and k not in named and saved[k] != options[k]}
    if inherited:
        log.info("init_from=%s: head options from the folder: %s", folder,
                 ", ".join(f"{k}={v}" for k, v in sorted(inherited.items())))
    cfg.head.options = {**options, **inherited}


def start_from(head: DraftHead, folder: Path, target) -> None:
    """Give the freshly built `head` the weights and draft vocabulary of the head in `folder`."""
    config = read_head_config(folder)
    check_fits_target(config, target, folder)
    differ = sorted(k for k in set(config["options"]) | set(head.options)
                    if config["options"].get(k) != head.options.get(k))
    if differ:
        log.warning("init_from=%s: head options differ from this run's (%s); training with this run's",
                    folder, ", ".join(differ))
    counts = load_counts(folder, head.target_config.vocab_size)
    if counts is None:  # a head saved without counts: this run's data (already seen) decides the vocabulary
        log.warning("init_from=%s has no token counts: the draft vocabulary comes from this run's data", folder)
    else:  # its vocabulary first (EAGLE-3: the draft rows; others: the trained rows), then its weights
        head.token_counts = counts
        head.init_from_data(counts)
    load_weights(head, folder, carry=True)  # EAGLE-3 with another draft_vocab_size: rows mapped by token
    log.info("starting from the head in %s (its weights and draft vocabulary; a fresh optimizer and schedule)",
             folder)
