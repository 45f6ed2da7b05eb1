"""Local data files read as text (JSONL conversations, JSON, prompt sets): the problems a user can fix, found
with the file and line, before (or instead of) a library's generic message.

    check_text_file(path)     -> not UTF-8 (file:line), or nothing but blank lines: DataError
    first_json_error(path)    -> "path:line is not valid JSON (...)" for the first bad line, or None
"""

from __future__ import annotations

import json
from pathlib import Path

from train.data.config import DataError


def check_text_file(path: Path) -> None:
    """Every line UTF-8 and at least one that is not blank: a streamed pass, ~1 s per GB."""
    has_text = False
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{n} is not UTF-8 text (byte {exc.start + 1} of the line is "
                                f"0x{line[exc.start]:02x}): re-save the file as UTF-8") from None
            has_text = has_text or bool(text.strip())
    if not has_text:
        raise DataError(f"{path} is empty (no line holds any text): write one JSON object per line")


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
