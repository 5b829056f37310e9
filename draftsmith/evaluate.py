"""`eval`: how much does the exported drafter speed up the target?

An *engine* decodes every prompt with speculative decoding (and, for the speedup, plainly) and
yields one record per prompt; this module appends the records to RUN/eval/answers.jsonl as they
come (so `status` counts them and a rerun resumes), then aggregates them into
RUN/eval/report.json, report.md and acceptance.png.

Engines are functions `engine(ctx: EngineContext) -> Iterator[dict]` registered in ENGINES; each
record carries at least RECORD_KEYS. The `vllm` engine sends the prompts to a vLLM server that
serves the target with the exported drafter, one at a time, and takes each prompt's counts from
the server's /metrics before and after it (see vllm_engine). The `local` engine is draftsmith's
own loop:

- the transformers target with an HF DynamicCache (cropped after rejections) and the drafter with
  a DrafterCache (cropped back to the verified prefix before every drafting round);
- vLLM's EAGLE-3 input convention: at a verified prefix the drafter at position i reads the
  target's aux states at i (fused by fc) and token i+1; later draft steps read the drafter's own
  pre-norm output at position +1 each; the aux states come from forward pre-hooks on the target's
  decoder layers (the state *entering* layer k) during the verification forwards;
- a chain of K draft tokens per step, verified in one target forward over K+1 tokens: greedy at
  temperature 0 (the output equals plain greedy decoding), standard speculative sampling above 0
  (Leviathan et al. 2023: accept draft x with probability min(1, p(x)/q(x)), else sample from
  norm(max(0, p - q)); the output is distributed exactly as the target's).

Counting follows vLLM (`SpecDecodingStats.observe_draft`): one draft per verification step, all
K tokens counted as drafted, accepted tokens counted before stop/max_tokens truncation, so
acceptance length tau = 1 + accepted / drafts and acceptance at position j = (drafts whose first
j+1 tokens were accepted) / drafts, as vLLM computes from /metrics.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import matplotlib

matplotlib.use("Agg")  # files only, never a window: before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import torch
from transformers import DynamicCache

from draftsmith import DraftsmithError
from draftsmith.export import CONFIG_FILE, load_exported
from draftsmith.http import OpenAIClient, SampleFailed, normalize_server, root_url, served_models
from draftsmith.model.eagle3 import DrafterCache
from draftsmith.progress import Progress, journal_failures
from draftsmith.prompts import context_tokens_needed, load_prompts
from draftsmith.rundir import RunDir, append_json_line, atomic_path, atomic_write_json, atomic_write_text, read_json_object
from draftsmith.stage import StageBook, upstream
from draftsmith.target import load_target, load_tokenizer, pick_device, pick_dtype, target_info
from draftsmith.vllm_server import VLLMServer, max_model_len, parse_metrics, vllm_python

STAGE = "eval"
ANSWERS, REPORT_JSON, REPORT_MD, PLOT = "answers.jsonl", "report.json", "report.md", "acceptance.png"

# what every engine's per-prompt record holds (more keys are welcome)
RECORD_KEYS = ("id", "index", "prompt_tokens", "output_tokens", "token_ids", "text", "finish_reason",
               "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos", "seconds")


# -------------------------------------------------------------------------------------------------
# Speculative decoding (local engine)


@dataclass
class GenResult:
    tokens: list[int]
    finish_reason: str  # "stop" (an EOS token, kept in tokens) or "length"
    seconds: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K] drafts whose position j was accepted


def decoder_layers(model):
    """The target's list of decoder layers (Llama-like: model.model.layers)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise DraftsmithError(f"target {type(model).__name__}: cannot find its decoder layers (model.layers)")
    return layers


class AuxCapture:
    """Forward pre-hooks that keep the hidden state entering decoder layers `layer_ids` (vLLM's aux
    layer convention = HF hidden_states[k]) while `active`."""

    def __init__(self, model, layer_ids: list[int]):
        layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.active = False
        self.states: dict[int, Any] = {}
        self.handles = [layers[k].register_forward_pre_hook(self._hook(k), with_kwargs=True) for k in self.layer_ids]

    def _hook(self, k: int):
        def hook(module, args, kwargs):
            if self.active:
                self.states[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def take(self):
        """[B, T, len(layer_ids) * H], in layer-id order (the order fc was trained on)."""
        missing = [k for k in self.layer_ids if k not in self.states]
        if missing:
            raise RuntimeError(f"aux hidden states of layers {missing} were not captured")
        out = torch.cat([self.states[k] for k in self.layer_ids], dim=-1)
        self.states = {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def speculative_verify(target_logits, drafts: list[int], draft_probs, temperature: float, gen=None) -> tuple[int, int]:
    """Verify a chain of drafts against the target.

    target_logits [K+1, V]: the target's logits after the last verified token and after each
    draft; drafts: K target token ids; draft_probs [K, V] (the drafter's distribution q each
    draft was sampled from; unused at temperature 0); gen: torch.Generator (CPU).
    Returns (accepted count a in 0..K, the token to emit after the accepted drafts: the target's
    correction at a < K, the bonus token at a = K).
    """
    K = len(drafts)
    if temperature <= 0:
        best = target_logits.argmax(dim=-1).tolist()  # [K+1]
        a = 0
        while a < K and drafts[a] == best[a]:
            a += 1
        return a, best[a]
    p = torch.softmax(target_logits.float().cpu() / temperature, dim=-1)  # [K+1, V]
    q = draft_probs.float().cpu()
    for j, x in enumerate(drafts):
        u = torch.rand((), generator=gen).item()
        if u * float(q[j, x]) < float(p[j, x]):  # u < p/q without dividing by a tiny q
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: rejection has probability 0; guard rounding
            residual = p[j]
        return j, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return K, int(torch.multinomial(p[K], 1, generator=gen))


class SpecDecoder:
    """Batch-1 speculative decoding of a transformers target with an Eagle3Drafter."""

    def __init__(self, model, drafter, aux_layers: list[int], num_speculative_tokens: int,
                 temperature: float, eos_ids: set[int]):
        self.model, self.drafter = model, drafter
        self.K, self.temperature, self.eos_ids = num_speculative_tokens, temperature, set(eos_ids)
        self.device = next(model.parameters()).device
        self.capture = AuxCapture(model, aux_layers)
        # the past-KV keyword is `cache` in transformers >= 5.2x, `past_key_values` before
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.draft_ids = drafter.draft_ids().to(self.device)  # [Dv] target id of each draft id
        self.vocab_size = drafter.config.vocab_size

    # -- pieces --------------------------------------------------------------------------------
    def _new_cache(self):
        return DynamicCache(config=self.model.config)

    def _target(self, ids: list[int], cache, all_logits: bool):
        """Run the target on `ids` after what `cache` holds -> logits [T or 1, V]."""
        x = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=0 if all_logits else 1,
                         **{self._cache_kw: cache})
        return out.logits[0]

    def _pick(self, logits, gen) -> int:
        """One target token from target logits [V]."""
        if self.temperature <= 0:
            return int(logits.argmax())
        p = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        return int(torch.multinomial(p, 1, generator=gen))

    def _pick_draft(self, logits, gen):
        """A draft token from drafter logits [Dv] -> (target id, q [V] or None)."""
        if self.temperature <= 0:
            return int(self.draft_ids[int(logits.argmax())]), None
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)  # [Dv]
        i = int(torch.multinomial(probs, 1, generator=gen))
        q = torch.zeros(self.vocab_size)
        q[self.draft_ids.cpu()] = probs
        return int(self.draft_ids[i]), q

    def _draft(self, tokens: list[int], pend_ids: list[int], pend_aux, pos0: int, cache, gen):
        """Propose K tokens.

        tokens: the sequence so far (prompt + output; the EAGLE drafter needs only what follows,
        but other proposers may use it). pend_ids [T]: tokens at positions pos0+1 .. pos0+T
        (the verified tokens the drafter has not read yet); pend_aux [1, T, 3H]: the target's aux
        states at positions pos0 .. pos0+T-1; cache: the drafter's keys for positions < pos0.
        Returns (K target token ids, q [K, V] or None at temperature 0).
        """
        T = len(pend_ids)
        pos = torch.arange(pos0, pos0 + T, device=self.device)[None]
        dtype = self.drafter.fc.weight.dtype
        logits, h = self.drafter(torch.tensor([pend_ids], device=self.device), pend_aux.to(dtype), pos, cache)
        last_logits, last_h, p = logits[0, -1], h[:, -1:], pos0 + T - 1
        drafts, qs = [], []
        for k in range(self.K):
            d, q = self._pick_draft(last_logits, gen)
            drafts.append(d)
            qs.append(q)
            if k == self.K - 1:
                break
            p += 1  # draft step k+1 reads draft k at the next position, with the drafter's own state
            logits, last_h = self.drafter(torch.tensor([[d]], device=self.device), last_h,
                                          torch.tensor([[p]], device=self.device), cache)
            last_logits = logits[0, -1]
        return drafts, (None if qs[0] is None else torch.stack(qs))

    def _emit(self, out: list[int], new: list[int], max_tokens: int) -> str | None:
        for t in new:
            out.append(t)
            if t in self.eos_ids:
                return "stop"
            if len(out) >= max_tokens:
                return "length"
        return None

    # -- decoding ------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_tokens: int, gen=None) -> GenResult:
        t0 = time.perf_counter()
        K = self.K
        res = GenResult(tokens=[], finish_reason="length", seconds=0.0, accepted_per_pos=[0] * K)
        with torch.no_grad():
            cache_t, cache_d = self._new_cache(), DrafterCache()
            self.capture.active = True
            try:
                logits = self._target(prompt_ids, cache_t, all_logits=False)
                aux = self.capture.take()  # [1, n, 3H]
            finally:
                self.capture.active = False
            out = res.tokens
            reason = self._emit(out, [self._pick(logits[-1], gen)], max_tokens)
            # the drafter's unread verified tokens start at position 0 (token 1 at position 0)
            pend_ids, pend_aux, pos0 = list(prompt_ids[1:]) + [out[-1]], aux, 0
            while reason is None:
                L0 = cache_t.get_seq_length()  # tokens the target has read = position of out[-1]
                drafts, q = self._draft(list(prompt_ids) + out, pend_ids, pend_aux, pos0, cache_d, gen)
                self.capture.active = True
                try:
                    logits = self._target([out[-1]] + drafts, cache_t, all_logits=True)  # [K+1, V]
                    aux = self.capture.take()  # [1, K+1, 3H] at positions L0 .. L0+K
                finally:
                    self.capture.active = False
                a, nxt = speculative_verify(logits, drafts, q, self.temperature, gen)
                res.num_drafts += 1
                res.num_draft_tokens += K
                res.num_accepted += a
                for j in range(a):
                    res.accepted_per_pos[j] += 1
                # keep the target's keys for out[-1] and the accepted drafts; the drafter's for
                # positions < L0 (its keys at L0.. came from its own guesses and are recomputed
                # from the target's states next round, as vLLM does)
                if a < K:
                    cache_t.crop(-(K - a))  # a negative count removes that many from the end
                cache_d.crop(L0)
                new = drafts[:a] + [nxt]
                reason = self._emit(out, new, max_tokens)
                pend_ids, pend_aux, pos0 = new, aux[:, : a + 1], L0
        res.finish_reason = reason
        res.seconds = time.perf_counter() - t0
        return res

    def plain(self, prompt_ids: list[int], max_tokens: int, gen=None) -> GenResult:
        """The baseline: the same target decoding one token per forward with a KV cache."""
        t0 = time.perf_counter()
        out: list[int] = []
        with torch.no_grad():
            cache = self._new_cache()
            logits = self._target(prompt_ids, cache, all_logits=False)
            reason = self._emit(out, [self._pick(logits[-1], gen)], max_tokens)
            while reason is None:
                logits = self._target([out[-1]], cache, all_logits=False)
                reason = self._emit(out, [self._pick(logits[-1], gen)], max_tokens)
        return GenResult(tokens=out, finish_reason=reason, seconds=time.perf_counter() - t0)


# -------------------------------------------------------------------------------------------------
# Engines


@dataclass
class EngineContext:
    run: RunDir
    cfg: Any  # draftsmith.config.Config
    export_dir: Path
    todo: list[tuple[int, Any]]  # (index in the prompt list, Prompt) still to decode
    prog: Any  # draftsmith.progress.Progress
    warmup: bool = True
    fingerprint: str = ""  # the records' fingerprint (an engine's own resumable files carry it too)
    info: dict | None = None  # set by an engine: what the report should say about it (server, version)
    folder: str = "eval"  # the stage folder under the run (the demo's second engine writes eval-vllm/)


def render_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of the first user turn, through the chat template with the generation prompt."""
    messages = ([{"role": "system", "content": prompt.system}] if prompt.system else []) + [
        {"role": "user", "content": prompt.turns[0]}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    text = (prompt.system + "\n\n" if prompt.system else "") + prompt.turns[0]
    return list(tokenizer(text).input_ids)


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for v in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def make_record(index: int, prompt, prompt_ids: list[int], spec: GenResult, base: GenResult | None,
                tokenizer, temperature: float) -> dict:
    tps = len(spec.tokens) / spec.seconds if spec.seconds > 0 else None
    rec = {
        "id": prompt.id, "index": index, "prompt_tokens": len(prompt_ids),
        "output_tokens": len(spec.tokens), "token_ids": spec.tokens,
        "text": tokenizer.decode(spec.tokens, skip_special_tokens=True),
        "finish_reason": spec.finish_reason,
        "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted, "accepted_per_pos": spec.accepted_per_pos,
        "acceptance_length": (1 + spec.num_accepted / spec.num_drafts) if spec.num_drafts else None,
        "seconds": round(spec.seconds, 4), "tokens_per_s": tps, "baseline": None,
    }
    if base is not None:
        rec["baseline"] = {
            "output_tokens": len(base.tokens), "seconds": round(base.seconds, 4),
            "tokens_per_s": len(base.tokens) / base.seconds if base.seconds > 0 else None,
            "finish_reason": base.finish_reason,
            # at temperature 0 speculative decoding must reproduce plain greedy decoding
            "same_tokens": base.tokens == spec.tokens if temperature <= 0 else None,
        }
    return rec


def local_engine(ctx: EngineContext) -> Iterator[dict]:
    """draftsmith's own speculative decoding with the transformers target (see module doc)."""

    ec, prog = ctx.cfg.eval, ctx.prog
    with prog.busy("loading target"):
        target = load_target(ctx.cfg.target, ctx.cfg.device, ctx.cfg.dtype, ctx.cfg.trust_remote_code, log=prog.log)
    drafter, dinfo = load_exported(ctx.export_dir, target_info=target.info, embed_weight=target.embed_weight(),
                                   device=target.device, dtype=target.dtype)
    prog.log(f"target {target.info.name} ({target.dtype}, {target.device}), drafter {ctx.export_dir} "
             f"(aux layers {dinfo['aux_layers']}, draft vocab {dinfo['config'].draft_vocab_size}), "
             f"K={ec.num_speculative_tokens}, temperature {ec.temperature}, max_tokens {ec.max_tokens}")
    trained = (dinfo.get("draftsmith") or {}).get("ttt_steps")
    if trained and ec.num_speculative_tokens > trained:
        prog.log(f"note: K={ec.num_speculative_tokens} exceeds the {trained} steps the drafter was trained to draft")
    tok = target.tokenizer
    dec = SpecDecoder(target.model, drafter, dinfo["aux_layers"], ec.num_speculative_tokens,
                      ec.temperature, eos_ids(target.model, tok))
    try:
        if ctx.warmup and ctx.todo:
            # first calls pay one-time costs (allocator, kernels); keep them out of the timings
            ids = render_prompt(tok, ctx.todo[0][1])
            dec.generate(ids, min(4, ec.max_tokens), torch.Generator().manual_seed(0))
            dec.plain(ids, min(4, ec.max_tokens), torch.Generator().manual_seed(0))
        for index, prompt in ctx.todo:
            ids = render_prompt(tok, prompt)
            # one seed per prompt: a resumed run samples what an uninterrupted one would
            seed = ec.seed * 1_000_003 + index
            spec = dec.generate(ids, ec.max_tokens, torch.Generator().manual_seed(seed))
            base = dec.plain(ids, ec.max_tokens, torch.Generator().manual_seed(seed)) if ec.baseline else None
            yield make_record(index, prompt, ids, spec, base, tok, ec.temperature)
    finally:
        dec.capture.remove()


# -- the vLLM engine -------------------------------------------------------------------------------
#
# vLLM counts in the API server process: after every engine step the output handler pushes the
# step's tokens to the request queues and then records the step's SpecDecodingStats in the
# Prometheus counters, with no await in between (vllm/v1/engine/async_llm.py, output_handler), so
# by the time a response arrives /metrics already holds its last step. With one request in
# flight at a time, the counter deltas around a request are exactly that request's counts.

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
BASELINE_FILE = "vllm_baseline.jsonl"  # plain-decoding results of the baseline server, per prompt
SERVER_LOG, BASELINE_LOG = "vllm.log", "vllm_baseline.log"
VLLM_ONLY = ("server", "vllm_args")  # eval settings only the vllm engine reads
ENGINE_INFO = "engine.json"  # what the engine reports about itself (server args, versions)


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


def chat_messages(prompt) -> list[dict]:
    """The same conversation render_prompt() gives the local engine: system, first user turn."""
    return ([{"role": "system", "content": prompt.system}] if prompt.system else []) + [
        {"role": "user", "content": prompt.turns[0]}]


class VLLMChat:
    """One vLLM server as the vllm engine uses it, through the one HTTP client (draftsmith/http.py):
    chat completions one at a time, timed, and the speculative-decoding counters around them.
    Nothing is retried: a request sent twice would move the counters for two."""

    def __init__(self, url: str, timeout_s: float):
        self.server = normalize_server(url, "eval.server")
        self.url = root_url(self.server)  # root: /metrics, /version, /health
        self.http = OpenAIClient([self.server], timeout_s=timeout_s)
        self.model: str | None = None

    def connect(self) -> "VLLMChat":
        try:
            models, _ = self.http.request("GET", "/models", server=self.server, parse=served_models)
        except SampleFailed as e:
            raise DraftsmithError(f"eval.server={self.url}: not reachable as a vLLM server ({e.error})") from None
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
            raise DraftsmithError(f"eval: {self.url}/metrics: " + ("no answer" if r is None else f"HTTP {r.status_code}"))
        return spec_counters(r.text)

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, seed: int, what: str) -> tuple[dict, float]:
        """-> (the response's first choice with `usage` added, wall seconds of the request)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "return_token_ids": True}
        t0 = time.perf_counter()
        try:
            data, _ = self.http.request("POST", "/chat/completions", body, server=self.server)
        except SampleFailed as e:
            raise DraftsmithError(f"eval: {what}: {e.error}") from None
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
    """`vllm serve` arguments besides --model/--host/--port: dtype, eval.vllm_args, the drafter."""
    args = ["--dtype", "bfloat16" if cfg.dtype == "auto" else cfg.dtype, *cfg.eval.vllm_args]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    return args


@contextlib.contextmanager
def _server(ctx: EngineContext, model_dir: str, args: list[str], log_name: str, python, what: str):
    """A VLLMServer started under a `busy` phase (the stage heartbeats while vLLM loads)."""
    cfg = ctx.cfg
    needed = context_tokens_needed([p for _, p in ctx.todo], load_tokenizer(model_dir, cfg.trust_remote_code),
                                   cfg.eval.max_tokens)
    srv = VLLMServer(model_dir, extra_args=args, log_path=ctx.run.stage_dir(ctx.folder) / log_name, python=python,
                     max_model_len=max_model_len(model_dir, needed), startup_timeout_s=cfg.vllm_startup_timeout_s,
                     say=ctx.prog.log)
    with ctx.prog.busy(f"starting vLLM ({what})"):
        srv.start()
    ctx.prog.log(f"vLLM ({what}) ready at {srv.url} in {srv.startup_s:.0f}s; log {srv.log_path}")
    try:
        yield srv
    finally:
        srv.stop()


def _warm_up(client: VLLMChat, ctx: EngineContext) -> None:
    # first requests pay one-time costs (kernels, allocator); keep them out of the timings
    if ctx.warmup and ctx.todo:
        client.chat(chat_messages(ctx.todo[0][1]), min(4, ctx.cfg.eval.max_tokens), ctx.cfg.eval.temperature, 0, "warm-up")


def vllm_engine(ctx: EngineContext) -> Iterator[dict]:
    """Speculative decoding in a vLLM server (see the note above SPEC_DRAFTS).

    Without eval.server it starts `vllm serve TARGET --speculative-config {model: RUN/export,
    method: eagle3, num_speculative_tokens: K}` from the vLLM environment (installing it when
    missing), and, for eval.baseline, first the same server without the drafter, whose per-prompt
    results go to eval/vllm_baseline.jsonl (so a resumed run does not redo them). Prompts go one
    at a time as chat completions; /metrics is read around each one."""
    cfg, ec, prog, K = ctx.cfg, ctx.cfg.eval, ctx.prog, ctx.cfg.eval.num_speculative_tokens
    d = ctx.run.stage_dir(ctx.folder)
    timeout_s = 600.0 + ec.max_tokens  # a slow CPU decodes tens of tokens per second, a loaded one less
    seeds = {index: ec.seed * 1_000_003 + index for index, _ in ctx.todo}  # as the local engine
    # what an interrupted attempt learnt (its baseline server, when the baseline is complete now)
    info: dict[str, Any] = {**_read_engine_info(d / ENGINE_INFO, ctx.fingerprint), "engine": "vllm", "concurrency": 1}
    info.pop("fingerprint", None)
    ctx.info = info

    baseline: dict[str, dict] = {}
    if ec.baseline and ec.server:
        prog.log("eval.server is set: no baseline (the server's settings are unknown, so a plain server "
                 "cannot be started to match); speedup is not reported")
    elif ec.baseline:
        baseline = _read_baseline(d / BASELINE_FILE, ctx.fingerprint)
    spec_cfg = {"model": str(ctx.export_dir), "method": "eagle3", "num_speculative_tokens": K}
    python = None
    if not ec.server:
        python = vllm_python(cfg.vllm_python, log=prog.log)
        tdir = target_info(cfg.target, cfg.trust_remote_code).path
        trained = (json.loads((ctx.export_dir / "config.json").read_text()).get("draftsmith") or {}).get("ttt_steps")
        if trained and K > trained:
            prog.log(f"note: K={K} exceeds the {trained} steps the drafter was trained to draft")

    # 1. the baseline: the same server without drafting, the same requests
    missing = [(i, p) for i, p in ctx.todo if p.id not in baseline]
    if ec.baseline and not ec.server and missing:
        _vllm_baseline(ctx, missing, tdir, python, timeout_s, seeds, baseline)

    # 2. speculative decoding
    if ec.server:
        srv_ctx = contextlib.nullcontext(None)
    else:
        srv_ctx = _server(ctx, tdir, vllm_server_args(cfg, spec_cfg), SERVER_LOG, python, f"drafter, K={K}")
    with srv_ctx as srv:
        client = VLLMChat(ec.server or srv.url, timeout_s).connect()
        try:
            _check_drafting(client, K)
            info["server"] = {"url": ec.server, "model": client.model, "vllm_version": client.version(),
                              "args": srv.command()[1:] if srv else None,
                              "startup_s": round(srv.startup_s, 1) if srv else None,
                              "log": SERVER_LOG if srv else None}
            drafter = ctx.export_dir if srv else "(whatever the server was started with)"
            prog.log(f"vLLM {info['server']['vllm_version']} serving {client.model} with drafter {drafter}, "
                     f"K={K}, temperature {ec.temperature}, max_tokens {ec.max_tokens}")
            _warm_up(client, ctx)
            for index, prompt in ctx.todo:
                yield _vllm_record(client, ctx, index, prompt, seeds[index], baseline.get(prompt.id))
        finally:
            client.close()


def _vllm_baseline(ctx: EngineContext, missing: list, tdir: str, python, timeout_s: float, seeds: dict[int, int],
                   baseline: dict[str, dict]) -> None:
    """Plain decoding of the `missing` prompts in a vLLM server without the drafter; each result
    is appended to eval/vllm_baseline.jsonl (a resumed run does not redo it) and to `baseline`."""
    ec, prog, d = ctx.cfg.eval, ctx.prog, ctx.run.stage_dir(ctx.folder)
    with _server(ctx, tdir, vllm_server_args(ctx.cfg, None), BASELINE_LOG, python, "baseline, no drafting") as srv:
        client = VLLMChat(srv.url, timeout_s).connect()
        ctx.info["baseline_server"] = {"args": srv.command()[1:], "vllm_version": client.version(),
                                       "startup_s": round(srv.startup_s, 1), "log": BASELINE_LOG}
        try:
            _warm_up(client, ctx)
            for n, (index, prompt) in enumerate(missing):
                choice, sec = client.chat(chat_messages(prompt), ec.max_tokens, ec.temperature, seeds[index],
                                          f"prompt {prompt.id} (baseline)")
                b = {"id": prompt.id, **_answer_fields(choice, sec), "fingerprint": ctx.fingerprint}
                append_json_line(d / BASELINE_FILE, b, fsync=True)
                baseline[prompt.id] = b
                prog.log(f"baseline {n + 1}/{len(missing)} {prompt.id}: {b['output_tokens']} tokens, "
                         f"{fmt_value(b['tokens_per_s'], '.1f')} tok/s")
        finally:
            client.close()


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


def _vllm_record(client: VLLMChat, ctx: EngineContext, index: int, prompt, seed: int, base: dict | None) -> dict:
    """One prompt with drafting: its answer, and its counts from the counters before and after it."""
    ec, K = ctx.cfg.eval, ctx.cfg.eval.num_speculative_tokens
    before = client.counters()
    choice, sec = client.chat(chat_messages(prompt), ec.max_tokens, ec.temperature, seed, f"prompt {prompt.id}")
    ans = _answer_fields(choice, sec)
    counts = counter_delta(before, client.counters(), K)
    if not counts_consistent(counts, ans["output_tokens"], K):
        time.sleep(0.5)  # not expected (see above); give a late counter update a chance
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
            ec.temperature <= 0 and ans["token_ids"] is not None) else None
    return rec


def _read_baseline(path: Path, fingerprint: str) -> dict[str, dict]:
    """Baseline results of this fingerprint by prompt id; a cut last line or lines of another
    fingerprint are dropped from the file (so that the next append starts a clean line)."""
    out, dirty = _read_answers(path, fingerprint)
    if dirty:
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out.values()))
    return out


ENGINES: dict[str, Callable[[EngineContext], Iterator[dict]]] = {"local": local_engine, "vllm": vllm_engine}


# -------------------------------------------------------------------------------------------------
# Aggregation and the report


def aggregate(records: list[dict], K: int) -> dict:
    drafts = sum(r["num_drafts"] for r in records)
    accepted = sum(r["num_accepted_tokens"] for r in records)
    per_pos = [sum(r["accepted_per_pos"][j] for r in records) for j in range(K)]
    tokens = sum(r["output_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    with_base = [r for r in records if r.get("baseline")]
    b_tokens = sum(r["baseline"]["output_tokens"] for r in with_base)
    b_seconds = sum(r["baseline"]["seconds"] for r in with_base)
    tps = tokens / seconds if seconds > 0 else None
    b_tps = b_tokens / b_seconds if with_base and b_seconds > 0 else None
    same = [r["baseline"]["same_tokens"] for r in with_base if r["baseline"].get("same_tokens") is not None]
    return {
        "prompts": len(records),
        "acceptance_length": (1 + accepted / drafts) if drafts else None,
        "acceptance_per_position": [c / drafts for c in per_pos] if drafts else [None] * K,
        "tokens_per_s": tps,
        "baseline_tokens_per_s": b_tps,
        "speedup": tps / b_tps if tps and b_tps else None,
        "num_drafts": drafts,
        "num_draft_tokens": sum(r["num_draft_tokens"] for r in records),
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "baseline_output_tokens": b_tokens if with_base else None,
        "baseline_seconds": round(b_seconds, 3) if with_base else None,
        "greedy_same_as_baseline": (sum(same), len(same)) if same else None,
        "finish_reasons": {k: sum(1 for r in records if r["finish_reason"] == k)
                           for k in sorted({r["finish_reason"] for r in records})},
    }


def read_train_metrics(path: Path) -> list[dict]:
    """[{step, loss: [per TTT step], acc: [per TTT step]}] from train/metrics.jsonl; lines without a
    step are skipped. `loss` and `acc` may be numbers or lists (train writes lists), or `loss_{k}` /
    `acc_{k}` keys."""
    def per_step(rec: dict, name: str) -> list[float] | None:
        v = rec.get(name)
        if isinstance(v, (int, float)):
            return [float(v)]
        if isinstance(v, list):
            return [float(x) if isinstance(x, (int, float)) else float("nan") for x in v]
        found = sorted((int(m.group(1)), float(x)) for k, x in rec.items()
                       if (m := re.fullmatch(rf"{name}_?(\d+)", k)) and isinstance(x, (int, float)))
        return [x for _, x in found] or None

    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), (int, float)):
            continue
        rows.append({"step": rec["step"], "loss": per_step(rec, "loss"), "acc": per_step(rec, "acc")})
    return rows


def write_plot(path: Path, report: dict, train_rows: list[dict]) -> None:
    panels = 1 + (2 if train_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    acc = [a or 0.0 for a in report["acceptance_per_position"]]
    ax.bar(range(1, len(acc) + 1), acc, color="tab:blue")
    for i, a in enumerate(acc):
        ax.text(i + 1, a + 0.01, f"{a:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(1, len(acc) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafts accepted up to here")
    tau = report.get("acceptance_length")
    ax.set_title(f"{report['engine']}: K={report['num_speculative_tokens']}, T={report['temperature']}, "
                 f"tau={tau:.2f}" if tau else f"{report['engine']}: no drafts")
    if train_rows:
        for ax, key, title in ((axes[0][1], "loss", "training loss per TTT step"),
                               (axes[0][2], "acc", "training accuracy per TTT step")):
            n = max((len(r[key]) for r in train_rows if r[key]), default=0)
            for k in range(n):
                pts = [(r["step"], r[key][k]) for r in train_rows if r[key] and len(r[key]) > k]
                ax.plot([s for s, _ in pts], [v for _, v in pts], label=f"TTT step {k}")
            ax.set_xlabel("optimizer step")
            ax.set_title(title)
            if n:
                ax.legend()
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)


def fmt_value(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def report_markdown(report: dict) -> str:
    acc = report["acceptance_per_position"]
    same = report.get("greedy_same_as_baseline")
    lines = [
        f"# draftsmith eval: {report['target']}",
        "",
        f"Engine `{report['engine']}`, K = {report['num_speculative_tokens']}, temperature {report['temperature']}, "
        f"max {report['max_tokens']} tokens, {report['prompts']} prompts from `{report['prompts_source']}`, "
        f"dtype {report.get('dtype')}.",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| acceptance length (tau = 1 + accepted/drafts) | {fmt_value(report['acceptance_length'])} |",
        f"| acceptance per position | {', '.join(fmt_value(a) for a in acc)} |",
        f"| tokens/s with drafting | {fmt_value(report['tokens_per_s'], '.1f')} |",
        f"| tokens/s plain decoding | {fmt_value(report['baseline_tokens_per_s'], '.1f')} |",
        f"| speedup | {fmt_value(report['speedup'])} |",
        f"| drafts / accepted tokens | {report['num_drafts']} / {report['num_accepted_tokens']} |",
        f"| output tokens | {report['output_tokens']} |",
    ]
    if same:
        lines.append(f"| greedy output identical to plain decoding | {same[0]} of {same[1]} prompts |")
    for key, what in (("server", "Server"), ("baseline_server", "Baseline server (no drafting)")):
        srv = report.get(key)
        if srv:
            where = f"`{srv['url']}`" if srv.get("url") else "started by draftsmith"
            args = f", arguments `{' '.join(srv['args'])}`" if srv.get("args") else ""
            log = f", log `{srv['log']}`" if srv.get("log") else ""
            lines += ["", f"{what}: vLLM {srv.get('vllm_version')}, {where}{args}{log}; one request at a time."]
    lines += ["", f"Plot: `{PLOT}`. Per-prompt results: `{ANSWERS}`.", ""]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------
# The stage


def _read_answers(path: Path, fingerprint: str) -> tuple[dict[str, dict], bool]:
    """Finished records of this fingerprint by prompt id, and whether the file must be rewritten
    (a cut last line or records of another fingerprint)."""
    done: dict[str, dict] = {}
    dirty = False
    if not path.is_file():
        return done, False
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dirty = True  # cut by a crash mid-write
            continue
        if not isinstance(rec, dict) or rec.get("fingerprint") != fingerprint:
            dirty = True
            continue
        done[rec["id"]] = rec
    return done, dirty


def _read_engine_info(path: Path, fingerprint: str) -> dict:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) and info.get("fingerprint") == fingerprint else {}


@journal_failures(STAGE)
def run_eval(run: RunDir, cfg, *, warmup: bool = True, folder: str = STAGE) -> dict:
    """Decode eval.prompts with eval.engine and write RUN/eval/ (answers, report, plot).
    Resumes from answers.jsonl when the settings and the export are unchanged. Returns the manifest.
    `folder` names the stage folder (the demo evaluates a second engine into eval-vllm/)."""
    ec = cfg.eval
    if ec.engine not in ENGINES:
        raise DraftsmithError(f"eval.engine={ec.engine}: not available in this build; use one of {', '.join(ENGINES)}")
    run.ensure()
    started = time.time()
    export_manifest, export_dir = drafter_source(run, ec.drafter)
    cj = read_json_object(export_dir / CONFIG_FILE)
    info = target_info(cfg.target, cfg.trust_remote_code)
    ds = cj.get("draftsmith") or {}
    if ds.get("target_fingerprint") not in (None, info.fingerprint):
        raise DraftsmithError(f"{export_dir / CONFIG_FILE}: the drafter was exported for target {ds.get('target')} "
                              f"(fingerprint {ds.get('target_fingerprint')}), but target is {info.name} "
                              f"(fingerprint {info.fingerprint})")
    prompts = load_prompts(ec.prompts, limit=ec.limit, offset=ec.offset, first_turn_only=True)
    if not prompts:
        raise DraftsmithError(f"eval.prompts: no prompts in {ec.prompts} (offset {ec.offset}, limit {ec.limit})")

    settings = {**cfg.section(STAGE), "dtype": cfg.dtype, "device": cfg.device}
    if ec.engine == "local":  # the server settings do not change what the local engine computes
        settings["eval"] = {k: v for k, v in settings["eval"].items() if k not in VLLM_ONLY}
    book = StageBook(run, folder, cfg, settings=settings, upstream={"export": export_manifest}, target=info,
                     started=started)
    # a per-prompt record stays valid when only the selection of prompts changes (a larger
    # limit reuses the answers already written)
    record_settings = {**settings, "eval": {k: v for k, v in settings["eval"].items() if k not in ("limit", "offset")}}
    record_fp = replace(book, settings=record_settings).fingerprint
    if (old := book.up_to_date(outputs_ok=(run.path / folder / REPORT_JSON).is_file())) is not None:
        return old  # up to date: same export, target, prompts and settings (`run` skips it)
    book.begin()
    d = run.stage_dir(folder)
    done = _resume_answers(d / ANSWERS, record_fp, prompts)

    with Progress(run, folder, total=len(prompts), unit="prompts", done=len(done), stall_after_s=cfg.stall_after_s) as prog:
        if done:
            prog.log(f"resuming: {len(done)} of {len(prompts)} prompts already in {d / ANSWERS}")
        todo = [(i, p) for i, p in enumerate(prompts) if p.id not in done]
        if todo:
            ctx = EngineContext(run=run, cfg=cfg, export_dir=export_dir, todo=todo, prog=prog, warmup=warmup,
                                fingerprint=record_fp, folder=folder)
            _decode(ctx, d / ANSWERS, done)
            if ctx.info is not None:
                atomic_write_json(d / ENGINE_INFO, {**ctx.info, "fingerprint": record_fp})
        records = [done[p.id] for p in prompts]
        report = _write_report(run, cfg, d, records, info, cj, export_manifest, record_fp)
        prog.log(f"tau {fmt_value(report['acceptance_length'])}, acceptance per position "
                 f"[{', '.join(fmt_value(a) for a in report['acceptance_per_position'])}], "
                 f"{fmt_value(report['tokens_per_s'], '.1f')} tok/s vs {fmt_value(report['baseline_tokens_per_s'], '.1f')} plain "
                 f"(speedup {fmt_value(report['speedup'])})")
    return book.finish(
        counts={"done": len(records), "total": len(prompts), "unit": "prompts"},
        inputs={"export": export_manifest.get("fingerprint"), "prompts": ec.prompts},
        outputs=[ANSWERS, REPORT_JSON, REPORT_MD, PLOT] + (
            [n for n in (ENGINE_INFO, SERVER_LOG, BASELINE_LOG, BASELINE_FILE) if (d / n).is_file()]
            if ec.engine == "vllm" else []),
        extra={"report": {k: report[k] for k in ("acceptance_length", "acceptance_per_position", "tokens_per_s",
                                                 "baseline_tokens_per_s", "speedup")}},
    )


def drafter_source(run: RunDir, drafter: str | None) -> tuple[dict, Path]:
    """(the manifest eval depends on, the drafter folder): RUN/export's, or for eval.drafter a
    folder from elsewhere (another toolkit's speculators-format drafter), fingerprinted by the
    sha256 of its config.json and weight files so that a changed drafter is evaluated again."""
    if drafter is None:
        return upstream(run, "export", by="draftsmith eval"), run.path / "export"
    folder = Path(drafter).expanduser().resolve()
    weights = sorted(folder.glob("*.safetensors"))
    if not (folder / CONFIG_FILE).is_file() or not weights:
        raise DraftsmithError(f"eval.drafter={drafter}: not a drafter folder (needs {CONFIG_FILE} and *.safetensors)")
    h = hashlib.sha256()
    for f in [folder / CONFIG_FILE, *weights]:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return {"fingerprint": h.hexdigest(), "drafter": str(folder)}, folder


def _resume_answers(answers: Path, record_fp: str, prompts: list) -> dict[str, dict]:
    """The answers already decoded with these settings, by prompt id; answers.jsonl is rewritten to
    hold exactly this selection of prompts (status counts its lines)."""
    done, dirty = _read_answers(answers, record_fp)
    ids = {p.id for p in prompts}
    if any(k not in ids for k in done):
        done, dirty = {k: v for k, v in done.items() if k in ids}, True
    if dirty:
        atomic_write_text(answers, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done.values()))
    return done


def _decode(ctx: "EngineContext", answers: Path, done: dict[str, dict]) -> None:
    """Run the engine over ctx.todo; each record is appended to answers.jsonl (fsynced) as it comes."""
    engine = ctx.cfg.eval.engine
    for rec in ENGINES[engine](ctx):
        missing = [k for k in RECORD_KEYS if k not in rec]
        if missing:
            raise RuntimeError(f"engine {engine} returned a record without {missing}")
        rec = {**rec, "engine": engine, "fingerprint": ctx.fingerprint}
        append_json_line(answers, rec, fsync=True)
        done[rec["id"]] = rec
        ctx.prog.log(f"{rec['id']}: {rec['output_tokens']} tokens, tau {fmt_value(rec.get('acceptance_length'))}, "
                     f"{fmt_value(rec.get('tokens_per_s'), '.1f')} tok/s"
                     + (f" (plain {fmt_value(rec['baseline']['tokens_per_s'], '.1f')})" if rec.get("baseline") else ""))
        ctx.prog.advance(1)


def _write_report(run: RunDir, cfg, d: Path, records: list[dict], info, cj: dict, export_manifest: dict,
                  record_fp: str) -> dict:
    """report.json, report.md and plot.png from the records; returns the report."""
    ec = cfg.eval
    # what the engine said about itself, also when this rerun had nothing left to decode
    engine_info = _read_engine_info(d / ENGINE_INFO, record_fp)
    device = pick_device(cfg.device)
    report = {
        "engine": ec.engine, "num_speculative_tokens": ec.num_speculative_tokens, "temperature": ec.temperature,
        **aggregate(records, ec.num_speculative_tokens),
        "max_tokens": ec.max_tokens, "prompts_source": ec.prompts, "offset": ec.offset, "limit": ec.limit,
        "target": info.name, "target_fingerprint": info.fingerprint,
        # what "auto" resolved to on this machine
        "dtype": str(pick_dtype(cfg.dtype, device)).removeprefix("torch."), "device": str(device),
        "drafter": str(Path(ec.drafter).expanduser().resolve() if ec.drafter else run.path / "export"), "aux_layers": cj.get("eagle_aux_hidden_state_layer_ids"),
        "export_fingerprint": export_manifest.get("fingerprint"), "seed": ec.seed,
    }
    if ec.engine == "vllm":
        # what the server ran with; dtype is what it was asked for (None: a server of eval.server)
        report.update({"dtype": None if ec.server else vllm_server_args(cfg, None)[1], "device": "vllm",
                       "concurrency": 1, "server": engine_info.get("server"),
                       "baseline_server": engine_info.get("baseline_server"),
                       "vllm_version": (engine_info.get("server") or {}).get("vllm_version")})
    atomic_write_json(d / REPORT_JSON, report)
    atomic_write_text(d / REPORT_MD, report_markdown(report))
    write_plot(d / PLOT, report, read_train_metrics(run.path / "train" / "metrics.jsonl"))
    return report
