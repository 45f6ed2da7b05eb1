"""Serve a target with one EAGLE-3 draft in vLLM (greedy) and write its acceptance counters as JSON.

    <vllm venv>/bin/python scripts/peer/vllm_judge.py TARGET DRAFT PROMPTS.json OUT.json [--tokens 128]

PROMPTS.json is a list of prompt strings (each sent as one user turn through the target's chat template).
Counters come from `llm.get_metrics()`; mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def counters(metrics) -> dict:
    found = {m.name: m for m in metrics}
    drafts = found["vllm:spec_decode_num_drafts"].value
    accepted = found["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = found["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    return {"drafts": drafts, "accepted": accepted, "mean_acceptance_length": 1 + accepted / max(drafts, 1),
            "acceptance_by_position": [a / max(drafts, 1) for a in per_pos]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("draft")
    p.add_argument("prompts", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--speculative-tokens", type=int, default=3)
    p.add_argument("--memory-fraction", type=float, default=0.2, help="of host RAM on CPU (KV cache and weights)")
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    # on CPU the memory fraction is of host RAM: a small share leaves room for whatever else runs there
    llm = LLM(model=args.target, dtype="float32", max_model_len=2048, disable_log_stats=False,
              gpu_memory_utilization=args.memory_fraction,
              speculative_config={"method": "eagle3", "model": args.draft,
                                  "num_speculative_tokens": args.speculative_tokens})
    prompts = json.loads(args.prompts.read_text())
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=args.tokens))
    result = counters(llm.get_metrics())
    result["generated_tokens"] = sum(len(o.outputs[0].token_ids) for o in outputs)
    result["texts"] = [o.outputs[0].text for o in outputs]
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
