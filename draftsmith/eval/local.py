"""eval.engine=local: draftsmith's own speculative decoding of a transformers target.

- the transformers target with an HF DynamicCache (cropped after rejections) and the drafter with
  a DrafterCache (cropped back to the verified prefix before every drafting round);
- vLLM's EAGLE-3 input convention: at a verified prefix the drafter at position i reads the
  target's aux states at i (fused by fc) and token i+1; later draft steps read the drafter's own
  pre-norm output at position +1 each; the aux states are the inputs of the target's decoder
  layers (target.capture.LayerInputs: the states the drafter was trained on) captured during the
  verification forwards;
- how a kind drafts after that is its own (kinds/<kind>/model.py: propose): a chain, P-EAGLE's mask slots, a
  DFlash block over context keys, or whatever the kind's module defines;
- K draft tokens per step (a chain, or one pass), verified in one target forward over K+1 tokens: greedy at
  temperature 0 (the output equals plain greedy decoding), standard speculative sampling above 0
  (Leviathan et al. 2023: accept draft x with probability min(1, p(x)/q(x)), else sample from
  norm(max(0, p - q)); the output is distributed exactly as the target's).

Counting follows vLLM (`SpecDecodingStats.observe_draft`): one draft per verification step, all
K tokens counted as drafted, accepted tokens counted before stop/max_tokens truncation, so
acceptance length tau = 1 + accepted / drafts and acceptance at position j = (drafts whose first
j+1 tokens were accepted) / drafts, as vLLM computes from /metrics.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from transformers import DynamicCache

from draftsmith import kinds
from draftsmith.eval.engine import EngineContext, prompt_seed
from draftsmith.export import load_exported
from draftsmith.target.capture import LayerInputs
from draftsmith.model.eagle3 import DrafterCache
from draftsmith.target import load_target


@dataclass
class Decoded:
    """One prompt decoded, with drafting (SpecDecoder.generate) or without (plain_generate)."""
    tokens: list[int]
    finish_reason: str  # "stop" (an EOS token, kept in tokens) or "length"
    seconds: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K] drafts whose position j was accepted
    draft_seconds: float = 0.0  # of `seconds`, in the drafter's passes (the rest: verification, prefill, sampling)


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
    """Batch-1 speculative decoding of a transformers target with a drafter of any kind (draftsmith/kinds/)."""

    def __init__(self, model, drafter, aux_layers: list[int], num_speculative_tokens: int,
                 temperature: float, eos_ids: set[int]):
        self.model, self.drafter = model, drafter
        self.K, self.temperature, self.eos_ids = num_speculative_tokens, temperature, set(eos_ids)
        self.device = next(model.parameters()).device
        self.layer_inputs = LayerInputs(model, aux_layers)
        # the past-KV keyword is `cache` in transformers >= 5.2x, `past_key_values` before
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        kind = kinds.get(drafter.config.kind)
        kind.check_k(drafter.config, num_speculative_tokens, f"eval.num_speculative_tokens={num_speculative_tokens}")
        self.propose = kind.runtime().propose
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

    def _aux_states(self):
        """[1, T, A*H]: the aux states of the last target forward, fused side by side as fc reads them."""
        return self.layer_inputs.take().flatten(2)

    def _sample_target(self, logits, gen) -> int:
        """One target token from target logits [V]."""
        if self.temperature <= 0:
            return int(logits.argmax())
        p = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        return int(torch.multinomial(p, 1, generator=gen))

    def sample_draft(self, logits, gen):
        """A draft token from drafter logits [Dv] -> (target id, q [V] or None at temperature 0)."""
        if self.temperature <= 0:
            return int(self.draft_ids[int(logits.argmax())]), None
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)  # [Dv]
        i = int(torch.multinomial(probs, 1, generator=gen))
        q = torch.zeros(self.vocab_size)
        q[self.draft_ids.cpu()] = probs
        return int(self.draft_ids[i]), q

    def collect(self, picked: list[tuple[int, object]]):
        """[(target id, q or None)] per draft -> (K target token ids, q [K, V] or None at temperature 0)."""
        qs = [q for _, q in picked]
        return [d for d, _ in picked], (None if qs[0] is None else torch.stack(qs))

    def _draft(self, unread_ids: list[int], unread_aux, first_pos: int, cache, gen):
        """Propose K tokens, the kind's way (kinds/<kind>/model.py: propose).

        unread_ids [T]: the verified tokens the drafter has not read yet, at positions
        first_pos+1 .. first_pos+T; unread_aux [1, T, A*H]: the target's aux states at positions
        first_pos .. first_pos+T-1; cache: the drafter's keys for positions < first_pos.
        Returns (K target token ids, q [K, V] or None at temperature 0).
        """
        return self.propose(self, unread_ids, unread_aux, first_pos, cache, gen)

    def _emit(self, out: list[int], new: list[int], max_tokens: int) -> str | None:
        for t in new:
            out.append(t)
            if t in self.eos_ids:
                return "stop"
            if len(out) >= max_tokens:
                return "length"
        return None

    # -- decoding ------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_tokens: int, gen=None) -> Decoded:
        t0 = time.perf_counter()
        K = self.K
        res = Decoded(tokens=[], finish_reason="length", seconds=0.0, accepted_per_pos=[0] * K)
        with torch.no_grad():
            cache_t, cache_d = self._new_cache(), DrafterCache()
            logits = self._target(prompt_ids, cache_t, all_logits=False)
            aux = self._aux_states()  # [1, n, A*H]
            out = res.tokens
            reason = self._emit(out, [self._sample_target(logits[-1], gen)], max_tokens)
            # the drafter's unread verified tokens start at position 0 (token 1 at position 0)
            unread_ids, unread_aux, first_pos = list(prompt_ids[1:]) + [out[-1]], aux, 0
            while reason is None:
                verified = cache_t.get_seq_length()  # tokens the target has read = position of out[-1]
                t_draft = time.perf_counter()
                drafts, q = self._draft(unread_ids, unread_aux, first_pos, cache_d, gen)
                res.draft_seconds += time.perf_counter() - t_draft
                logits = self._target([out[-1]] + drafts, cache_t, all_logits=True)  # [K+1, V]
                aux = self._aux_states()  # [1, K+1, A*H] at positions verified .. verified+K
                a, nxt = speculative_verify(logits, drafts, q, self.temperature, gen)
                res.num_drafts += 1
                res.num_draft_tokens += K
                res.num_accepted += a
                for j in range(a):
                    res.accepted_per_pos[j] += 1
                # keep the target's keys for out[-1] and the accepted drafts; the drafter's for
                # positions < verified (its keys from there came from its own guesses and are
                # recomputed from the target's states next round, as vLLM does)
                if a < K:
                    cache_t.crop(-(K - a))  # a negative count removes that many from the end
                cache_d.crop(verified)
                new = drafts[:a] + [nxt]
                reason = self._emit(out, new, max_tokens)
                unread_ids, unread_aux, first_pos = new, aux[:, : a + 1], verified
        res.finish_reason = reason
        res.seconds = time.perf_counter() - t0
        return res

    def plain_generate(self, prompt_ids: list[int], max_tokens: int, gen=None) -> Decoded:
        """The baseline: the same target decoding one token per forward with a KV cache."""
        t0 = time.perf_counter()
        out: list[int] = []
        with torch.no_grad():
            cache = self._new_cache()
            logits = self._target(prompt_ids, cache, all_logits=False)
            reason = self._emit(out, [self._sample_target(logits[-1], gen)], max_tokens)
            while reason is None:
                logits = self._target([out[-1]], cache, all_logits=False)
                reason = self._emit(out, [self._sample_target(logits[-1], gen)], max_tokens)
        return Decoded(tokens=out, finish_reason=reason, seconds=time.perf_counter() - t0)

    def close(self) -> None:
        self.layer_inputs.remove()


def render_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of the first user turn, through the chat template with the generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.first_turn_messages(), add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    text = (prompt.system + "\n\n" if prompt.system else "") + prompt.turns[0]
    return list(tokenizer(text).input_ids)


def make_record(index: int, prompt, prompt_ids: list[int], spec: Decoded, base: Decoded | None,
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
        "seconds": round(spec.seconds, 4), "draft_seconds": round(spec.draft_seconds, 4), "tokens_per_s": tps,
        "baseline": None,
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
    eval_cfg, prog = ctx.cfg.eval, ctx.prog
    with prog.busy("loading target"):
        target = load_target(ctx.cfg.target, ctx.cfg.device, ctx.cfg.dtype, ctx.cfg.trust_remote_code, log=prog.log)
    drafter, exported = load_exported(ctx.export_dir, target_info=target.info, embed_weight=target.embed_weight(),
                                      device=target.device, dtype=target.dtype)
    prog.log(f"target {target.info.name} ({target.dtype}, {target.device}), drafter {ctx.export_dir} "
             f"(aux layers {exported['aux_layers']}, draft vocab {exported['config'].draft_vocab_size}), "
             f"K={eval_cfg.num_speculative_tokens}, temperature {eval_cfg.temperature}, "
             f"max_tokens {eval_cfg.max_tokens}")
    tok = target.tokenizer
    dec = SpecDecoder(target.model, drafter, exported["aux_layers"], eval_cfg.num_speculative_tokens,
                      eval_cfg.temperature, target.eos_ids())
    try:
        if ctx.warmup and ctx.todo:
            # first calls pay one-time costs (allocator, kernels); keep them out of the timings
            ids = render_prompt(tok, ctx.todo[0][1])
            dec.generate(ids, min(4, eval_cfg.max_tokens), torch.Generator().manual_seed(0))
            dec.plain_generate(ids, min(4, eval_cfg.max_tokens), torch.Generator().manual_seed(0))
        for index, prompt in ctx.todo:
            ids = render_prompt(tok, prompt)
            seed = prompt_seed(eval_cfg.seed, index)
            spec = dec.generate(ids, eval_cfg.max_tokens, torch.Generator().manual_seed(seed))
            base = (dec.plain_generate(ids, eval_cfg.max_tokens, torch.Generator().manual_seed(seed))
                    if eval_cfg.baseline else None)
            yield make_record(index, prompt, ids, spec, base, tok, eval_cfg.temperature)
    finally:
        dec.close()
