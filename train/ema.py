"""An exponential moving average of the head's trained weights (`train.ema_decay`): what validation scores and
what the run ships (best/ and final/), while the optimizer keeps stepping the raw weights.

Averaging smooths the noise of small batches: in the middle of the default EAGLE job an average drafts much
better than the weights as trained; at the end of its cosine schedule the gain is within one seed's spread
(docs/training.md). After n updates the decay is min(decay, n / (n + 1)): the plain mean
of the weights so far until the window of 1 / (1 - decay) steps is full, an exponential average after, so the
window is what `decay` says even in a run of a few thousand steps. The average is registered with accelerate's
checkpointing: a resumed run continues it exactly.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class WeightAverage:
    """fp32 shadow copies of every trainable parameter, updated after each optimizer step."""

    def __init__(self, model: nn.Module, decay: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]
        self.decay, self.updates = decay, 0

    def current_decay(self) -> float:
        # the plain mean of the weights so far until the window 1 / (1 - decay) is full, then exponential
        return min(self.decay, self.updates / (1 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.current_decay()  # shadow += weight * (param - shadow)
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], weight)
        self.updates += 1

    @contextmanager
    def swapped_in(self):
        """The parameters hold the average for the time (validation, saving), their own values after."""
        with torch.no_grad():
            raw = [p.detach().clone() for p in self.params]
            torch._foreach_copy_([p.detach() for p in self.params], self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.detach() for p in self.params], raw)

    def state_dict(self) -> dict:
        return {"shadow": self.shadow, "updates": self.updates}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        torch._foreach_copy_(self.shadow, state["shadow"])
        self.updates = int(state["updates"])
