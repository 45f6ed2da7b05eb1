"""Whether drafting pays within one generate() call, judged from that call's own steps.

A tree is planned before any token is seen, from the head's validation acceptance and the cost of a draft
level estimated from its weights (infer.drafters.AutoTree). Both can be wrong for the prompts at hand: a
sampling temperature lowers acceptance, and drafting costs Python time that no weight count shows. The guard
compares, after a few speculative steps, the tokens each step emitted (tau) with what a step cost in plain
decoding steps:

    cost = (speculative step time / its target forward time) x T(B x N) / T(B)

The first factor is measured in this call (drafting, verification and bookkeeping over the forward), the
second comes from the calibrated latency curve (the tree's forward in plain forwards); both are ratios, so a
busy machine slows both sides alike. Drafting stops for the rest of the call once tau < cost: a plan that
merely breaks even keeps drafting, since stopping is final and the first steps of a reply are noisy.
Output is unaffected: every step, speculative or plain, samples the target's own distribution.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftingGuard:
    tree_cost: float  # T(B x N) / T(B): one tree's forward in plain forwards
    min_steps: int = 16  # speculative steps measured before judging (the first steps of a reply are noisy)
    steps: int = 0
    step_s: float = 0.0  # wall time of the speculative steps
    forward_s: float = 0.0  # of which the target's forwards

    def record(self, step_s: float, forward_s: float) -> None:
        self.steps += 1
        self.step_s += step_s
        self.forward_s += forward_s

    @property
    def cost(self) -> float:
        """A speculative step in plain steps, as measured so far."""
        return self.step_s / self.forward_s * self.tree_cost if self.forward_s > 0 else 0.0

    def pays(self, tau: float) -> bool:
        """Whether to keep drafting, given the tokens per row-step emitted so far."""
        return self.steps < self.min_steps or tau >= self.cost
