"""Answers a default dataset build can take from the complete builds already in the cache, instead of asking
the target again.

A larger build (more self-written prompts per category: `experiment=cpu_long` after the default job, or
`data.regen.self_prompts` raised) shares most of its prompts with a smaller one: the written and stdlib prompts,
and the self-written candidates of the same ids, which are drawn in the same batches with the same seeds. A row
of an earlier build is taken as it is when it was answered under the same provenance (target, generation
settings, seed, precision; the backend aside, which changes speed, not what is written) and holds the same
id and the same system and user turns. Like a change of batch size, this changes how the data is made,
not what it is: a greedy reply is the one the target would write again (up to the order of fp32 sums), a
sampled one a draw from the same distribution with another seed. Reused rows are not captured during
generation; training's cache pass finds their hidden states already cached when the earlier build captured
the same layers, and computes them otherwise.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)
IGNORED = ("backend",)  # provenance fields that change speed only


def user_turns(messages: list[dict]) -> list[tuple[str, str]]:
    """The (role, content) of every turn the target did not write: the system and user turns."""
    return [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"]


def same_provenance(a: dict, b: dict) -> bool:
    def strip(p):
        return {k: v for k, v in p.items() if k not in IGNORED}
    return isinstance(a, dict) and isinstance(b, dict) and strip(a) == strip(b)


def earlier_builds(final: Path) -> list[Path]:
    """The complete default datasets of the same target in final's folder, newest first (only the final
    files: a `.partial` is never complete, and its own build resumes it)."""
    stem = final.name.rsplit("-", 1)[0]  # default-<target name>
    found = [p for p in final.parent.glob(f"{stem}-*.jsonl") if p != final and not p.name.endswith("-prompts.jsonl")]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def reusable_rows(rows: list[dict], provenance: dict, sources: list[Path]) -> list[dict]:
    """The rows of `sources` that answer `rows` (from prompt_rows) exactly as this build would: same id,
    same system and user turns, same provenance. One per id, from the first source that has it."""
    wanted = {r["id"]: user_turns(r["turns"]) for r in rows}
    found: dict[str, dict] = {}
    for path in sources:
        try:
            lines = path.read_text().split("\n")
        except (OSError, UnicodeDecodeError) as exc:  # unreadable: nothing from it, the rows are generated
            log.warning("not reusing answers from %s: %s", path, exc)
            continue
        for line in lines:
            try:
                row = json.loads(line)
                rid = row["id"]
                match = rid in wanted and rid not in found and same_provenance(row["provenance"], provenance) \
                    and user_turns(row["messages"]) == wanted[rid]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if match:
                found[rid] = row
    return list(found.values())
