"""Training throughput per head kind: the head's step with the training vocabulary (the defaults: read-out
over the 8,192 most frequent training tokens) against the same step over the whole vocabulary, and (with
--scaling) online vs offline hidden states and peak memory by sequence length.

The default run times, for each head, one training step of the head alone (forward, backward, AdamW step;
the target's features computed once beforehand, as the offline cache serves them) at a batch like the
default job's, for the read-out over the whole vocabulary (the recipe before the training vocabulary:
`train_vocab=null`, EAGLE-3 `draft_vocab_size=32000`) and for the defaults, interleaved so that machine
noise hits both alike. The last line is the default head's (EAGLE's) speed-up.

With --scaling, one training step = the target's features for a batch (online: a no-grad forward of the frozen target;
offline: reading them back from the hidden-state cache, train.data.hidden_cache, built first) + the
head's own part (forward, backward, AdamW step). The two parts are timed apart, so the head's own cost
per token can be checked to grow no worse than linearly with the sequence length.

    python scripts/bench_train.py                                   # SmolLM2-135M, all heads: vocab before/after
    python scripts/bench_train.py --scaling                         # all heads, 256..2048, online vs offline
    python scripts/bench_train.py --scaling --heads eagle3 --lengths 512 2048 --device cuda --dtype bf16
    python scripts/bench_train.py --prompt-share 0.26                # a quarter of each row is prompt (not learnt)
    python scripts/bench_train.py --quick                           # tiny random target (smoke test)
    python scripts/bench_train.py --precision                       # the defaults' step: fp32 vs bf16 autocast
    python scripts/bench_train.py --allocator --prompt-share 0.26   # the defaults' step: freed memory kept vs returned
    python scripts/bench_train.py --attention --prompt-share 0.26   # EAGLE, EAGLE-3: chain attention vs a dense mask
    python scripts/bench_train.py --muon --heads eagle3 --prompt-share 0.26   # optim=muon: orthogonalised in bf16 vs fp32
    ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_train.py --muon --heads eagle3 --prompt-share 0.26   # as on a CPU without bf16
    python scripts/bench_train.py --row-blocks --heads eagle3 --prompt-share 0.26 --head-option draft_vocab_size=16384
    python scripts/bench_train.py --frozen-rows --heads eagle mtp --prompt-share 0.26   # frozen read-out rows cached vs gathered

With --precision, each head's default step (training vocabulary) runs in fp32 and under bf16 autocast
(precision=bf16, what precision=auto picks on a GPU and on a CPU with AMX), interleaved; the last line is
EAGLE's bf16 / fp32 tokens/s.

With --allocator, each head's default step (in the precision the default job picks here) runs in child
processes with glibc's malloc as it comes ("returned": large blocks are mmapped and unmapped on free) and with
heads.kernels.allocator.keep_freed_memory ("kept", what the training job sets), the two alternating three
times (once with --quick); the table adds page faults per step, and the last line is EAGLE's kept / returned tokens/s.

With --attention, the heads that unroll a training-time test (EAGLE, EAGLE-3) take their default step (in the
precision the default job picks here, freed memory kept) with the unroll's attention as chain_attention computes
it (heads.kernels.chain_attention, the default) and as SDPA with the dense chain mask (before), interleaved; the
last line is EAGLE's chain / dense tokens/s.

With --muon, each head's default step (in the precision the default job picks here, freed memory kept) runs with
`optim=muon` (conf/optim/muon.yaml: Muon on the hidden matrices, AdamW on the rest) orthogonalising in bf16
(torch.optim.Muon) and in fp32 (train/muon.py), and with AdamW alone for scale, interleaved; the last line is the
first head's fp32 / bf16 tokens/s. ONEDNN_MAX_CPU_ISA=AVX2 (or AVX512_CORE) makes oneDNN emulate bf16 as on a CPU
without bf16 instructions (the head's step then runs in fp32, as the job's precision=auto picks there).

With --row-blocks, each head's default step (in the precision the default job picks here, freed memory kept) runs
with the distillation loss computed block by block of rows (heads.layers.row_blocks, the default: each pass over
a block of the [n, V] logits in cache) and in one block (each pass over the whole [n, V] tensor, streamed from
memory), interleaved; the last line is EAGLE's (else the first head's) blocks / one block tokens/s. Heads trained with hard
labels (MTP, Medusa with loss=ce) do not use that loss and come out level.

With --frozen-rows, each head's default step (the job's precision, freed memory kept) runs with the training rows
of the frozen read-out (the target's LM head, which EAGLE and MTP train through and every head's target logits come
from) gathered once and kept transposed in the autocast dtype (the default), and gathered, then cast, in every
call (before), interleaved; the last line is EAGLE's cached / gathered tokens/s. Medusa's and EAGLE-3's own
read-outs are trained, not frozen.

--head-option KEY=VALUE (repeatable) changes a head option for every head that has it (e.g. EAGLE-3's
draft_vocab_size=16384).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import bench_common as bc
import torch
from omegaconf import OmegaConf

from headway.heads import layers
from headway.heads.base import build_head, compute_features

ALLOCATOR_MODES = ("returned", "kept")
LINEAR_SLACK = 1.5  # per-token cost may grow this much from the shortest to the longest length


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m", help="a conf/target preset, or an HF model dir or hub name")
    p.add_argument("--heads", nargs="+", default=["medusa", "eagle", "eagle3", "mtp"])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--scaling", action="store_true", help="online vs offline by sequence length")
    p.add_argument("--vocab-batch", type=int, default=4, help="sequences per step for the vocabulary comparison")
    p.add_argument("--vocab-length", type=int, default=256, help="tokens per sequence for the vocabulary comparison")
    p.add_argument("--prompt-share", type=float, default=0.0,
                   help="share of each sequence that is prompt, not learnt (the default dataset: 0.26)")
    p.add_argument("--precision", action="store_true", help="the default head step: fp32 vs bf16 autocast")
    p.add_argument("--allocator", action="store_true", help="the default head step: freed memory kept vs returned")
    p.add_argument("--allocator-child", choices=ALLOCATOR_MODES, help=argparse.SUPPRESS)  # one timed side
    p.add_argument("--attention", action="store_true",
                   help="EAGLE, EAGLE-3 default step: the unroll's chain attention vs SDPA with a dense mask")
    p.add_argument("--muon", action="store_true",
                   help="the default head step with optim=muon: orthogonalised in bf16 (torch) vs fp32")
    p.add_argument("--row-blocks", action="store_true",
                   help="the default head step: the distillation loss block by block of rows vs in one block")
    p.add_argument("--frozen-rows", action="store_true",
                   help="the default head step: the frozen read-out's training rows cached vs gathered per call")
    p.add_argument("--head-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a head option for every head that has it (repeatable), e.g. draft_vocab_size=16384")
    p.add_argument("--quick", action="store_true", help="tiny random target, lengths 32 and 64 (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.target, args.lengths, args.steps, args.vocab_length = "tiny-random", [32, 64], 1, 32
    bc.check_device(args.device)
    return args


# ------------------------------------------------------------------------------------------ memory

class PeakMemory:
    """Peak bytes above the level at entry: CUDA allocator stats, or the process's peak RSS on Linux
    (reset through /proc/self/clear_refs)."""

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = _status_kib("VmHWM") * 1024 - self.base


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- steps

def make_batch(target, length: int, batch: int, device, prompt_share: float = 0.0) -> dict:
    """Random tokens; the first `prompt_share` of each row is prompt (not learnt), the rest reply."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(target.config.vocab_size, (batch, length), generator=g).to(device)
    loss_mask = (torch.arange(length, device=device) >= round(prompt_share * length))[None].expand(batch, -1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask.contiguous()}


HEAD_OPTIONS: dict = {}  # --head-option KEY=VALUE, for every head that has KEY


def head_options(kind: str) -> dict:
    cfg = OmegaConf.load(bc.REPO / "conf" / "head" / f"{kind}.yaml")
    options = OmegaConf.to_container(cfg.options, resolve=True)
    options.update({key: value for key, value in HEAD_OPTIONS.items() if key in options})
    return options


def parse_head_options(pairs: list[str]) -> dict:
    for pair in pairs:
        key, sep, _ = pair.partition("=")
        if not sep or not key:
            sys.exit(f"error: --head-option takes KEY=VALUE (e.g. draft_vocab_size=16384), got {pair!r}")
    return OmegaConf.to_container(OmegaConf.from_dotlist(pairs))  # values typed as on a Hydra command line


WHOLE_VOCAB = {"eagle3": {"draft_vocab_size": 32000}}  # EAGLE-3's read-out is its draft vocabulary


def whole_vocab_options(kind: str) -> dict:
    """The defaults with the read-out trained over the whole vocabulary (before the training vocabulary)."""
    options = head_options(kind)
    options.update(WHOLE_VOCAB.get(kind, {"train_vocab": None} if "train_vocab" in options else {}))
    return options


def time_features(target, batch, layers, args, cache_dir: Path):
    """-> (online s, offline s, online peak bytes, offline peak bytes, features). Offline reads the batch
    back through the training pipeline's hidden-state cache (train.data.hidden_cache), built here first."""
    from datasets import Dataset

    from headway.train.data.hidden_cache import OfflineFeatureSource, build_cache

    def online_fn():
        return compute_features(target.model, batch["input_ids"], batch["attention_mask"], layers)

    online_fn()  # warm-up
    with PeakMemory(args.device) as online_mem:
        online = _timed(online_fn, args)
    rows = Dataset.from_dict({k: batch[k].tolist() for k in ("input_ids", "loss_mask")})
    build_cache(cache_dir, target, [rows], layers, progress=False)
    offline_fn = OfflineFeatureSource(cache_dir, target, layers, validate_samples=0)
    feats = offline_fn(batch)  # warm-up (opens the shard, verifies its checksum)
    with PeakMemory(args.device) as offline_mem:
        offline = _timed(lambda: offline_fn(batch), args)
    shutil.rmtree(cache_dir)
    return online, offline, online_mem.peak, offline_mem.peak, feats


def adamw(head) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)]


def time_head(head, batch, feats, args, autocast: torch.dtype | None = None, optimizers=adamw):
    """-> (seconds per step, peak bytes) for forward + backward + optimizer step of the head alone; `autocast`: the
    forward under torch.autocast to that dtype (mixed precision: the weights and the optimizer stay fp32);
    `optimizers(head)` -> the optimizers stepped (default: AdamW over every trained parameter)."""
    opts = optimizers(head)
    device_type = torch.device(args.device).type

    def step():
        with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = head(batch["input_ids"], batch["loss_mask"], feats).loss
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # warm-up (also allocates the optimizer state)
    with PeakMemory(args.device) as mem:
        seconds = _timed(step, args)
    return seconds, mem.peak


def _timed(fn, args) -> float:
    _sync(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        fn()
    _sync(args.device)
    return (time.perf_counter() - start) / args.steps


# -------------------------------------------------------------------------------------------- main

def main(argv=None) -> None:
    args = parse_args(argv)
    if not 0 <= args.prompt_share < 1:
        sys.exit(f"error: --prompt-share must be in [0, 1) (the prompt's share of each row), got {args.prompt_share}")
    HEAD_OPTIONS.update(parse_head_options(args.head_option))
    if args.allocator:
        return allocator(args, argv)
    torch.manual_seed(0)
    if args.allocator_child == "kept":
        from headway.heads.kernels.allocator import keep_freed_memory

        keep_freed_memory()
    target = bc.load_bench_target(args.target, args.device, args.dtype)
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    print(f"machine: {bc.machine()}; target {target.spec.name} {dtype} on {args.device}")
    if args.allocator_child:
        allocator_child(target, args)
    elif args.scaling:
        scaling(target, args)
    elif args.precision:
        precision(target, args)
    elif args.attention:
        attention(target, args)
    elif args.muon:
        muon(target, args)
    elif args.row_blocks:
        row_blocks(target, args)
    elif args.frozen_rows:
        frozen_rows(target, args)
    else:
        vocabulary(target, args)


def vocabulary(target, args) -> None:
    """Head step tokens/s: read-out over the whole vocabulary vs the training vocabulary (the defaults)."""
    print(f"head step only (forward + backward + AdamW), batch {args.vocab_batch} x {args.vocab_length} tokens, "
          f"{args.steps} timed steps per point, the two recipes interleaved")
    batch = make_batch(target, args.vocab_length, args.vocab_batch, args.device, args.prompt_share)
    counts = torch.arange(target.config.vocab_size, 0, -1)  # like real data: lower BPE ids are more frequent
    rows, speedup = [], {}
    for kind in args.heads:
        heads = {}
        for name, options in (("whole vocabulary", whole_vocab_options(kind)), ("training vocabulary",
                                                                                head_options(kind))):
            torch.manual_seed(0)
            head = build_head(kind, target, **options).to(args.device).train()
            head.init_from_data(counts)
            heads[name] = head
        feats = compute_features(target.model, batch["input_ids"], batch["attention_mask"],
                                 heads["whole vocabulary"].feature_layers())
        autocast = feature_autocast(target)
        best = best_interleaved({name: (lambda h=head: time_head(h, batch, feats, args, autocast)[0])
                                 for name, head in heads.items()})
        tokens = args.vocab_batch * args.vocab_length
        for name, head in heads.items():
            rows.append({"head": kind, "read-out": name, "rows": readout_rows(head),
                         "head ms/step": 1e3 * best[name], "train tok/s": tokens / best[name]})
        speedup[kind] = best["whole vocabulary"] / best["training vocabulary"]
        del heads
    bc.print_table(rows, "\n(rows = read-out rows trained per position; best of 3 interleaved repeats)")
    for kind, ratio in speedup.items():
        print(f"{kind}: training vocabulary {ratio:.2f}x the tokens/s of the whole-vocabulary read-out")
    kind = headline_kind(speedup)
    bc.headline(speedup[kind], f"{kind} head step, training vocabulary vs whole vocabulary (tokens/s)")


def best_interleaved(steps: dict, repeats: int = 3) -> dict[str, float]:
    """name -> least seconds of `steps[name]()` over `repeats` rounds that run every step once each: a busy
    moment of the machine slows all of them alike."""
    seconds = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            seconds[name].append(step())
    return {name: min(s) for name, s in seconds.items()}


def headline_kind(speedup: dict[str, float]) -> str:
    return "eagle" if "eagle" in speedup else next(iter(speedup))


def default_head(kind: str, target, batch: dict, args):
    """-> (the head with its conf/head defaults, in training mode, its training vocabulary from counts like
    real data's, and the target's features for `batch`)."""
    torch.manual_seed(0)
    head = build_head(kind, target, **head_options(kind)).to(args.device).train()
    head.init_from_data(torch.arange(target.config.vocab_size, 0, -1))  # lower BPE ids are more frequent
    feats = compute_features(target.model, batch["input_ids"], batch["attention_mask"], head.feature_layers())
    return head, feats


def report_speedups(rows: list[dict], note: str, speedup: dict[str, float], new: str, old: str) -> None:
    """The table, each head's `new` / `old` tokens/s, and the headline (EAGLE's, or the first head's)."""
    bc.print_table(rows, note)
    for kind, ratio in speedup.items():
        print(f"{kind}: {new} {ratio:.2f}x the tokens/s of {old}")
    kind = headline_kind(speedup)
    bc.headline(speedup[kind], f"{kind} head step, {new} vs {old} (tokens/s)")


def precision(target, args) -> None:
    """Head step tokens/s of the defaults in fp32 and under bf16 autocast, interleaved."""
    print(f"head step only (forward + backward + AdamW), defaults, batch {args.vocab_batch} x {args.vocab_length} "
          f"tokens, {args.steps} timed steps per point, fp32 and bf16 autocast interleaved")
    batch = make_batch(target, args.vocab_length, args.vocab_batch, args.device, args.prompt_share)
    tokens = args.vocab_batch * args.vocab_length
    rows, speedup = [], {}
    for kind in args.heads:
        head, feats = default_head(kind, target, batch, args)
        best = best_interleaved({name: (lambda d=dtype, h=head: time_head(h, batch, feats, args, autocast=d)[0])
                                 for name, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16))})
        rows += [{"head": kind, "precision": name, "head ms/step": 1e3 * t, "train tok/s": tokens / t}
                 for name, t in best.items()]
        speedup[kind] = best["fp32"] / best["bf16 autocast"]
        del head
    report_speedups(rows, "\n(best of 3 interleaved repeats)", speedup, "bf16 autocast", "fp32")


def feature_autocast(target) -> torch.dtype | None:
    """A target loaded in half precision hands the fp32 head half-precision features: the head step then
    runs under autocast to that dtype, as the training job's mixed precision does (None: an fp32 target)."""
    dtype = next(target.model.parameters()).dtype
    return None if dtype == torch.float32 else dtype


def job_autocast(args) -> torch.dtype | None:
    """The autocast dtype the default job's precision=auto picks on this device (None: fp32)."""
    from headway.heads.kernels.machine_choice import cpu_multiplies_bf16

    return torch.bfloat16 if args.device != "cpu" or cpu_multiplies_bf16() else None


UNROLLING_HEADS = ("eagle", "eagle3")  # heads whose training step unrolls a training-time test


def attention(target, args) -> None:
    """Head step tokens/s of the unrolling heads' defaults: chain attention vs SDPA with the dense chain mask."""
    from headway.heads.kernels.chain_attention import dense_chain_masks
    kinds = [kind for kind in args.heads if kind in UNROLLING_HEADS]
    if not kinds:
        sys.exit(f"error: --attention times the heads that unroll a training-time test ({', '.join(UNROLLING_HEADS)}); "
                 f"--heads names none of them")
    compare_defaults(target, args, kinds, "attention", ("chain", nullcontext), ("dense mask", dense_chain_masks),
                     "the unroll's attention as chain attention and as SDPA with the dense mask",
                     "chain attention", "a dense mask")


@contextmanager
def loss_in_one_block():
    """The distillation loss's passes over whole [n, V] tensors (one row block), as before row blocks."""
    saved = layers.ROW_BLOCK_BYTES
    layers.ROW_BLOCK_BYTES = 1 << 62
    try:
        yield
    finally:
        layers.ROW_BLOCK_BYTES = saved


def row_blocks(target, args) -> None:
    """Head step tokens/s of the defaults with the distillation loss in row blocks and in one block."""
    compare_defaults(target, args, args.heads, "loss", ("row blocks", nullcontext), ("one block", loss_in_one_block),
                     "the distillation loss in row blocks and in one block", "row blocks", "one block")


@contextmanager
def frozen_rows_gathered_per_call():
    """The frozen read-out's training rows gathered from the whole matrix (and cast by autocast) in every call."""
    from headway.heads.base import DraftHead

    saved = DraftHead._frozen_train_rows
    DraftHead._frozen_train_rows = lambda self, weight, ids: weight[ids].T
    try:
        yield
    finally:
        DraftHead._frozen_train_rows = saved


def frozen_rows(target, args) -> None:
    """Head step tokens/s of the defaults with the frozen read-out's training rows cached and gathered per call."""
    compare_defaults(target, args, args.heads, "frozen rows", ("cached", nullcontext),
                     ("gathered", frozen_rows_gathered_per_call),
                     "the frozen read-out's training rows cached and gathered per call", "cached rows",
                     "rows gathered per call")


def compare_defaults(target, args, kinds, column: str, new: tuple, old: tuple, what: str, new_words: str,
                     old_words: str) -> None:
    """Each head's default step (the job's precision here, freed memory kept) under the context managers of the
    `new` and `old` (name, context) sides, interleaved; the table, and new / old tokens/s per head."""
    from headway.heads.kernels.allocator import keep_freed_memory

    keep_freed_memory()  # as the training job steps
    autocast = job_autocast(args)
    print(f"head step only (forward + backward + AdamW), defaults{head_option_note()}, "
          f"{'bf16 autocast' if autocast else 'fp32'}, batch {args.vocab_batch} x {args.vocab_length} tokens, "
          f"{args.steps} timed steps per point, {what}, interleaved")
    batch = make_batch(target, args.vocab_length, args.vocab_batch, args.device, args.prompt_share)
    tokens = args.vocab_batch * args.vocab_length
    rows, speedup = [], {}
    for kind in kinds:
        head, feats = default_head(kind, target, batch, args)

        def step_in(context, h=head, f=feats):
            with context():
                return time_head(h, batch, f, args, autocast)[0]

        best = best_interleaved({name: (lambda c=context: step_in(c)) for name, context in (old, new)})
        rows += [{"head": kind, column: name, "head ms/step": 1e3 * t, "train tok/s": tokens / t}
                 for name, t in best.items()]
        speedup[kind] = best[old[0]] / best[new[0]]
        del head
    report_speedups(rows, "\n(best of 3 interleaved repeats)", speedup, new_words, old_words)


def head_option_note() -> str:
    return "".join(f", {key}={value}" for key, value in HEAD_OPTIONS.items())


def muon(target, args) -> None:
    """Head step tokens/s of the defaults with optim=muon orthogonalising in bf16 and in fp32, and with AdamW alone."""
    from headway.heads.kernels.allocator import keep_freed_memory
    from headway.train.loop import make_optimizers
    from headway.train.muon import orthogonalisation_dtype

    keep_freed_memory()  # as the training job steps
    autocast = job_autocast(args)
    optim = OmegaConf.load(bc.REPO / "conf" / "optim" / "muon.yaml")
    print(f"head step only (forward + backward + optimizers), defaults, {'bf16 autocast' if autocast else 'fp32'}, "
          f"batch {args.vocab_batch} x {args.vocab_length} tokens, {args.steps} timed steps per point; optim=muon "
          f"orthogonalising in bf16 and in fp32, and AdamW alone, interleaved")

    def muon_in(dtype: torch.dtype):
        def optimizers(head):
            opts = make_optimizers(head, optim)  # [Muon (hidden matrices), AdamW (the rest)]
            opts[0].orthogonalise_in = dtype
            return opts
        return optimizers

    batch = make_batch(target, args.vocab_length, args.vocab_batch, args.device, args.prompt_share)
    tokens = args.vocab_batch * args.vocab_length
    sides = {"muon, bf16": muon_in(torch.bfloat16), "muon, fp32": muon_in(torch.float32), "adamw alone": adamw}
    rows, speedup = [], {}
    for kind in args.heads:
        head, feats = default_head(kind, target, batch, args)
        best = best_interleaved({name: (lambda o=opts, h=head: time_head(h, batch, feats, args, autocast, o)[0])
                                 for name, opts in sides.items()})
        rows += [{"head": kind, "optimizer": name, "head ms/step": 1e3 * t, "train tok/s": tokens / t}
                 for name, t in best.items()]
        speedup[kind] = best["muon, bf16"] / best["muon, fp32"]
        del head
    print(f"optim=muon orthogonalises in {str(orthogonalisation_dtype(torch.device(args.device))).replace('torch.', '')} here")
    bc.print_table(rows, "\n(best of 3 interleaved repeats)")
    for kind, ratio in speedup.items():
        print(f"{kind}: orthogonalised in fp32 {ratio:.2f}x the tokens/s of bf16")
    bc.headline(speedup[args.heads[0]], f"{args.heads[0]} head step with optim=muon, orthogonalised in fp32 vs bf16 "
                                        f"(tokens/s)")


def allocator(args, argv) -> None:
    """Head step tokens/s of the defaults with glibc's malloc as it comes and with freed memory kept: each in
    its own process (the switch is process-wide), alternating so that machine noise hits both alike."""
    print(f"machine: {bc.machine()}; head step only (forward + backward + AdamW), defaults, batch "
          f"{args.vocab_batch} x {args.vocab_length} tokens, {args.steps} timed steps per point, in child "
          f"processes, freed memory returned (glibc as it comes) and kept (the training job) alternating")
    child_argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--allocator"]
    runs, rounds = {mode: [] for mode in ALLOCATOR_MODES}, 1 if args.quick else 3
    for _ in range(rounds):
        for mode in ALLOCATOR_MODES:
            child = subprocess.run([sys.executable, __file__, *child_argv, "--allocator-child", mode],
                                   capture_output=True, text=True)
            if child.returncode:  # its own error line (a bad --target, ...), or its traceback's last line
                last = (child.stderr.strip().splitlines() or ["no output"])[-1]
                print(last if last.startswith("error:") else f"error: the {mode} side failed: {last}", file=sys.stderr)
                sys.exit(child.returncode)
            runs[mode].append(json.loads(child.stdout.strip().splitlines()[-1]))
    tokens = args.vocab_batch * args.vocab_length
    rows, speedup = [], {}
    for kind in args.heads:
        best = {mode: min(run[kind]["seconds"] for run in runs[mode]) for mode in ALLOCATOR_MODES}
        for mode in ALLOCATOR_MODES:
            faults = sum(run[kind]["faults"] for run in runs[mode]) / len(runs[mode])
            rows.append({"head": kind, "freed memory": mode, "head ms/step": 1e3 * best[mode],
                         "train tok/s": tokens / best[mode], "page faults/step": faults})
        speedup[kind] = best["returned"] / best["kept"]
    report_speedups(rows, f"\n(best of {rounds} alternating processes; page faults: their mean)", speedup,
                    "freed memory kept", "returned")


def allocator_child(target, args) -> None:
    """One side of --allocator: print {head: {seconds, faults}} per step of each default head as JSON."""
    autocast = job_autocast(args)
    batch = make_batch(target, args.vocab_length, args.vocab_batch, args.device, args.prompt_share)
    result = {}
    for kind in args.heads:
        head, feats = default_head(kind, target, batch, args)
        time_head(head, batch, feats, args, autocast)  # warm-up: the allocator's heap reaches its size
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = time_head(head, batch, feats, args, autocast)[0]
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (args.steps + 1)
        result[kind] = {"seconds": seconds, "faults": faults}
        del head, feats
    print(json.dumps(result))


def readout_rows(head) -> int:
    ids = head.train_ids
    return head.target_config.vocab_size if ids is None else int(ids.numel())


def scaling(target, args) -> None:
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    print(f"batch {args.batch}, {args.steps} timed steps per point ({dtype})")
    mib = 2**20
    rows, growth = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.heads:
            head = build_head(kind, target, **head_options(kind)).to(args.device).train()
            head.init_from_data(torch.ones(target.config.vocab_size, dtype=torch.long))
            per_token = []
            for length in args.lengths:
                batch = make_batch(target, length, args.batch, args.device, args.prompt_share)
                t_on, t_off, m_on, m_off, feats = time_features(target, batch, head.feature_layers(), args,
                                                                 Path(tmp) / f"{kind}-{length}")
                t_head, m_head = time_head(head, batch, feats, args, feature_autocast(target))
                tokens = length * args.batch
                per_token.append(t_head / tokens)
                rows.append({"head": kind, "seq": length, "online tok/s": tokens / (t_on + t_head),
                             "offline tok/s": tokens / (t_off + t_head),
                             "offline/online": (t_on + t_head) / (t_off + t_head),
                             "head ms": 1e3 * t_head, "head us/token": 1e6 * t_head / tokens,
                             "features MiB online": m_on / mib, "features MiB offline": m_off / mib,
                             "head MiB": m_head / mib})
            growth[kind] = per_token[-1] / per_token[0]
            del head
    bc.print_table(rows, "\n(head = the head's own forward + backward + AdamW step; features: online = target "
                         "forward, offline = read from the hidden-state cache; MiB = peak memory of that part "
                         "above the level before it)")
    lo, hi = args.lengths[0], args.lengths[-1]
    for kind, g in growth.items():
        verdict = "no worse than linear" if g <= LINEAR_SLACK else "WORSE than linear"
        print(f"{kind}: head cost per token at {hi} vs {lo} tokens: {g:.2f}x ({verdict}; 1.00x = linear)")
    worst = max(growth, key=growth.get)
    bc.headline(growth[worst], f"worst head ({worst}) cost per token, {hi} vs {lo} tokens (1.00x = linear)")


if __name__ == "__main__":
    main()
