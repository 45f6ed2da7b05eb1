"""vLLM's offline engine behind a pipe: the worker of train.data.vllm_decode.

Runs under any Python that has vLLM (its own virtualenv is fine: it imports nothing from headway), loads the
model once, then answers one JSON request per stdin line with one JSON line on the protocol stream:

    request  {"prompts": [[ids]], "max_tokens": n, "stop_ids": [ids], "temperature": t, "top_p": p,
              "seeds": [int] | null}
    response {"tokens": [[ids]], "finished": [bool]}     (or {"error": "..."})

The first line written is {"ready": true, "vllm": "<version>"}. vLLM's own logging goes to stderr: the
protocol stream is the original stdout, and fd 1 is pointed at stderr so nothing else can write there.

    python vllm_worker.py MODEL_DIR --max-model-len 4096 --dtype float32 --max-num-seqs 128
"""

import argparse
import json
import os
import sys


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def answer(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seeds = request.get("seeds") or [None] * len(request["prompts"])
    params = [SamplingParams(max_tokens=request["max_tokens"], temperature=request["temperature"],
                             top_p=request["top_p"] if request["temperature"] > 0 else 1.0, seed=seed,
                             stop_token_ids=request["stop_ids"], skip_special_tokens=False,
                             detokenize=False)
              for seed in seeds]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params,
                           use_tqdm=False)
    completions = [o.outputs[0] for o in outputs]
    return {"tokens": [list(c.token_ids) for c in completions],
            "finished": [c.finish_reason == "stop" for c in completions]}


def main() -> None:
    args = parse_args()
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM (and anything it imports) printing to stdout must not corrupt the protocol
    import vllm

    llm = vllm.LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                   max_num_seqs=args.max_num_seqs, seed=args.seed, enable_prefix_caching=True)
    protocol.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    protocol.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = answer(llm, json.loads(line))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which raises it there
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    main()
