"""Run `python -m speculators.train ...` on a machine without an accelerator (run with speculators' own venv).

Only device plumbing is changed, at runtime (site-packages stay untouched), and each change is printed:
  1. the trainer's device type falls back to "cpu" instead of "cuda" when no accelerator is present;
  2. the trainer moves the model and batches with `.to("cpu")` instead of `.to(local_rank)`;
  3. `torch.accelerator.synchronize()` is skipped when no accelerator is available.
Nothing in the model, loss, optimizer, schedule or data path is touched.
"""

from __future__ import annotations

import runpy
import sys

import torch


def patch_for_cpu() -> list[str]:
    if torch.accelerator.is_available():
        return []
    import speculators.train.trainer as trainer

    patched = []
    trainer.get_local_rank = lambda: "cpu"  # Trainer.__init__ reads it into self.local_rank, used only by .to()
    patched.append("speculators.train.trainer.get_local_rank -> 'cpu' (.to(local_rank) becomes .to('cpu'))")

    original_init = trainer.Trainer.__init__

    def init_on_cpu(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"  # autocast device: the original falls back to "cuda"

    trainer.Trainer.__init__ = init_on_cpu
    patched.append("speculators.train.trainer.Trainer.device_type -> 'cpu' (fallback was 'cuda')")

    torch.accelerator.synchronize = lambda *a, **k: None
    patched.append("torch.accelerator.synchronize -> no-op (no accelerator present)")
    return patched


if __name__ == "__main__":
    for line in patch_for_cpu():
        print(f"peer device patch: {line}", flush=True)
    sys.argv = ["speculators.train", *sys.argv[1:]]
    runpy.run_module("speculators.train", run_name="__main__", alter_sys=True)
