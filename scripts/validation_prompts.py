"""A run's own validation prompts as an evaluation prompt set: the first user turn of each conversation the run
held out (the same split its validation scored), written as {id, category, prompt} JSONL for
`python -m headway.infer.evaluate prompts=FILE`.

    python scripts/validation_prompts.py RUN RUN/validation_prompts.jsonl --max 48
    python -m headway.infer.evaluate checkpoint=RUN/final prompts=RUN/validation_prompts.jsonl max_prompts=48 ...

Held out from training but drawn like it, these prompts separate what a head has learnt from how far a prompt set
lies from its data: a head that scores much higher here than on `chat` is limited by its prompts, not its size or
its steps. RUN is a training run folder (its .hydra/config.yaml names the data, the split seed and max_length).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench_common as bc

MARK = "\x00PROMPT\x00"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="a training run folder (with .hydra/config.yaml)")
    p.add_argument("out", type=Path, help="the JSONL file to write")
    p.add_argument("--max", type=int, default=None, help="at most this many prompts (default: all)")
    args = p.parse_args(argv)
    if not (args.run / ".hydra" / "config.yaml").is_file():
        bc.bad_input(f"{args.run} has no .hydra/config.yaml: pass the folder a training run wrote")
    if args.max is not None and args.max < 1:
        bc.bad_input(f"--max {args.max} must be at least 1")
    return args


def user_turn(tokenizer, input_ids: list[int], loss_mask: list[bool], head: str, tail: str) -> str | None:
    """The first user message of a tokenised conversation: the text before its first learnt (assistant) token,
    less the chat template's text around a user message; None where the template's framing does not match."""
    first = next((i for i, learnt in enumerate(loss_mask) if learnt), len(input_ids))
    text = tokenizer.decode(input_ids[:first])
    if not (text.startswith(head) and text.endswith(tail)) or len(text) <= len(head) + len(tail):
        return None
    return text[len(head):len(text) - len(tail)].strip() or None


def main(argv=None) -> None:
    args = parse_args(argv)
    from omegaconf import OmegaConf

    from headway.heads.files import write_text_atomic
    from headway.heads.target import TargetError, load_target
    from headway.train.data.build import build_datasets
    from headway.train.data.config import DataError

    cfg = OmegaConf.load(args.run / ".hydra" / "config.yaml")
    try:
        tokenizer = load_target(OmegaConf.to_container(cfg.target, resolve=True)).tokenizer
        _, val = build_datasets(cfg.data, tokenizer, cfg.train.max_length, seed=cfg.train.seed)
    except (TargetError, DataError) as exc:
        bc.bad_input(f"cannot rebuild the validation split of {args.run}: {exc}")
    framed = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                           add_generation_prompt=True)
    head, tail = framed.split(MARK)
    rows = []
    for i, item in enumerate(val):
        prompt = user_turn(tokenizer, item["input_ids"], item["loss_mask"], head, tail)
        if prompt is not None:
            rows.append({"id": f"validation-{i}", "category": "validation", "prompt": prompt})
    rows = rows[:args.max]
    if not rows:
        bc.bad_input(f"no validation conversation of {args.run} starts with a user turn this template frames")
    try:
        write_text_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    except OSError as exc:
        bc.bad_input(f"cannot write {args.out}: {exc.strerror or exc}")
    print(f"{len(rows)} of {len(val)} validation conversations -> {args.out}")


if __name__ == "__main__":
    main()
