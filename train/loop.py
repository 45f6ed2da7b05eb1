"""The training loop: distil a draft head from a frozen target, under accelerate (one process, DDP or
DeepSpeed ZeRO-2/3). Read top to bottom: set-up, the step, validation, checkpoints, the final head.

The frozen target lives on the accelerator's device but outside `prepare`, the optimizer and the
checkpoints: only the head is trained, wrapped and saved. Each step asks the feature source for the
target's hidden states of the batch (computed online under no_grad, or read from an offline cache) and
the head turns them into its loss.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.data_loader import skip_first_batches
from accelerate.logging import get_logger
from accelerate.utils import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin,
                              InitProcessGroupKwargs, broadcast_object_list, set_seed)
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Subset
from tqdm.auto import tqdm

from headway.heads.base import DraftHead, build_head, simulated_tau
from headway.heads.kernels.allocator import keep_freed_memory
from headway.heads.kernels.machine_choice import cpu_multiplies_bf16
from headway.heads.target import load_target
from headway.train.checkpoints import load_checkpoint, resume_point, run_identity, save_checkpoint, save_head_folder
from headway.train.config import ConfigError, TrainingError, check_config, check_fits_context
from headway.train.data import build_datasets, collate_fn, make_feature_source, token_counts
from headway.train.data.batching import LengthGroupedBatches, example_lengths
from headway.train.data.capture import capture_plan
from headway.train.ema import WeightAverage
from headway.train.metrics import MetricsLog
from headway.train.muon import Muon
from headway.train.threads import use_cpu_threads
from headway.train.warm_start import init_folder, start_from

log = get_logger(__name__)


@dataclass
class Job:
    """What every step needs, built once; model, optimizer and loaders are accelerate-prepared."""

    accelerator: Accelerator
    model: torch.nn.Module  # the head, wrapped for DDP / DeepSpeed
    optimizers: list[torch.optim.Optimizer]  # AdamW, or Muon + AdamW
    train_dl: DataLoader
    val_dl: DataLoader | None
    features: Callable  # batch -> TargetFeatures of the frozen target
    identity: dict  # head kind and options, target name, revision, architecture, weights fingerprint
    ema: WeightAverage | None = None  # train.ema_decay: the averaged weights validation scores and runs ship


def train(cfg: DictConfig) -> Path:
    """Run one training job described by a composed `conf/train.yaml`; returns the run dir.

    The run dir ends up with metrics.jsonl, checkpoints/ and final/ (unless `train.stop_after` ended the
    job early: then the newest checkpoint is where `resume=latest` continues)."""
    check_config(cfg)
    t = cfg.train
    accelerator = make_accelerator(cfg)
    run_dir = shared_run_dir(accelerator, cfg.output_dir)
    if accelerator.device.type == "cpu":  # data generation, the cache pass and the steps: the same large tensors
        log.info(f"freed memory kept for reuse: {keep_freed_memory()}")  # allocated again and again
    job = setup(cfg, accelerator)
    state, resumed = restore(cfg, accelerator, run_dir, job.identity)
    metrics = MetricsLog(accelerator, run_dir, cfg, resumed_step=state["step"])  # drops rows after it

    step = state["step"]
    end = t.max_steps if t.stop_after is None else min(t.max_steps, step + t.stop_after)
    batches = endless(job.train_dl, first=step * t.grad_accum)
    window = Window(accelerator)
    bar = tqdm(total=t.max_steps, initial=step, desc=f"train {cfg.head.kind}", dynamic_ncols=True,
               disable=not accelerator.is_main_process)
    started = time.perf_counter()
    job.model.train()
    while step < end:
        lr = lr_at(step, cfg.optim, t.max_steps)
        set_lr(job.optimizers, lr)
        for _ in range(t.grad_accum):
            micro_step(job, next(batches), window, max_norm=cfg.optim.grad_clip or math.inf, step=step + 1,
                       loss_on=cfg.train.loss_on)
        step += 1
        bar.update(1)

        if step % t.log_every == 0 or step == end:
            row = window.flush(state)
            metrics.write({"split": "train", "step": step, **row, "lr": lr, "epoch": epoch_of(step, t, job),
                           "elapsed_s": round(time.perf_counter() - started, 2)})
            bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}")
        if job.val_dl is not None and ((t.eval_every and step % t.eval_every == 0) or step == t.max_steps):
            state["last_val"] = validate(job)
            metrics.write({"split": "val", "step": step, **state["last_val"]})
            keep_if_best(cfg, job, run_dir, step, state, window)
        if (t.save_every and step % t.save_every == 0) or (step == end < t.max_steps):
            window.count_tokens(state)
            save_checkpoint(accelerator, run_dir, step, state, keep=t.keep_checkpoints)
    bar.close()

    if step >= t.max_steps:
        window.count_tokens(state)
        with averaged(job):
            save_head_folder(accelerator, job.model, run_dir / "final", recipe(cfg, job, step, state))
        log.info(f"trained {step} steps in {time.perf_counter() - started:.1f}s: {run_dir / 'final'}")
    else:
        log.info(f"stopped after step {step} (train.stop_after); continue with resume=latest "
                 f"hydra.run.dir={run_dir}")
    metrics.close()
    return run_dir


# ---------------------------------------------------------------------------------------- set-up

def auto_precision(on_gpu: bool, deepspeed: bool) -> str:
    """bf16 autocast on a GPU, and on a CPU with bf16 multiply instructions: AMX (Intel Sapphire Rapids and
    later) or AVX512-BF16 (e.g. AMD Zen 4), where oneDNN's bf16 GEMM outruns its fp32 one and the head's step
    is ~1.5-1.8x faster (docs/training.md); fp32 on other CPUs, where bf16 is emulated and slow, and under
    DeepSpeed's CPU accelerator."""
    if on_gpu:
        return "bf16"
    return "bf16" if cpu_multiplies_bf16() and not deepspeed else "no"


def make_accelerator(cfg: DictConfig) -> Accelerator:
    on_gpu = cfg.device != "cpu" and torch.cuda.is_available()
    # Without a GPU, accelerate runs several processes as gloo ranks (MULTI_CPU) only when told `cpu=True`;
    # DeepSpeed runs on its own CPU accelerator, needs `cpu=False` and must be told to use gloo.
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    precision = cfg.precision if cfg.precision != "auto" else auto_precision(on_gpu, deepspeed)
    cpu = cfg.device == "cpu" or (not on_gpu and not deepspeed)
    gloo = [InitProcessGroupKwargs(backend="gloo")] if deepspeed and not on_gpu else []
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=precision,
        # the loop counts micro-steps itself: never let an epoch boundary force an early optimizer step
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.train.grad_accum,
                                                                sync_with_dataloader=False),
        # every epoch's shuffle is a function of (seed, epoch): a resumed run sees the same batches
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.train.seed),
        log_with="wandb" if cfg.logger.kind == "wandb" else None,
        kwargs_handlers=gloo,
    )
    if not on_gpu:  # after Accelerator(), which may set its own count
        log.info(f"CPU threads per process: {use_cpu_threads(cfg.cpu_threads)}; mixed precision: {precision}")
    return accelerator


def shared_run_dir(accelerator: Accelerator, output_dir: str) -> Path:
    """Every rank composes its own Hydra config (and `${now:}` can differ per rank): use rank 0's dir."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ConfigError(f"launched as {launched} processes but accelerate sees {accelerator.num_processes}: "
                          f"use `accelerate launch` flags that match (--multi_gpu, --use_deepspeed)")
    box = [str(Path(output_dir).resolve())]
    if accelerator.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    run_dir = Path(box[0])
    if accelerator.is_main_process:
        check_writable(run_dir)
    return run_dir


def check_writable(run_dir: Path) -> None:
    """Create the run dir and write a probe file there: a read-only or full disk fails now, in one line."""
    probe = run_dir / ".headway-writable"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as f:
            f.write(b"headway")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write the run dir {run_dir}: {exc.strerror or exc} ({exc.filename}): pass "
                          f"hydra.run.dir=<a writable folder with free space>") from None


def with_hidden_cache(data_cfg, accelerator: Accelerator, target, datasets, layers: list[int]):
    """`data.hidden_states=offline` without `data.hidden_cache`: run the target once over the data into a
    cache keyed by target, dtype and layers (reused by later runs; only missing rows are computed), so an
    epoch after the first costs only the head's own compute."""
    if data_cfg.hidden_states != "offline" or data_cfg.hidden_cache:
        return data_cfg
    from headway.train.data.hidden_cache import auto_cache_dir, build_cache

    directory = auto_cache_dir(target, layers, data_cfg.cache_logits, data_cfg.logits_topk)
    # every rank computes its share of what is missing (what data generation did not capture)
    stats = build_cache(directory, target, datasets, sorted(set(layers) | {target.num_layers}),
                        logits=data_cfg.cache_logits, topk=data_cfg.logits_topk, rank=accelerator.process_index,
                        world_size=accelerator.num_processes, barrier=accelerator.wait_for_everyone,
                        progress=accelerator.is_main_process, precision=data_cfg.cache_precision)
    if accelerator.is_main_process:
        log.info("hidden-state cache %s: %s", directory, stats)
    data_cfg = OmegaConf.create(OmegaConf.to_container(data_cfg, resolve=True))
    data_cfg.hidden_cache = str(directory)
    return data_cfg


def setup(cfg: DictConfig, accelerator: Accelerator) -> Job:
    """Frozen target, data, head (seeing the data first), optimizer, loaders; then `prepare` the head side
    only: the target stays outside the wrapper, the optimizer and the checkpoints."""
    t = cfg.train
    start = init_folder(cfg.init_from, cfg.head.kind)  # checked before the (possibly long) data build
    target = load_frozen_target(accelerator, cfg)
    check_fits_context(t.max_length, target.config)
    set_seed(t.seed)  # the same head initialisation on every rank
    head = build_head(cfg.head.kind, target, **OmegaConf.to_container(cfg.head.options, resolve=True))
    # data generated here (data=default on first use) stores the head's features in the cache on the way
    capture = capture_plan(cfg.data, target, head.feature_layers(), t.max_length)
    train_ds, val_ds = build_datasets(cfg.data, target.tokenizer, t.max_length, t.seed,
                                      main_process_first=accelerator.main_process_first, capture=capture)
    head.token_counts = token_counts(train_ds, target.config.vocab_size)  # saved: the draft vocabulary
    head.init_from_data(head.token_counts)
    if start is not None:
        start_from(head, start, target)
    data_cfg = with_hidden_cache(cfg.data, accelerator, target, [train_ds, val_ds], head.feature_layers())
    features = make_feature_source(data_cfg, target, head.feature_layers())
    optimizers = make_optimizers(head, optimizer_config(cfg, accelerator))
    train_dl, val_dl = make_loaders(cfg, train_ds, val_ds, target.tokenizer.pad_token_id,
                                    accelerator.num_processes)
    configure_deepspeed(accelerator, cfg)
    model, *optimizers, train_dl = accelerator.prepare(head, *optimizers, train_dl)
    if val_dl is not None:
        val_dl = accelerator.prepare(val_dl)
    set_seed(t.seed, device_specific=True)  # training noise differs per rank
    identity = run_identity(cfg.head.kind, OmegaConf.to_container(cfg.head.options, resolve=True), target)
    ema = weight_average(cfg, accelerator, model)
    return Job(accelerator, model, optimizers, train_dl, val_dl, features, identity, ema)


def weight_average(cfg: DictConfig, accelerator: Accelerator, model) -> WeightAverage | None:
    """train.ema_decay's average, saved and restored with every checkpoint."""
    if cfg.train.ema_decay is None:
        return None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # as optim=muon falls back to AdamW there
        if accelerator.is_main_process:
            log.warning("train.ema_decay: DeepSpeed ZeRO partitions the weights the average needs whole, so this "
                        "run validates and ships the weights as trained (set train.ema_decay=null to say so, or "
                        "launch with DDP: conf/accelerate/multi_gpu.yaml)")
        return None
    ema = WeightAverage(accelerator.unwrap_model(model), cfg.train.ema_decay)
    accelerator.register_for_checkpointing(ema)
    return ema


def averaged(job: Job):
    """The head holds its averaged weights for the time (nothing to do without train.ema_decay)."""
    return job.ema.swapped_in() if job.ema is not None else nullcontext()


def restore(cfg: DictConfig, accelerator: Accelerator, run_dir: Path, identity: dict) -> tuple[dict, bool]:
    """The trainer state to start from: fresh, or the newest intact checkpoint's (head, optimizer, RNG of every
    rank and data sampler are restored in place by accelerate), saved by the same head on the same target."""
    state = {"step": 0, "tokens_seen": 0, "best_sim_tau": None, "best_step": None, "last_val": None, **identity}
    ckpt = resume_point(accelerator, cfg.resume, run_dir)
    if ckpt is not None:
        state.update(load_checkpoint(accelerator, ckpt, expect=identity))
        log.info(f"resumed from {ckpt} at step {state['step']}")
    elif cfg.resume == "latest":
        log.info(f"resume=latest: no checkpoint under {run_dir}/checkpoints, starting fresh (to continue a "
                 f"killed run, pass its dir: hydra.run.dir=<run dir> or resume=<run dir>)")
    return state, ckpt is not None


def load_frozen_target(accelerator: Accelerator, cfg: DictConfig):
    """The target on this rank's device, never sharded: under ZeRO-3, transformers would otherwise
    partition it at load, and it is not part of the DeepSpeed engine that would gather it back."""
    plugin = accelerator.state.deepspeed_plugin
    no_zero_init = plugin.zero3_init_context_manager(enable=False) if plugin is not None else nullcontext()
    with no_zero_init:
        return load_target(OmegaConf.to_container(cfg.target, resolve=True), device=accelerator.device)


def make_optimizers(head: DraftHead, optim: DictConfig) -> list[torch.optim.Optimizer]:
    """AdamW; weight decay on matrices only (nanoGPT): norms and biases are not decayed. Trained read-outs
    (`lm_head` rows that start as the target's) learn at lr x `optim.readout_lr_scale`.
    `optim.name=muon`: Muon (orthogonalised momentum, torch.optim.Muon's step, orthogonalised in fp32 on CPUs
    that would emulate bf16 (train/muon.py), its update scaled to AdamW's RMS so the same lr and weight decay
    apply) for the hidden weight matrices, AdamW for read-outs, norms, biases;
    `optim.muon_lr_scale`, `optim.muon_weight_decay` and `optim.muon_ns_steps` tune the Muon group alone."""
    params = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    readouts = [p for n, p in params if "lm_head" in n]
    rest = [p for n, p in params if "lm_head" not in n]
    hidden = [p for p in rest if p.dim() == 2] if optim.name == "muon" else []  # Muon's; read-outs stay on AdamW
    matrices = [p for p in rest if p.dim() >= 2 and all(p is not q for q in hidden)]
    groups = [{"params": matrices, "weight_decay": optim.weight_decay},
              {"params": readouts, "weight_decay": optim.weight_decay, "lr_scale": optim.readout_lr_scale},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    optimizers = [torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr, betas=tuple(optim.betas),
                                    eps=optim.eps)]
    if optim.name == "muon" and hidden:
        decay = optim.weight_decay if optim.muon_weight_decay is None else optim.muon_weight_decay
        muon_group = {"params": hidden, "lr_scale": optim.muon_lr_scale}  # set_lr applies the scale each step
        optimizers.insert(0, Muon([muon_group], lr=optim.lr, weight_decay=decay, ns_steps=optim.muon_ns_steps,
                                  adjust_lr_fn="match_rms_adamw"))
    return optimizers


def optimizer_config(cfg: DictConfig, accelerator: Accelerator) -> DictConfig:
    """cfg.optim; under DeepSpeed AdamW replaces Muon (head=eagle3's default), whose weight matrices ZeRO shards
    while Muon must orthogonalise each one whole."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED and cfg.optim.name == "muon":
        if accelerator.is_main_process:
            log.warning("optim.name=muon: DeepSpeed shards the weight matrices Muon needs whole, so this run "
                        "trains with AdamW (set optim.name=adamw to say so, or launch with DDP: "
                        "conf/accelerate/multi_gpu.yaml)")
        return OmegaConf.merge(cfg.optim, {"name": "adamw"})
    return cfg.optim


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    """The schedule's lr for this step, times each group's `lr_scale` (read-outs: optim.readout_lr_scale)."""
    for group in (g for opt in optimizers for g in opt.param_groups):
        group["lr"] = lr * group.get("lr_scale", 1.0)


def make_loaders(cfg: DictConfig, train_ds, val_ds, pad_id: int, num_processes: int):
    t = cfg.train
    collate = collate_fn(pad_id)
    # own generators: creating a loader iterator must not draw from the global RNG, or a resumed run's
    # training noise would drift from the uninterrupted run's
    if t.group_by_length:
        batches = LengthGroupedBatches(example_lengths(train_ds), t.batch_size, t.seed)
        train_dl = DataLoader(train_ds, batch_sampler=batches, collate_fn=collate,
                              generator=torch.Generator().manual_seed(t.seed))
    else:
        train_dl = DataLoader(train_ds, batch_size=t.batch_size, shuffle=True, collate_fn=collate,
                              generator=torch.Generator().manual_seed(t.seed))
    if len(val_ds) == 0:
        log.warning("no validation split (data.val_fraction=0): no simulated tau, no best checkpoint")
        return train_dl, None
    if t.eval_batches is not None:  # a fixed subset, the same at every validation
        val_ds = Subset(val_ds, range(min(len(val_ds), t.eval_batches * t.batch_size * num_processes)))
    return train_dl, DataLoader(val_ds, batch_size=t.batch_size, shuffle=False, collate_fn=collate,
                                generator=torch.Generator().manual_seed(t.seed))


def configure_deepspeed(accelerator: Accelerator, cfg: DictConfig) -> None:
    """DeepSpeed clips gradients itself: give it optim.grad_clip where its config says "auto"; and the micro
    batch size, which it cannot read off a loader whose batches come from a batch sampler (length-grouped)."""
    plugin = accelerator.state.deepspeed_plugin
    if accelerator.distributed_type == DistributedType.DEEPSPEED and plugin is not None:
        if plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
            plugin.deepspeed_config["gradient_clipping"] = float(cfg.optim.grad_clip)
        if plugin.deepspeed_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = int(cfg.train.batch_size)


# ------------------------------------------------------------------------------------------ step

def lr_at(step: int, optim: DictConfig, max_steps: int) -> float:
    """Linear warmup, then a cosine or linear decay to lr * min_lr_ratio (or constant)."""
    warmup = optim.warmup_steps if optim.warmup_steps is not None else round(optim.warmup_ratio * max_steps)
    if step < warmup:
        return optim.lr * (step + 1) / (warmup + 1)
    if optim.schedule == "constant":
        return optim.lr
    progress = (step - warmup) / max(1, max_steps - warmup)  # 0 -> 1
    min_lr = optim.lr * optim.min_lr_ratio
    remaining = 1 - progress if optim.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr + remaining * (optim.lr - min_lr)


def micro_step(job: Job, batch: dict, window: "Window", max_norm: float, step: int,
               loss_on: str = "assistant") -> None:
    """Forward and backward on one micro-batch; the optimizer steps when accumulation is complete
    (accelerate's `accumulate` skips the gradient all-reduce and the step before that)."""
    accelerator = job.accelerator
    learned = batch["loss_mask"] if loss_on == "assistant" else batch["attention_mask"].bool()  # [B, T]
    with accelerator.accumulate(job.model):
        out = job.model(batch["input_ids"], learned, job.features(batch))
        accelerator.backward(out.loss)
        if accelerator.sync_gradients:
            window.grad_norm = accelerator.clip_grad_norm_(job.model.parameters(), max_norm)
            stop_if_not_finite(window.grad_norm, out.loss, step)
        for optimizer in job.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if job.ema is not None and accelerator.sync_gradients:
            job.ema.update()
    window.add(out, batch)


def stop_if_not_finite(grad_norm, loss, step: int) -> None:
    """Stop before a NaN or infinite gradient reaches the weights. The norm is global (the same on every rank
    after the all-reduce), so every rank stops together; a NaN loss makes NaN gradients."""
    if grad_norm is not None and not math.isfinite(float(grad_norm)):
        raise TrainingError(f"step {step}: the gradient norm is {float(grad_norm)} (loss {float(loss.detach()):.4g}): "
                            f"training diverged or the data or target weights hold NaN; lower optim.lr, check the "
                            f"target, or resume from the last checkpoint (nothing after it was saved)")


def endless(loader, first: int = 0):
    """Batches across epochs, starting at micro-batch `first` (the position a resumed run stopped at)."""
    epoch, skip = divmod(first, len(loader))
    while True:
        loader.set_epoch(epoch)
        yield from (skip_first_batches(loader, skip) if skip else loader)
        epoch, skip = epoch + 1, 0


def epoch_of(step: int, t: DictConfig, job: Job) -> float:
    return round(step * t.grad_accum / len(job.train_dl), 3)


class Window:
    """Sums since the last train row (per rank); `flush` reduces them across ranks."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.grad_norm = None
        self.tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)  # since the last count
        self.reset()

    def reset(self):
        self.loss, self.micro, self.extra = 0.0, 0, {}
        self.started = time.perf_counter()

    def add(self, out, batch) -> None:
        self.loss += out.loss.detach()
        self.micro += 1
        self.tokens += batch["attention_mask"].sum()
        for k, v in out.metrics.items():
            self.extra[k] = self.extra.get(k, 0.0) + float(v)

    def count_tokens(self, state: dict) -> None:
        """Add the tokens every rank has read since the last count to `state["tokens_seen"]`."""
        state["tokens_seen"] += int(self.accelerator.reduce(self.tokens.clone(), "sum"))
        self.tokens.zero_()

    def flush(self, state: dict) -> dict:
        """The train row: mean loss and head metrics over the window and all ranks."""
        keys = sorted(self.extra)
        local = torch.tensor([float(self.loss) / self.micro] + [self.extra[k] / self.micro for k in keys],
                             device=self.accelerator.device)
        mean = self.accelerator.reduce(local, "mean").tolist()
        if not math.isfinite(mean[0]):  # the same on every rank: all stop
            raise TrainingError(f"the training loss is {mean[0]} (mean since the last metrics row): lower "
                                f"optim.lr or check the data and target weights")
        before = state["tokens_seen"]
        self.count_tokens(state)
        row = {"loss": mean[0], **dict(zip(keys, mean[1:])), "tokens_seen": state["tokens_seen"],
               "tokens_per_s": round((state["tokens_seen"] - before) / (time.perf_counter() - self.started), 1)}
        if self.grad_norm is not None:
            row["grad_norm"] = float(self.grad_norm)
        self.reset()
        return row


# ------------------------------------------------------------------------------------ validation

@torch.no_grad()
def validate(job: Job) -> dict:
    """Per-depth top-1 accuracy of the head's drafts on the held-out split (all ranks) and the simulated
    tau = 1 + sum_k prod_{j<=k} acc_j they imply (expected tokens per verification of a chain)."""
    accelerator, model = job.accelerator, job.model
    model.eval()
    correct = count = None
    loss, batches = 0.0, 0
    with averaged(job):
        for batch in job.val_dl:
            out = model(batch["input_ids"], batch["loss_mask"], job.features(batch))
            correct = out.depth_correct.float() if correct is None else correct + out.depth_correct
            count = out.depth_count.float() if count is None else count + out.depth_count
            loss, batches = loss + out.loss.float(), batches + 1
    model.train()
    correct = accelerator.reduce(correct, "sum")  # [K]
    count = accelerator.reduce(count, "sum")  # [K]
    loss = accelerator.reduce(torch.as_tensor(loss / batches, device=accelerator.device), "mean")
    acc = (correct / count.clamp(min=1)).tolist()
    return {"loss": float(loss), "sim_tau": simulated_tau(acc),
            **{f"acc_depth_{k + 1}": a for k, a in enumerate(acc)}}


def keep_if_best(cfg: DictConfig, job: Job, run_dir: Path, step: int, state: dict, window: "Window") -> None:
    """Pick checkpoints by acceptance, not by loss: loss can keep falling while tau peaks."""
    tau = state["last_val"]["sim_tau"]
    if state["best_sim_tau"] is not None and tau <= state["best_sim_tau"]:
        return
    state.update(best_sim_tau=tau, best_step=step)
    window.count_tokens(state)
    with averaged(job):
        save_head_folder(job.accelerator, job.model, run_dir / "checkpoints" / "best",
                         recipe(cfg, job, step, state))


# ------------------------------------------------------------------------------------ the result

def recipe(cfg: DictConfig, job: Job, step: int, state: dict) -> dict:
    """What went into a head, stored in its config.json (export writes the model card from it)."""
    t, accelerator = cfg.train, job.accelerator
    return {"training": {
        "steps": step,
        "max_steps": t.max_steps,
        "optimizer": OmegaConf.to_container(cfg.optim, resolve=True),
        "batch_size": t.batch_size,
        "grad_accum": t.grad_accum,
        "processes": accelerator.num_processes,
        "effective_batch_size": t.batch_size * t.grad_accum * accelerator.num_processes,
        "max_length": t.max_length,
        "seed": t.seed,
        "init_from": cfg.init_from,  # the head it started from (None: a fresh head)
        "ema_decay": job.ema.decay if job.ema else None,  # what the weights are (None: as trained)
        "data": OmegaConf.to_container(cfg.data, resolve=True),
        "tokens_seen": state["tokens_seen"],
        "validation": state["last_val"],
        "best": {"step": state["best_step"], "sim_tau": state["best_sim_tau"]},
    }}

