"""Self-distillation: rewrite every assistant turn of a conversation set with the frozen target itself.

Conversations are processed in batches (left-padded HF `generate`); a multi-turn conversation is replayed
round by round, each user turn answered by the target given its own earlier answers. Finished
conversations are appended to the output JSONL as they complete (flushed and fsynced), so a killed run
keeps them and the next run continues with the rest.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from heads.files import write_text_atomic
from train.data.conversations import BadRow, end_of_turn_markers, normalize

log = logging.getLogger(__name__)
REGEN_VERSION = 1


@dataclass
class GenerationSettings:
    max_new_tokens: int = 160
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 16
    seed: int = 0


def prompt_rows(rows, fmt: str = "auto") -> tuple[list[dict], dict[str, int]]:
    """Rows of prompts ({"prompt"}) or conversations (messages / ShareGPT) -> [{"id", "category",
    "turns": [system?, user, user, ...]}] with assistant turns dropped; bad rows counted by reason."""
    out, skipped = [], {}
    for i, row in enumerate(rows):
        try:
            if isinstance(row.get("prompt"), str):
                if not row["prompt"].strip():
                    raise BadRow("empty_content")
                turns = [{"role": "user", "content": row["prompt"]}]
            else:
                form = fmt if fmt != "auto" else ("messages" if "messages" in row else "sharegpt")
                turns = [m for m in normalize(row, form, require_assistant=False) if m["role"] != "assistant"]
            if not any(m["role"] == "user" for m in turns):
                raise BadRow("no_user_turn")
        except BadRow as bad:
            skipped[bad.reason] = skipped.get(bad.reason, 0) + 1
            continue
        out.append({"id": str(row.get("id") or f"row-{i}"), "category": row.get("category") or "",
                     "turns": turns})
    return out, skipped


def done_ids(path: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is ignored and rewritten."""
    ids = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


def _drop_torn_tail(path: Path) -> None:
    if path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        text = path.read_text()
        write_text_atomic(path, text[: text.rfind("\n") + 1])


@torch.no_grad()
def generate_replies(target, conversations: list[list[dict]], settings: GenerationSettings,
                     seed: int) -> list[tuple[str, bool, int]]:
    """One reply per conversation (each ends with a user turn) -> [(text, finished before the limit,
    tokens generated incl. the end-of-turn token)]."""
    tok, model = target.tokenizer, target.model
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
    side, tok.padding_side = tok.padding_side, "left"
    try:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    finally:
        tok.padding_side = side
    stop_ids = sorted({tok.convert_tokens_to_ids(m) for m in end_of_turn_markers(tok)} - {None, tok.unk_token_id})
    sampling = dict(do_sample=True, temperature=settings.temperature, top_p=settings.top_p) \
        if settings.temperature > 0 else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(**enc, max_new_tokens=settings.max_new_tokens, eos_token_id=stop_ids,
                             pad_token_id=tok.pad_token_id, **sampling)
    new = out[:, enc["input_ids"].shape[1]:]  # [B, <=max_new_tokens]
    is_stop = torch.isin(new, torch.tensor(stop_ids, device=new.device))  # [B, n]
    finished = is_stop.any(1)  # [B]
    lengths = torch.where(finished, is_stop.int().argmax(1) + 1, new.shape[1])  # [B]
    replies = tok.batch_decode(new, skip_special_tokens=True)
    return [(r.strip(), bool(f), int(n)) for r, f, n in zip(replies, finished.tolist(), lengths.tolist())]


def regenerate(rows: list[dict], target, out_path: Path, settings: GenerationSettings,
               progress: bool = True) -> dict:
    """Answer every user turn of `rows` (from prompt_rows) with the target; append finished conversations
    to out_path. Returns counts: {"written", "resumed", "unfinished_turns", "generated_tokens"}."""
    from tqdm.auto import tqdm

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _drop_torn_tail(out_path)
    done = done_ids(out_path)
    todo = sorted((r for r in rows if r["id"] not in done), key=lambda r: len(r["turns"][-1]["content"]))
    provenance = {"target": target.spec.name, "target_path": target.spec.path, "regen_version": REGEN_VERSION,
                  **{k: v for k, v in asdict(settings).items() if k != "batch_size"}}
    stats = {"written": 0, "resumed": len(rows) - len(todo), "unfinished_turns": 0, "generated_tokens": 0}
    bar = tqdm(total=len(rows), initial=stats["resumed"], desc="regenerating", unit="conv", disable=not progress)
    with open(out_path, "a") as sink:
        for start in range(0, len(todo), settings.batch_size):
            chunk = todo[start:start + settings.batch_size]
            seed = settings.seed * 1_000_003 + zlib.crc32("|".join(r["id"] for r in chunk).encode())
            for row, (messages, finished, n_tokens) in zip(chunk, _replay(target, chunk, settings, seed)):
                stats["unfinished_turns"] += finished.count(False)
                stats["generated_tokens"] += n_tokens
                sink.write(json.dumps(_output_row(row, messages, finished, provenance), ensure_ascii=False) + "\n")
                stats["written"] += 1
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(len(chunk))
    bar.close()
    return stats


def _replay(target, chunk: list[dict], settings: GenerationSettings, seed: int):
    """Round r answers the r-th user turn of every conversation that has one, given earlier answers."""
    history = [[] for _ in chunk]
    finished = [[] for _ in chunk]
    n_tokens = [0 for _ in chunk]
    pending = [list(r["turns"]) for r in chunk]
    for rnd in range(max(sum(m["role"] == "user" for m in r["turns"]) for r in chunk)):
        active = []
        for i, turns in enumerate(pending):
            while turns and turns[0]["role"] != "user":  # leading system prompt
                history[i].append(turns.pop(0))
            if turns:
                history[i].append(turns.pop(0))
                active.append(i)
        replies = generate_replies(target, [history[i] for i in active], settings, seed + rnd)
        for i, (text, done, n) in zip(active, replies):
            history[i].append({"role": "assistant", "content": text})
            finished[i].append(done)
            n_tokens[i] += n
    return list(zip(history, finished, n_tokens))


def _output_row(row: dict, messages: list[dict], finished: list[bool], provenance: dict) -> dict:
    first_user = next(m["content"] for m in messages if m["role"] == "user")
    return {"id": row["id"], "category": row["category"], "prompt": first_user,
            "response": messages[-1]["content"], "messages": messages, "finished": all(finished),
            "provenance": provenance}
