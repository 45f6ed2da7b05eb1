"""Files that are never half-written, and their checksums.

Every output (a head folder, an export, a cache shard, a measured curve, eval.json) is built under a
temporary name beside its destination and renamed over it only when complete: a killed or failing
writer leaves the previous file (or nothing), never a torn one. Renames within one folder are atomic.

    with atomic_path(path) as tmp:                 # a file: write to tmp
        save_file(tensors, str(tmp))
    with atomic_path(folder, directory=True) as tmp:   # a folder: fill the (existing) tmp folder
        (tmp / "config.json").write_text(...)
    write_json_atomic(path, obj)

Text files a user hands in (JSONL conversations, prompt sets) are checked for what the user can fix, with
the file and line, before a library's generic message: `check_text_file`, `first_json_error`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary path beside `path` (created as an empty folder if `directory`); when the
    block ends without an exception, move it over `path` (replacing a file or folder there); otherwise
    remove it and leave `path` untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        swap_in(tmp, path)
    finally:
        _remove(tmp)


def swap_in(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Rename `source` (a file or folder) to `path`, replacing what is there. A folder cannot be renamed
    over a non-empty one, so the old one is first moved aside (one more rename) and deleted after."""
    source, path = Path(source), Path(path)
    if path.is_dir() and not path.is_symlink():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        os.replace(source, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(source, path)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=str) + "\n")


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------------ user text files

def check_text_file(path: Path, error: type[Exception] = ValueError) -> None:
    """Every line UTF-8 and at least one that is not blank (else `error` with the file and line): a
    streamed pass, ~1 s per GB."""
    has_text = False
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise error(f"{path}:{n} is not UTF-8 text (byte {exc.start + 1} of the line is "
                                f"0x{line[exc.start]:02x}): re-save the file as UTF-8") from None
            has_text = has_text or bool(text.strip())
    if not has_text:
        raise error(f"{path} is empty (no line holds any text): write one JSON object per line")


def first_json_error(path: Path) -> str | None:
    """Where a JSON or JSON-lines file stops parsing (a truncated last line, a stray character), or None."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if Path(path).suffix == ".json":
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError as exc:
            if exc.msg != "Extra data":  # "Extra data": a .json file holding JSON lines, checked below
                return f"{path}:{exc.lineno} is not valid JSON ({exc.msg})"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"{path}:{n} is not valid JSON ({exc.msg}; cut short?): write one complete JSON object per line"
        if not isinstance(row, dict):
            return f"{path}:{n} is a JSON {type(row).__name__}, not an object: write one JSON object per line"
    return None
