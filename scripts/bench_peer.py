"""headway's EAGLE-3 against a peer trainer (speculators 0.9.0), at equal data, steps and draft vocabulary.

    python scripts/bench_peer.py --out runs/peer --seeds 0 1 2
    python scripts/bench_peer.py --out runs/peer-quick --quick          # tiny random target, end to end

Per seed: headway trains `train/main.py head=eagle3` (its own recipe; `--headway-overrides` pass through);
the peer trains `python -m speculators.train --speculator-type eagle3` (its defaults) on the same training
split (headway's split of its data, the same for every seed: `--split-seed`), the same step budget, max length and draft
vocabulary (headway's d2t/t2d given to the peer). The peer runs in its own virtualenv (created when
missing) with device plumbing only (scripts/peer/speculators_cpu.py). The judge is vLLM serving the
target with each draft (scripts/peer/vllm_judge.py, vLLM's own venv). Prints mean acceptance length per
trainer (mean and min-max over seeds) and, last, the ratio headway / peer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from bench_common import REPO, print_table
from serve_check import VENVS, SetupError, ensure_venv, save_smollm2_target

from headway.heads.target import cache_root

PEER_DIR = REPO / "scripts" / "peer"
SMOLLM2 = {"path": "embedded:smollm2", "name": "smollm2-135m"}
# tiny random Llama with head_dim 32 (hidden 64 / 2 heads): a size vLLM's CPU attention accepts
TINY = {"path": "tiny-random", "name": "tiny-random", "tiny": {"num_attention_heads": 2, "num_key_value_heads": 1}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--split-seed", type=int, default=0, help="the train/validation split every seed trains on (seeds "
                   "then differ in initialisation and data order only; the peer's data is extracted once)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4, help="headway sequences per step (the peer packs the "
                   "same number of tokens per step on average)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--per-category", type=int, default=5, help="chat prompts judged per category")
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per prompt")
    p.add_argument("--data", type=Path, help="a conversations file (messages or ShareGPT rows) both trainers "
                   "learn from instead of the embedded default set (data=default)")
    p.add_argument("--headway-overrides", nargs="*", default=[], help="extra train/main.py overrides")
    p.add_argument("--venvs", type=Path, default=cache_root() / "venvs",
                   help="the peers' virtualenvs (speculators, vLLM), created when missing (as serve_check.py does)")
    p.add_argument("--quick", action="store_true", help="smoke mode: tiny random target, few steps and prompts")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.max_length, args.per_category, args.tokens = 4, 128, 1, 16
    return args


def run(cmd: list, log: Path, env: dict | None = None) -> None:
    """Run a command with output to `log`; one error line naming the log when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        done = subprocess.run([str(c) for c in cmd], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})})
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(map(str, cmd[:4]))} ... failed (exit {done.returncode}); see {log}")


# ------------------------------------------------------------------------------------------ set-up

def target_spec(args) -> dict:
    return TINY if args.quick else SMOLLM2


def save_target_folder(args) -> Path:
    """The target as an HF folder (fp32) that the peer and vLLM load (SmolLM2 through serve_check's
    builder: a GGUF-loaded model cannot be saved as it is)."""
    folder = args.out / "target"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        save_smollm2_target(folder)
        return folder
    from headway.heads.target import load_target

    target = load_target(dict(target_spec(args), dtype="float32"))
    tmp = folder.with_name("target.tmp")
    target.model.save_pretrained(tmp)
    target.tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def headway_target_overrides(args) -> list[str]:
    data = ["data=local", f"data.source={args.data.resolve()}", "data.format=messages",
            "data.hidden_states=offline"] if args.data else []
    if args.quick:
        # a draft vocabulary smaller than the target's (259): with equal sizes vLLM builds no d2t to load
        return ["target=tiny-random", "'+target.tiny={num_attention_heads:2,num_key_value_heads:1}'",
                "head.options.draft_vocab_size=128", *(data or ["data=tiny"])]
    return data


# -------------------------------------------------------------------------------------- headway

def train_headway(args, seed: int) -> Path:
    run_dir = (args.out / f"headway-seed{seed}").resolve()
    if not (run_dir / "final" / "config.json").is_file():
        cmd = [sys.executable, "train/main.py", "head=eagle3", *headway_target_overrides(args),
               f"train.max_steps={args.steps}", f"train.batch_size={args.batch_size}",
               f"train.max_length={args.max_length}", f"train.seed={seed}", f"+data.split_seed={args.split_seed}",
               "train.eval_every=1000000",
               f"hydra.run.dir={run_dir}", "resume=latest", *args.headway_overrides]
        run(["bash", "-c", " ".join(map(str, cmd))], run_dir / "train.log")
    return run_dir / "final"


def export_headway(final: Path) -> Path:
    out = final.parent.with_name(final.parent.name + "-eagle3")  # beside the run: exports never go inside it
    if not (out / "config.json").is_file():
        run([sys.executable, "scripts/export.py", f"checkpoint={final}", "format=eagle3", f"output={out}"],
            final.parent / "export.log")
    return out


# ------------------------------------------------------------------------------------------ peer

def peer_data(args, target_dir: Path, head: Path) -> tuple[Path, dict]:
    """headway's own split (`--split-seed`) in the layout speculators' trainer reads: a `datasets` folder of
    (input_ids, loss_mask, seq_len), train rows then validation rows, hidden states in
    hidden_states/hs_<row>.safetensors ({token_ids [T], hidden_states [T, A+1, h]}: headway's A auxiliary layers,
    then the last layer's output before the final norm), and headway's d2t/t2d as .npy."""
    folder = args.out / f"peer-data-split{args.split_seed}"
    info_path = folder / "bench_info.json"
    if info_path.is_file():
        return folder, json.loads(info_path.read_text())
    import numpy as np
    import torch
    from datasets import concatenate_datasets
    from omegaconf import OmegaConf
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from headway.heads.eagle3 import default_aux_layers
    from headway.train.data import build_datasets

    cfg = OmegaConf.load(REPO / "conf" / "data" / ("tiny.yaml" if args.quick else "default.yaml"))
    if args.data:  # the same rows and split as headway's data=local run
        cfg = OmegaConf.merge(OmegaConf.load(REPO / "conf" / "data" / "local.yaml"),
                              {"source": str(args.data.resolve()), "format": "messages"})
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    train_ds, val_ds = build_datasets(cfg, tokenizer, args.max_length, args.split_seed)
    rows = concatenate_datasets([train_ds, val_ds]).select_columns(["input_ids", "loss_mask"])
    rows = rows.map(lambda r: {"seq_len": len(r["input_ids"])})
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    aux = default_aux_layers(model.config.num_hidden_layers)  # inputs of these decoder layers, as headway's head
    tmp = folder.with_name(folder.name + ".tmp")
    rows.with_format("torch").save_to_disk(str(tmp / "data"))
    (tmp / "data" / "hidden_states").mkdir()  # where speculators' file backend looks: <data-path>/hidden_states
    last = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: last.update(h=o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        for i, ids in enumerate(rows["input_ids"]):
            x = torch.tensor([ids])  # [1, T]
            hs = model(x, output_hidden_states=True).hidden_states
            stacked = torch.stack([hs[a][0] for a in aux] + [last["h"].reshape(len(ids), -1)], dim=1)  # [T, A+1, h]
            save_file({"token_ids": x[0], "hidden_states": stacked.contiguous()},
                      str(tmp / "data" / "hidden_states" / f"hs_{i}.safetensors"))
    hook.remove()
    weights = load_file(str(head / "model.safetensors"))
    np.save(tmp / "d2t.npy", weights["d2t"].numpy())
    np.save(tmp / "t2d.npy", weights["t2d"].numpy())
    lengths = rows["seq_len"][: len(train_ds)]
    info = {"aux_layers": aux, "train_rows": len(train_ds), "val_rows": len(val_ds), "train_tokens": sum(lengths),
            "draft_vocab": int(weights["d2t"].numel())}
    (tmp / "bench_info.json").write_text(json.dumps(info))
    os.replace(tmp, folder)
    return folder, info


def train_peer(args, python: Path, seed: int, target_dir: Path, data: Path, info: dict) -> Path:
    save = (args.out / f"peer-seed{seed}").resolve()
    done = sorted((d for d in save.glob("[0-9]*") if (d / "model.safetensors").is_file()), key=lambda d: int(d.name))
    if done:
        return done[-1]
    mean_len = info["train_tokens"] / info["train_rows"]
    # the peer packs rows into a token budget per step: headway's average tokens per step, never below one row
    tokens_per_step = max(args.max_length, round(args.batch_size * mean_len))
    epochs = math.ceil(args.steps * tokens_per_step / info["train_tokens"]) + 1  # enough; --max-steps stops it
    ratio = info["train_rows"] / (info["train_rows"] + info["val_rows"])
    cmd = [python, PEER_DIR / "speculators_cpu.py", "--speculator-type", "eagle3",
           "--verifier-name-or-path", target_dir.resolve(), "--data-path", (data / "data").resolve(),
           "--d2t-path", (data / "d2t.npy").resolve(), "--t2d-path", (data / "t2d.npy").resolve(),
           "--target-layer-ids", *info["aux_layers"], "--draft-vocab-size", info["draft_vocab"], "--total-seq-len", tokens_per_step,
           "--train-data-ratio", f"{ratio + 0.5 / (info['train_rows'] + info['val_rows']):.9f}",
           "--hidden-states-dtype", "float32", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
           "--num-workers", "0", "--on-missing", "raise", "--epochs", epochs, "--max-steps", args.steps,
           "--seed", seed, "--save-path", save]
    run(cmd, save.with_suffix(".log"))
    return train_peer(args, python, seed, target_dir, data, info)


# ----------------------------------------------------------------------------------------- judge

def judge_prompts(args) -> list[str]:
    from headway.infer.prompt_sets import load_prompt_set

    taken, per = [], {}
    for row in load_prompt_set("chat"):
        if per.get(row["category"], 0) < args.per_category:
            per[row["category"]] = per.get(row["category"], 0) + 1
            taken.append(row["prompt"])
    return taken


def judge(args, target_dir: Path, draft: Path, name: str) -> dict:
    out = args.out / "judge" / f"{name}.json"
    if not out.is_file():
        prompts = args.out / "judge" / "prompts.json"
        prompts.parent.mkdir(parents=True, exist_ok=True)
        texts = judge_prompts(args)
        prompts.write_text(json.dumps(texts))
        # the same prompts for headway's own evaluator (a 3-draft chain there scores what vLLM scores)
        prompts.with_suffix(".jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        run([args.vllm_python, PEER_DIR / "vllm_judge.py", target_dir.resolve(), draft.resolve(),
             prompts.resolve(), out.resolve(), "--tokens", args.tokens], out.with_suffix(".log"),
            env={"VLLM_TARGET_DEVICE": "cpu"})
    return json.loads(out.read_text())


def summary(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.data and not args.data.is_file():
        sys.exit(f"error: --data {args.data}: no such file; give a conversations file (messages or ShareGPT rows)")
    args.out.mkdir(parents=True, exist_ok=True)
    try:  # the same recipes as serve_check.py: CPU torch first, vLLM without torchvision
        python = ensure_venv(args.venvs, VENVS["speculators"], print)
        args.vllm_python = ensure_venv(args.venvs, VENVS["vllm"], print)
    except SetupError as exc:
        sys.exit(f"error: {exc}")
    target_dir = save_target_folder(args)
    scores = {"headway": [], "speculators": []}
    rows = []
    for seed in args.seeds:
        final = train_headway(args, seed)
        data, info = peer_data(args, target_dir, final)
        peer = train_peer(args, python, seed, target_dir, data, info)
        for name, draft in (("headway", export_headway(final)), ("speculators", peer)):
            result = judge(args, target_dir, draft, f"{name}-seed{seed}")
            scores[name].append(result["mean_acceptance_length"])
            rows.append({"trainer": name, "seed": seed, "mean acc. length": result["mean_acceptance_length"],
                         **{f"pos {i + 1}": a for i, a in enumerate(result["acceptance_by_position"])}})
    print_table(rows, title=f"vLLM judge: {len(judge_prompts(args))} chat prompts, {args.tokens} tokens, "
                            f"3 speculative tokens, greedy; {args.steps} steps, seeds {args.seeds}")
    for name, values in scores.items():
        s = summary(values)
        print(f"{name}: mean acceptance length {s['mean']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}, "
              f"{len(values)} seeds)")
    print(f"{sum(scores['headway']) / sum(scores['speculators']):.3f}x")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
