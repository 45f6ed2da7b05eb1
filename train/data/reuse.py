"""What a default dataset build can take from the complete builds already in the cache instead of asking the
target again: self-written prompt candidates and answers.

A larger build (more self-written prompts per category: `experiment=cpu_long` after the default job, or
`data.regen.self_prompts` raised) shares most of its prompts with a smaller one: the written and stdlib prompts,
and self-written candidates of the same ids (each build keeps its candidates, dropped ones included). A
candidate is taken when it was written under the same provenance (target, precision, sampling settings,
seed, the examples it was shown); a conversation when it was answered under the same provenance (target,
generation settings, seed, precision; the backend aside, which changes speed, not what is written) and
holds the same id and the same system and user turns. Like a change of batch size, this changes how the data
is made, not what it is: a greedy reply is the one the target would write again (up to the order of fp32
sums), a sampled one (every candidate, a share of the replies) a draw from the same distribution, maybe with
another seed. Reused conversations are not captured during generation; training's cache pass finds their
hidden states already cached when the earlier build captured the same layers, and computes them otherwise.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)
IGNORED = ("backend",)  # provenance fields that change speed only


def user_turns(messages: list[dict]) -> list[tuple[str, str]]:
    """The (role, content) of every turn the target did not write: the system and user turns."""
    return [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"]


def same_provenance(a: dict, b: dict) -> bool:
    def strip(p):
        return {k: v for k, v in p.items() if k not in IGNORED}
    return isinstance(a, dict) and isinstance(b, dict) and strip(a) == strip(b)


def earlier_builds(final: Path, suffix: str = "") -> list[Path]:
    """The complete files of other default dataset builds of the same target in final's folder, newest first:
    their conversations (suffix "") or their self-written candidates ("-candidates"). Only final files: a
    `.partial` is never complete, and its own build resumes it."""
    stem = final.name.rsplit("-", 1)[0]  # default-<target name>
    found = [p for p in final.parent.glob(f"{stem}-*{suffix}.jsonl")
             if p.stem != final.stem + suffix and p.stem.count("-") == final.stem.count("-") + suffix.count("-")]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def matching_rows(sources: list[Path], wanted: Callable[[dict], bool]) -> list[dict]:
    """The rows of `sources` that `wanted` accepts, one per id (from the first source that has it)."""
    found: dict[str, dict] = {}
    for path in sources:
        try:
            lines = path.read_text().split("\n")
        except (OSError, UnicodeDecodeError) as exc:  # unreadable: nothing from it, the rows are generated
            log.warning("not reusing rows of %s: %s", path, exc)
            continue
        for line in lines:
            try:
                row = json.loads(line)
                if row["id"] not in found and wanted(row):
                    found[row["id"]] = row
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                continue
    return list(found.values())


def reusable_answers(rows: list[dict], provenance: dict, sources: list[Path]) -> list[dict]:
    """The conversations of `sources` that answer `rows` (from prompt_rows) as this build would: same id, same
    system and user turns, same provenance."""
    turns = {r["id"]: user_turns(r["turns"]) for r in rows}
    return matching_rows(sources, lambda row: row["id"] in turns and same_provenance(row["provenance"], provenance)
                         and user_turns(row["messages"]) == turns[row["id"]])


def reusable_candidates(ids: set[str], provenance: dict, sources: list[Path]) -> list[dict]:
    """The self-written candidates of `sources` with these ids, written as this build would write them (same
    provenance: target, precision, sampling settings, seed, examples shown)."""
    return matching_rows(sources, lambda row: row["id"] in ids and same_provenance(row["provenance"], provenance))
