"""Serve headway exports with vLLM's offline `LLM` API and record every draft vLLM proposes.

Runs inside vLLM's own virtual environment (it pins its own torch), started by scripts/serve_check.py:

    VENV/bin/python scripts/peers/vllm_serve.py JOBS.json RESULTS.json

JOBS.json: {"prompts": [[token ids], ...], "max_tokens": int, "jobs": [{"name", "model", "speculative_config"
(null: no speculation)}]}. RESULTS.json: per job name {"outputs": [[token ids] per prompt], "drafts": [[[K draft
ids] per proposal, in order] per prompt], "metrics": {counter: value}} or {"error": "..."}.

The engine runs in this process (no engine-core or worker subprocess), so wrapping the model runner's
`propose_draft_token_ids` sees every proposal. Prompts are generated one at a time, so all proposals of a
`generate` call belong to its one request. Greedy, fp32, eager mode (no torch.compile on CPU).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: tiny models, short prompts

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PROPOSALS: list = []  # the draft rows of the current generate call, in proposal order


def record_proposals() -> None:
    """Wrap GPUModelRunner.propose_draft_token_ids (the CPU runner inherits it) to keep what it returns."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids

    def propose_and_record(self, *args, **kwargs):
        drafts = original(self, *args, **kwargs)
        rows = drafts.tolist() if hasattr(drafts, "tolist") else [list(r) for r in drafts]
        PROPOSALS.append((list(self.input_batch.req_ids), rows))
        return drafts

    GPUModelRunner.propose_draft_token_ids = propose_and_record


def counters(llm) -> dict:
    values = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            values[metric.name] = values.get(metric.name, 0) + metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            old = values.get(metric.name, [0] * len(metric.values))
            values[metric.name] = [a + b for a, b in zip(old, metric.values)]
    return values


def run_job(job: dict, prompts: list, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], speculative_config=job.get("speculative_config"), dtype="float32",
              max_model_len=1024, enforce_eager=True, seed=0, disable_log_stats=False,
              distributed_executor_backend="uni")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = counters(llm)
    outputs, drafts = [], []
    for ids in prompts:
        PROPOSALS.clear()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
        req_ids = {r for reqs, _ in PROPOSALS for r in reqs}
        if len(req_ids) > 1:
            raise RuntimeError(f"proposals for several requests in one generate call: {sorted(req_ids)}")
        drafts.append([rows[0] for _, rows in PROPOSALS if rows])
    after = counters(llm)
    metrics = {k: (v - before.get(k, 0) if not isinstance(v, list)
                   else [a - b for a, b in zip(v, before.get(k, [0] * len(v)))]) for k, v in after.items()}
    del llm
    return {"outputs": outputs, "drafts": drafts, "metrics": metrics}


def main(jobs_path: str, results_path: str) -> int:
    spec = json.loads(open(jobs_path).read())
    record_proposals()
    results = {}
    for job in spec["jobs"]:
        try:
            results[job["name"]] = run_job(job, spec["prompts"], spec["max_tokens"])
        except Exception as exc:  # one job's failure is a result to report, not the end of the others
            traceback.print_exc()
            results[job["name"]] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400]}"
                                    if str(exc).strip() else type(exc).__name__}
        with open(results_path, "w") as f:  # after each job: a crash later keeps what was measured
            json.dump(results, f)
    return 0


if __name__ == "__main__":  # the guard the spawn start method needs
    sys.exit(main(*sys.argv[1:]))
