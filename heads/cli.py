"""Commands that compose their Hydra config in-process (calibrate, roofline, the hidden-state cache): the
same conf/ tree, override grammar and schema dataclasses as train/main.py and infer.evaluate, so a
misspelled key or a mistyped value fails; bad input ends with one `error:` line and exit status 2.

    def main(argv=None) -> int:
        return run_command("calibrate", calibrate, argv, errors=(TargetError,), usage=__doc__)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(config_name: str, overrides: Sequence[str] = ()):
    """conf/<config_name>.yaml with command-line style overrides (`key=value`, `group=option`)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def config_error(exc: Exception, hint: str = "") -> str:
    """Hydra's multi-line composition errors as one line."""
    from hydra.errors import MissingConfigException

    tail = f" ({hint})" if hint else ""
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options:
        group, _, name = exc.missing_cfg_file.partition("/")
        return f"unknown {group} {name!r}: choose one of {', '.join(sorted(exc.options))}{tail}"
    first = str(exc).splitlines()[0].rstrip(".")
    if first.startswith("Ambiguous value"):  # a comma outside brackets: Hydra's sweep syntax
        return f"{first}: write a list as key=[a,b] or a string with commas as key='a,b'{tail}"
    lines = [first]
    if exc.__cause__ is not None and str(exc.__cause__).strip():
        lines.append(str(exc.__cause__).strip().splitlines()[0])
    return ": ".join(lines) + tail


def run_command(config_name: str, job: Callable, argv: Sequence[str] | None = None,
                errors: tuple[type[Exception], ...] = (), usage: str = "",
                hint: str = "see every key and its default with --help") -> int:
    """Compose conf/<config_name>.yaml with `argv` (default: sys.argv[1:]) and run `job(cfg)`; -> exit status.
    `--help` prints `usage` and the composed defaults; `hint` ends every configuration error."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if {"-h", "--help"} & set(argv):
            print(usage.strip() + "\n\nkeys and defaults (override with key=value):\n"
                  + OmegaConf.to_yaml(compose(config_name)))
            return 0
        cfg = compose(config_name, argv)
        job(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        print(f"error: {config_error(exc, hint)}", file=sys.stderr)
        return 2
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
