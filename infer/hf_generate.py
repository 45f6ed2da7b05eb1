"""The baselines a user would otherwise run: transformers' `generate()`, plain or with prompt lookup
decoding (`prompt_lookup_num_tokens`), one prompt at a time, timed like the engine.

Sampling settings mirror the engine's exactly (temperature, top-k, top-p; none of the checkpoint's
generation_config defaults such as top_k=50), so tokens/s compare like with like. The model runs with its
weights as transformers loaded them (`stock_layout`), whatever layout an engine gave them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from headway.heads.sampling import is_greedy
from headway.heads.kernels.weight_layout import stock_layout


@dataclass
class HFResult:
    tokens: list[list[int]]  # new tokens per prompt (up to and including EOS)
    seconds: float  # wall time of all generate() calls

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


def generation_config(eos_ids: list[int], pad_id: int, max_new_tokens: int, temperature: float,
                      top_k: int | None = None, top_p: float | None = None,
                      prompt_lookup_num_tokens: int | None = None) -> GenerationConfig:
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0) \
        if not is_greedy(temperature) else dict(do_sample=False)
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), pad_token_id=pad_id,
                            prompt_lookup_num_tokens=prompt_lookup_num_tokens, **sampling)


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], config: GenerationConfig, seed: int | None = None) -> HFResult:
    """Run `model.generate` on each prompt (batch 1), weights as loaded, and time the calls."""
    device = next(model.parameters()).device
    if seed is not None:
        torch.manual_seed(seed)
    tokens, seconds = [], 0.0
    with stock_layout(model):
        for ids in prompts:
            input_ids = torch.tensor([ids], device=device)
            start = time.perf_counter()
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=config)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - start
            tokens.append(out[0, len(ids):].tolist())
    return HFResult(tokens, seconds)
