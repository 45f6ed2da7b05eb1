"""Run a command with one folder read-only, as a real filesystem would refuse it (shared by the tests of
training, evaluation and export that check a read-only output is one clear error)."""

import os
import shutil
from pathlib import Path

READ_ONLY = r"(Read-only file system|Permission denied)"  # what the refusal says (root / other users)


def read_only_command(folder: Path, argv: list[str]) -> list[str] | None:
    """argv, run with `folder` read-only: for root (who writes anywhere) a private read-only bind mount in a
    mount namespace of the command's own; for other users the folder's permissions. None if neither works."""
    if os.getuid() != 0:
        Path(folder).chmod(0o555)
        return argv
    if shutil.which("unshare") is None:
        return None
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(folder), *argv]
