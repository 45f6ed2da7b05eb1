"""Self-distillation: rewrite every assistant turn of a conversation set with the frozen target itself.

Conversations are processed in batches (train.data.decode: one left-padded prefill, then batched decoding
through the KV cache, finished rows leaving the batch); greedy and sampled rows (a fixed share, by id) go in
separate batches and each output row says which it got ("sampled"). A multi-turn conversation is replayed
round by round, each user turn answered by the target given its own earlier answers. Finished
conversations are appended to the output JSONL a batch at a time (flushed and fsynced), so a killed run
keeps them and the next run continues with the rest. With a capture (train.data.capture) the hidden
states of each conversation go into the hidden-state cache in the same pass.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from headway.heads.files import write_text_atomic
from headway.train.data.config import DataError
from headway.train.data.conversations import BadRow, end_of_turn_markers, normalize

log = logging.getLogger(__name__)
REGEN_VERSION = 1


@dataclass
class GenerationSettings:
    max_new_tokens: int = 160
    temperature: float = 0.0  # 0 = every reply greedy
    top_p: float = 1.0
    sampled_fraction: float = 1.0  # with temperature > 0: this share of the rows (by id) sampled, the rest greedy
    batch_size: int = 16
    seed: int = 0
    backend: str = "hf"  # hf (transformers, in this process) | vllm (its offline engine) | auto (vLLM where installed)
    vllm_python: Optional[str] = None  # backend=vllm: a python that has vLLM (null: this one)
    weight_layout: str = "auto"  # backend=hf: the target's weight layout while it generates (heads/kernels/)
    precision: str = "fp32"  # backend=hf: fp32 | bf16 (a bf16 copy of the target generates: faster, other text) | auto


# settings that change speed, not the rows written (a weight layout only changes the order of fp32 sums)
HOW_NOT_WHAT = ("batch_size", "backend", "vllm_python", "weight_layout")


def content_settings(settings) -> dict:
    """The settings that change the rows written (they key a dataset); fp32 precision, the default, is left
    out so that keys from before the option existed still name the same data."""
    out = {k: v for k, v in asdict(settings).items() if k not in HOW_NOT_WHAT}
    if out.get("precision") == "fp32":
        del out["precision"]
    return out


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
                    "source": row.get("source") or "", "turns": turns})
    return out, skipped


def done_ids(path: Path) -> set[str]:
    """Ids already written; a torn last line (killed mid-write) is ignored and rewritten."""
    ids = set()
    if path.is_file():
        for line in path.read_text().split("\n"):
            try:
                ids.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


class JsonlSink:
    """Append-only JSONL of rows with an "id", written a batch at a time (flushed and fsynced), so a killed
    run keeps every complete batch and the next run continues with the rest. A full disk or a read-only
    folder is a DataError."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
                text = self.path.read_text()  # a torn last line: drop it, it is written again
                write_text_atomic(self.path, text[: text.rfind("\n") + 1])
            self.file = open(self.path, "a")
        except OSError as exc:
            raise unwritable(self.path, exc) from None
        self.done = done_ids(self.path)

    def write(self, rows: list[dict]) -> None:
        try:
            self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as exc:
            raise unwritable(self.path, exc) from None
        self.done.update(r["id"] for r in rows)

    def close(self) -> None:
        self.file.close()


def unwritable(path: Path, exc: OSError) -> DataError:
    return DataError(f"cannot write {path}: {exc.strerror or exc}; free some space or point HEADWAY_CACHE "
                     f"(or the output path) at a writable folder, then run again (it resumes)")


class ProgressBar:
    """Conversations done, with generated tokens/s and the ETA."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="conv", disable=not enabled)
        self.tokens, self.started = 0, time.perf_counter()

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.set_postfix_str(f"{self.tokens / (time.perf_counter() - self.started):.0f} tok/s", refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()


def stop_token_ids(tokenizer) -> list[int]:
    return sorted({tokenizer.convert_tokens_to_ids(m) for m in end_of_turn_markers(tokenizer)}
                  - {None, tokenizer.unk_token_id})


def is_sampled(row_id: str, settings: GenerationSettings) -> bool:
    """Whether a row's replies are sampled (else greedy): a fixed share of the rows, chosen by id."""
    return settings.temperature > 0 and zlib.crc32(row_id.encode()) % 10_000 < settings.sampled_fraction * 10_000


@torch.no_grad()
def generate_replies(target, conversations: list[list[dict]], settings: GenerationSettings, seed: int,
                     sampled: bool = True, tap=None, decoder=None) -> list[tuple[str, bool, int]]:
    """One reply per conversation (each ends with a user turn) -> [(text, finished before the limit,
    tokens generated incl. the end-of-turn token)]; greedy unless `sampled` and temperature > 0.
    decoder: a train.data.vllm_decode.VllmDecoder (no tap), else the target decodes here."""
    from headway.train.data.decode import decode_with

    tok = target.tokenizer
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in conversations]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    temperature = settings.temperature if sampled else 0.0
    out = decode_with(target, prompts, settings.max_new_tokens, stop_token_ids(tok), temperature, settings.top_p,
                      seed, tap, decoder)
    replies = tok.batch_decode(out.tokens, skip_special_tokens=True)
    return [(r.strip(), f, len(t)) for r, f, t in zip(replies, out.finished, out.tokens)]


def batches(rows: list[dict], settings: GenerationSettings) -> list[tuple[list[dict], bool]]:
    """Greedy and sampled rows in separate batches, each of similar prompt lengths (little padding)."""
    out = []
    for sampled in (False, True):
        group = sorted((r for r in rows if is_sampled(r["id"], settings) == sampled),
                       key=lambda r: sum(len(m["content"]) for m in r["turns"]))
        out += [(group[i:i + settings.batch_size], sampled) for i in range(0, len(group), settings.batch_size)]
    return out


def regenerate(rows: list[dict], target, out_path: Path, settings: GenerationSettings,
               progress: bool = True, capture=None, decoder=None) -> dict:
    """Answer every user turn of `rows` (from prompt_rows) with the target; append finished conversations
    to out_path. `capture` (train.data.capture.FeatureCapture): store the hidden states of the
    conversations written in that cache too (HF backend only: vLLM does not hand them out). decoder: a
    running VllmDecoder to reuse (else one is started when settings.backend resolves to vllm). Returns
    counts: {"written", "resumed", "unfinished_turns", "generated_tokens", "sampled", "captured", "backend"}."""
    from headway.train.data.decode import generating
    from headway.train.data.vllm_decode import open_decoder

    out_path = Path(out_path)
    sink = JsonlSink(out_path)
    todo = [r for r in rows if r["id"] not in sink.done]
    try:
        with open_decoder(settings, target, todo, decoder) as decoder, \
                generating(target, None if decoder else settings.weight_layout,
                           "fp32" if decoder else settings.precision):
            return _regenerate(rows, todo, target, sink, settings, progress, None if decoder else capture, decoder)
    finally:
        sink.close()


def _regenerate(rows, todo, target, sink, settings, progress, capture, decoder) -> dict:
    from headway.train.data.capture import CaptureSession

    session = CaptureSession(capture, target) if capture else None
    provenance = provenance_of(target, settings, "vllm" if decoder else "hf")
    stats = {"written": 0, "resumed": len(rows) - len(todo), "unfinished_turns": 0, "generated_tokens": 0,
             "sampled": 0, "captured": 0, "backend": "vllm" if decoder else "hf"}
    bar = ProgressBar(len(rows), stats["resumed"], "answering prompts", progress)
    for chunk, sampled in batches(todo, settings):
        seed = settings.seed * 1_000_003 + zlib.crc32("|".join(r["id"] for r in chunk).encode())
        results = _replay(target, chunk, settings, seed, sampled, session, decoder)
        out = []
        for row, (messages, finished, n_tokens) in zip(chunk, results):
            stats["unfinished_turns"] += finished.count(False)
            stats["generated_tokens"] += n_tokens
            out.append(_output_row(row, messages, finished, sampled, provenance))
        if session:
            session.flush()  # the cache entries first: a kill between the two only costs recomputing them
        sink.write(out)
        stats["written"] += len(out)
        stats["sampled"] += len(out) if sampled else 0
        bar.update(len(chunk), sum(n for *_, n in results))
    bar.close()
    stats["captured"] = session.captured if session else 0
    return stats


def provenance_of(target, settings: GenerationSettings, backend: str) -> dict:
    """What every written row records of how it was answered."""
    return {"target": target.spec.name, "target_path": target.spec.path, "regen_version": REGEN_VERSION,
            **content_settings(settings), "backend": backend}


def _replay(target, chunk: list[dict], settings: GenerationSettings, seed: int, sampled: bool, session, decoder):
    """Round r answers the r-th user turn of every conversation that has one, given earlier answers; the
    last round of each conversation is captured when a session is given."""
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
        convs = [history[i] for i in active]
        tap = session.tap([list(h) if not pending[i] else None for i, h in zip(active, convs)]) if session else None
        replies = generate_replies(target, convs, settings, seed + rnd, sampled, tap, decoder)
        for i, (text, done, n) in zip(active, replies):
            history[i].append({"role": "assistant", "content": text})
            finished[i].append(done)
            n_tokens[i] += n
    return list(zip(history, finished, n_tokens))


def _output_row(row: dict, messages: list[dict], finished: list[bool], sampled: bool, provenance: dict) -> dict:
    first_user = next(m["content"] for m in messages if m["role"] == "user")
    return {"id": row["id"], "category": row["category"], "prompt": first_user,
            "response": messages[-1]["content"], "messages": messages, "finished": all(finished),
            "sampled": sampled, "source": row.get("source", ""), "provenance": provenance}
