"""vLLM's own offline throughput on a set of requests: the ceiling bench/bench_limits.py sets draftsmith's
generate and extract stages against. It runs in the vLLM environment, not draftsmith's (vLLM and its torch live
there), reads one JSON job and prints one JSON line.

    .venv-vllm/bin/python bench/limits_vllm_offline.py JOB.json

JOB.json:
    model          the model folder
    dtype          as `vllm serve --dtype`
    max_model_len  as `vllm serve --max-model-len`
    enforce_eager  as `vllm serve --enforce-eager` (the extract server's default)
    mode           "chat": `LLM.chat` over `messages` (a list of OpenAI message lists), greedy, `max_tokens` each;
                   "prefill": `LLM.generate` over `token_ids` (a list of token-id lists) with one output token
                   each and the prefix cache off, so every prompt token is computed: a bare prefill
    max_tokens     answer tokens per request (mode chat)
    repeats        timed passes after one untimed warm-up pass over the first 16 requests

Out: {"requests", "prompt_tokens", "output_tokens", "seconds": [per pass], "load_s"}; seconds are around the
generate call alone (the engine built and warm), so they are the engine's own throughput on these requests.
The KV cache is the environment's (VLLM_CPU_KVCACHE_SPACE, set by the caller as for the servers it compares with).
"""

import json
import sys
import time

from vllm import LLM, SamplingParams


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              enforce_eager=job.get("enforce_eager", False),
              # a repeat would find every prompt cached and skip its forward
              enable_prefix_caching=False, seed=0)
    load_s = time.perf_counter() - t0
    if job["mode"] == "chat":
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
        requests = job["messages"]

        def run(reqs):
            return llm.chat(reqs, params, use_tqdm=False)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        requests = [{"prompt_token_ids": ids} for ids in job["token_ids"]]

        def run(reqs):
            return llm.generate(reqs, params, use_tqdm=False)
    run(requests[:16])
    seconds, outs = [], None
    for _ in range(job.get("repeats", 1)):
        t = time.perf_counter()
        outs = run(requests)
        seconds.append(time.perf_counter() - t)
    print(json.dumps({
        "requests": len(outs), "load_s": round(load_s, 1), "seconds": [round(s, 2) for s in seconds],
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
    }), flush=True)


if __name__ == "__main__":
    main()
