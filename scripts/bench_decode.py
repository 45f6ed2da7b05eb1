"""End-to-end generation on the default target, batch 1: what a user would otherwise run vs headway.

Methods, interleaved prompt by prompt so machine noise hits all alike (each warmed up once first):
  hf_generate             transformers generate()
  hf_prompt_lookup        transformers generate(prompt_lookup_num_tokens=...)
  headway_plain           the engine's plain decoding (weights in --weight-layout, default auto: the wide
                          Linear weights column-major on a CPU, see heads/kernels/weight_layout.py)
  headway_plain_stock     the same with the weights as loaded (shows what the layout alone buys)
  headway_prompt_lookup   the engine with the n-gram drafter
  headway_<kind>          the engine with each trained head given (paths that do not exist are skipped)
at temperature 0 and 1, reporting tokens/s, tau, the ratio to HF generate() and, at temperature 0,
whether every output equals the engine's plain decoding.

    python scripts/bench_decode.py --heads runs/eagle/final runs/medusa/final runs/eagle3/final runs/mtp/final
    python scripts/bench_decode.py --all-prompts            # every held-out prompt (slow on a CPU)
    python scripts/bench_decode.py --device cuda --dtype bf16
    python scripts/bench_decode.py --quick                  # tiny random target (smoke test)
    python scripts/bench_decode.py --heads runs/eagle/final --tree policy=dynamic total_tokens=8 depth=3 top_k=3
    python scripts/bench_decode.py --heads runs/eagle3/final --validation-plan --temperatures 0

Heads draft with the engine's default (the `auto` policy: a tree planned from the head's measured
acceptance, this machine's T(N), re-measured at the start of the run, and the draft cost; no tree at all
when drafting cannot pay) unless --tree gives build_drafter options. The auto tree of each head engine
re-plans from what the run's earlier calls measured (the draft cost and the acceptance of its drafts, the warm-up
included); --validation-plan adds each head again with a tree that keeps planning from the head's validation
acceptance (`learn=False`) and makes the last line the first head's tokens/s with the learned plan over that.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import bench_common as bc
import torch

from headway.infer.calibrate import calibrate_latency
from headway.infer.engine import Engine, GenerationStats
from headway.infer.evaluate import step_line
from headway.infer.hf_generate import generation_config, hf_generate
from headway.heads.kernels.weight_layout import LAYOUTS, apply_layout


FIXED = ("hf_generate", "hf_prompt_lookup", "headway_plain", "headway_plain_stock", "headway_prompt_lookup")  # not trained heads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="a conf/target preset, or an HF model dir or hub name")
    p.add_argument("--heads", nargs="*", default=[], help="head folders (a run's final/); missing ones are skipped")
    p.add_argument("--prompt-sets", nargs="+", default=["chat", "humaneval"])
    p.add_argument("--per-set", type=int, default=4, help="prompts per set (default: a subset, for time)")
    p.add_argument("--all-prompts", action="store_true", help="every prompt of every set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, help="HF prompt_lookup_num_tokens")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto = fp32 on CPU, bf16 on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", nargs="*", default=[], metavar="KEY=VALUE",
                   help="drafter options for the heads (infer.drafters.build_drafter), e.g. policy=dynamic top_k=3")
    p.add_argument("--weight-layout", default="auto", choices=LAYOUTS, help="the engines' weight layout")
    p.add_argument("--stop-unpaid-drafting", default="sampling", choices=["sampling", "always", "never"],
                   help="the engines' guard (infer/payoff.py): when to stop drafting that does not pay")
    p.add_argument("--validation-plan", action="store_true",
                   help="also run each head with an auto tree planned from its validation acceptance only")
    p.add_argument("--quick", action="store_true", help="tiny random target, 2 prompts, 8 tokens (smoke test)")
    args = p.parse_args(argv)
    if args.validation_plan and tree_options(args.tree).get("policy", "auto") != "auto":
        bc.bad_input("--validation-plan compares plans of the auto tree: drop policy= from --tree")
    if args.quick:
        args.target, args.per_set, args.max_new_tokens = "tiny-random", 1, 8
    if args.all_prompts:
        args.per_set = None
    bc.check_device(args.device)
    return args


def build_methods(args, target) -> dict:
    """name -> callable(ids, temperature, seed) -> (tokens, seconds, stats or None)."""
    from headway.heads.base import HeadError, load_head
    from headway.heads.target import TargetError
    from headway.infer.drafters import build_drafter

    eos = Engine(target, weight_layout=args.weight_layout).eos.tolist()  # layout resolved in main
    pad = target.tokenizer.pad_token_id

    def hf(lookup):
        def run(ids, temperature, seed):
            cfg = generation_config(eos, pad, args.max_new_tokens, temperature, prompt_lookup_num_tokens=lookup)
            res = hf_generate(target.model, [ids], cfg, seed=seed)
            return res.tokens[0], res.seconds, None
        return run

    def engine(drafter, layout=args.weight_layout):
        eng = Engine(target, drafter, weight_layout=layout, stop_unpaid_drafting=args.stop_unpaid_drafting)

        def run(ids, temperature, seed):
            out = eng.generate([ids], max_new_tokens=args.max_new_tokens, temperature=temperature, seed=seed)
            return out.tokens[0], out.stats.prefill_s + out.stats.decode_s, out.stats
        if drafter is not None:
            run.describe = drafter.describe
        return run

    methods = {"hf_generate": hf(None), "hf_prompt_lookup": hf(args.prompt_lookup_tokens),
               "headway_plain": engine(None)}
    if args.weight_layout != "stock":  # otherwise the same as headway_plain
        methods["headway_plain_stock"] = engine(None, "stock")
    methods["headway_prompt_lookup"] = engine(build_drafter("prompt_lookup", target))
    for path in args.heads:
        if not Path(path, "config.json").is_file():
            print(f"skipping head {path}: no such head folder")
            continue
        try:
            head = load_head(path, target, device=args.device)
        except (HeadError, TargetError) as exc:
            print(f"skipping head {path}: {exc}")
            continue
        name = f"headway_{head.kind}"
        name = name if name not in methods else f"{name}({Path(path).parent.name})"
        methods[name] = engine(build_drafter("head", target, head=head, **tree_options(args.tree)))
        if args.validation_plan:  # the same head, its tree never told what this run accepts
            again = load_head(path, target, device=args.device)
            methods[f"{name}:validation_plan"] = engine(
                build_drafter("head", target, head=again, **tree_options(args.tree), learn=False))
    return methods


def tree_options(pairs: list[str]) -> dict:
    """["policy=dynamic", "top_k=3", "draft_vocab=none"] -> {"policy": "dynamic", "top_k": 3, "draft_vocab": None}"""
    def value(v: str):
        if v.lower() in ("none", "null"):
            return None
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v
    return {k: value(v) for k, v in (p.split("=", 1) for p in pairs)}


def measure(args, methods, prompts, temperature) -> list[dict]:
    ids0 = prompts[0][1]
    for name, run in methods.items():  # warm-up: one-off setup stays out of the timings
        run(ids0, temperature, args.seed)
        plan = getattr(run, "describe", None)
        if plan is not None:
            print(f"{name}: {plan()}")
    tokens = {m: 0 for m in methods}
    seconds = {m: 0.0 for m in methods}
    same, stopped = {m: 0 for m in methods}, {m: 0 for m in methods}
    summed = {m: GenerationStats() for m in methods}  # each engine's calls summed: tau and where its steps' time went
    for i, (_, ids) in enumerate(prompts):
        outs = {}
        for name, run in methods.items():
            outs[name], sec, stats = run(ids, temperature, args.seed + i)
            tokens[name] += len(outs[name])
            seconds[name] += sec
            if stats is not None:
                stopped[name] += stats.drafting_stopped_at is not None
                summed[name].add(stats)
        for name, out in outs.items():
            same[name] += int(out == outs["headway_plain"])
    for name, run in methods.items():
        plan = getattr(run, "describe", None)
        if plan is not None and "nodes" in plan():  # an auto tree: the plan its last call drafted with
            print(f"{name} (last call): {plan()}")
    hf_tps = tokens["hf_generate"] / seconds["hf_generate"]
    rows = []
    for name in methods:
        tps = tokens[name] / seconds[name]
        rows.append({"temperature": temperature, "method": name, "tokens": tokens[name], "tokens/s": tps,
                     "tau": summed[name].tau if summed[name].row_steps else None,
                     "vs hf_generate": tps / hf_tps,
                     "same as plain": f"{same[name]}/{len(prompts)}" if temperature == 0 else None,
                     "drafting stopped": f"{stopped[name]}/{len(prompts)}" if summed[name].row_steps else None})
    plain_ms = summed["headway_plain"].step_ms()["plain"]
    for name, total in summed.items():
        ms = total.step_ms()
        if ms["speculative"] is not None:  # compared with the plain engine's step in this run
            print(f"temperature {temperature:g}, {name}: " + step_line(dict(ms, plain=plain_ms)))
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    target = bc.load_bench_target(args.target, args.device, args.dtype)
    prompts = bc.bench_prompts(target.tokenizer, args.prompt_sets, args.per_set)
    args.weight_layout = apply_layout(target.model, args.weight_layout, target)  # auto -> measured; T(N) depends on it
    curve = calibrate_latency(target)  # this run's T(N): the engines plan their trees from it
    t1 = curve[min(curve)]
    print("target step latency T(N)/T(1), measured now: " +
          "  ".join(f"N={n}: {t / t1:.2f}" for n, t in sorted(curve.items())))
    methods = build_methods(args, target)
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    print(f"machine: {bc.machine()}; target {target.spec.name} {dtype} on {args.device}, batch 1, "
          f"{len(prompts)} prompts ({', '.join(args.prompt_sets)}), {args.max_new_tokens} new tokens")
    rows = []
    for temperature in args.temperatures:
        rows += measure(args, methods, prompts, temperature)
    bc.print_table(rows, "\n(tau: tokens per target forward; same as plain: greedy outputs equal to the "
                         "engine's plain decoding; drafting stopped: prompts on which the engine stopped drafting "
                         "because it did not pay, infer/payoff.py)")
    for temperature in args.temperatures:
        at = {r["method"]: r["vs hf_generate"] for r in rows if r["temperature"] == temperature}
        heads = {m: v for m, v in at.items() if m not in FIXED}
        best = f"best head ({max(heads, key=heads.get)}) {max(heads.values()):.2f}x" if heads else "no trained heads"
        print(f"temperature {temperature:g}: headway plain {at['headway_plain']:.2f}x HF generate(); {best}")
    first = args.temperatures[0]
    at = {r["method"]: r["vs hf_generate"] for r in rows if r["temperature"] == first}
    fixed = [m for m in at if m.endswith(":validation_plan")]
    if fixed:
        learned = fixed[0].removesuffix(":validation_plan")
        bc.headline(at[learned] / at[fixed[0]], f"{learned}, plan learned in this run vs from its validation "
                                                f"acceptance, tokens/s at temperature {first:g}")
        return
    heads = {m: v for m, v in at.items() if m not in FIXED} or \
        {m: v for m, v in at.items() if m.startswith("headway")}
    best = max(heads, key=heads.get)
    bc.headline(heads[best], f"best headway method ({best}) vs HF generate() at temperature {first:g}")

if __name__ == "__main__":
    main()
