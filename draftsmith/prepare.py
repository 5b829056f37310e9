"""The `prepare` stage: token ids and a loss mask per generated conversation.

Each record of `generate/samples.jsonl` is rendered with the target's own chat template and
tokenized; the loss mask is 1 on the tokens the target itself produced in each assistant turn:
its reasoning (when it gave one), its answer and the end-of-turn token that closed the turn
(`<|im_end|>` for ChatML: the drafter must learn to predict the end of a turn too). The role
header (`<|im_start|>assistant\\n`), system and user turns, and the separators between turns
get 0.

How assistant spans are found, without `{% generation %}` markers (SmolLM2's template has none):
the conversation is rendered whole, and again up to each assistant message with
`add_generation_prompt=True`; that prefix render must be a prefix of the whole render, and the
assistant's text starts where it ends. The message's content (and reasoning) must then appear
right there, as the model wrote it (surrounding whitespace aside): a template that drops or
rewrites assistant content is an error, not a silent mis-mask. Tokens are mapped to characters
with the tokenizer's offsets; when a BPE merge straddles a span boundary, the text is tokenized
piece by piece at the boundaries instead (the way the model saw it: prompt tokens, then its own).
A tokenizer without offsets (Python tokenizers such as Kimi's tiktoken one) is tokenized piece by
piece always, checked against the whole text's ids.

Reasoning: a template that renders a `reasoning_content` / `reasoning` / `thinking` field gets it
in that field (found by rendering a probe: Qwen3 `reasoning_content`, gpt-oss `thinking` as its
analysis channel); for any other template the reasoning is written into the content as
`<think>\\n{reasoning}\\n</think>\\n\\n{content}`. Templates that keep reasoning only for the last
turn (Qwen3, gpt-oss) drop it from earlier turns, as they do at inference; those turns are counted
(`reasoning_dropped_by_template`). Templates that drop it from the last turn too (DeepSeek-R1 and
V3.1 strip everything up to `</think>`, Kimi-K2-Thinking renders the last answer as history with an
empty `<think></think>`) get the last turn spliced the way the target produced it: the generation
prompt (rendered with `thinking`/`enable_thinking` on, so V3.1's ends in `<think>`), then the reasoning
in the think block that prompt opened or the template's own empty block shows, then the answer and
the template's end of turn (`reasoning_spliced`). Each assistant turn with reasoning is counted
(`reasoning_turns`), and so is each whose reasoning ends up inside the prepared ids and the loss
mask (`reasoning_kept`): their ratio is the reasoning capture rate of the manifest and the log.

Output: `prepare/samples.jsonl`, one line per kept sample in generate's order (see
docs/run-directory.md), appended and flushed as each one is done. A rerun with the same
fingerprint skips the ids already there (a line cut by a crash is dropped first); a different
fingerprint starts the file afresh. `prepare/state.json` records which fingerprint the file
belongs to.
"""


import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from draftsmith import DraftsmithError
from draftsmith.journal import fmt_count
from draftsmith.prepared_format import SAMPLES, STAGE, check_prepared_line, prepared_record
from draftsmith.progress import log
from draftsmith.rundir import (RunDir, append_bytes, atomic_write_json, file_sha256, jsonl_text, naming_full_disk,
                              repair_jsonl_tail)
from draftsmith.stage import StageBook, check_target, stage_run, upstream
from draftsmith.target import chat_template_sha256, load_tokenizer, target_info

# Bump when the way ids or masks are built changes: old prepared data then no longer matches.
PREPARE_VERSION = 1
# Characters a template may put between the generation prompt and the content (e.g. "<think>\n\n</think>\n\n").
MAX_GAP = 64
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
THINK_FORMAT = "<think>\n{reasoning}\n</think>\n\n{content}"
ROLES = ("system", "user", "assistant")
NOTE_KEYS = ("reasoning_dropped_by_template", "turns_without_end_token", "boundary_retokenized", "boundary_overlap",
             "reasoning_turns", "reasoning_kept", "reasoning_spliced", "generation_prompt_not_in_history")
# Chat-template switches that put a template in thinking mode (Qwen3 `enable_thinking`, DeepSeek-V3.1
# `thinking`): used only for the generation prompt of a last turn whose reasoning is spliced in.
THINKING_KWARGS = {"enable_thinking": True, "thinking": True}



class TemplateProblem(DraftsmithError):
    """The chat template cannot yield a loss mask for a conversation (the caller adds where)."""


# -------------------------------------------------------------------------------------------------
# Encoding one conversation


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    assistant_turns: int = 0
    notes: dict[str, int] = field(default_factory=dict)  # counters from NOTE_KEYS, only when non-zero


class ChatEncoder:
    """Renders conversations with a target's chat template and builds the loss mask."""

    def __init__(self, tokenizer, target_name: str, end_tokens: list[str]):
        if not getattr(tokenizer, "chat_template", None):
            raise DraftsmithError(
                f"target {target_name}: its tokenizer has no chat template, so prepare cannot render "
                f"conversations the way the target sees them (add a chat_template to the target folder)")
        self.tok = tokenizer
        self.target = target_name
        # Longest first, so that a token is never matched by a shorter one it starts with.
        self.end_tokens = sorted({t for t in end_tokens if t}, key=len, reverse=True)
        self.reasoning_key = self._probe_reasoning_key()
        self.think_slot = self.reasoning_key is None and self._probe_think_slot()

    @classmethod
    def for_target(cls, tokenizer, info) -> "ChatEncoder":
        return cls(tokenizer, info.name, end_of_turn_tokens(tokenizer, info.identity))

    def _render(self, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja2 TemplateError, or raise_exception() inside the template
            raise TemplateProblem(f"the chat template of {self.target} fails on it ({type(e).__name__}: {e})") from None
        if not isinstance(text, str):
            raise TemplateProblem(f"the chat template of {self.target} did not render text (got {type(text).__name__})")
        return text

    def _probe_reasoning_key(self) -> str | None:
        """The message field this template renders reasoning from, if any."""
        marker = "draftsmith-reasoning-probe-7f3a"
        for key in REASONING_KEYS:
            msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", key: marker}]
            try:
                if marker in self._render(msgs, False):
                    return key
            except TemplateProblem:
                return None
        return None

    def _probe_think_slot(self) -> bool:
        """Whether the template writes its own (empty) think block before every answer it renders
        (Kimi-K2-Thinking `<think></think>`, DeepSeek-V3.1 `</think>`): reasoning then cannot go into
        the content as a <think> block (it would be rendered twice); the last turn is spliced instead."""
        try:
            text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], False)
        except TemplateProblem:
            return False
        a = text.find("hi")
        b = text.find("hello", a + 2)
        return 0 <= a < b and "</think>" in text[a + 2:b]

    def _template_message(self, m: dict) -> dict:
        out = {"role": m["role"], "content": m["content"]}
        reasoning = m.get("reasoning")
        if m["role"] == "assistant" and reasoning:
            if self.reasoning_key:
                out[self.reasoning_key] = reasoning
            elif not self.think_slot:
                out["content"] = THINK_FORMAT.format(reasoning=reasoning.strip("\n"), content=m["content"])
        return out

    def encode(self, messages: list[dict], finish_reasons: list[str] | None = None) -> Encoded:
        """Token ids of the rendered conversation and its loss mask (1 = a token the target wrote).

        `finish_reasons` (one per assistant turn): a turn cut by the token limit ("length") did not
        end with an end-of-turn token, so the one the template appends is not trained on.
        """
        tmsgs = [self._template_message(m) for m in messages]
        full = self._render(tmsgs, False)
        spans: list[tuple[int, int]] = []  # [start, end) character ranges of assistant output
        kept: list[tuple[int, int]] = []  # character ranges of reasoning that the rendered text holds
        notes: dict[str, int] = {}

        def note(key: str) -> None:
            notes[key] = notes.get(key, 0) + 1

        turn = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prefix = self._render(tmsgs[:i], True)
            reasoning = (m.get("reasoning") or "").strip()
            start = self._turn_start(full, prefix, tmsgs[:i], i)
            if start < len(prefix):
                note("generation_prompt_not_in_history")
            pos = start
            dropped = False
            if reasoning:
                note("reasoning_turns")
                k = full.find(reasoning, start)
                if 0 <= k <= start + MAX_GAP:
                    pos = k + len(reasoning)
                    kept.append((k, pos))
                else:
                    dropped = True
            content = m["content"].strip()
            content_end, end = self._locate_content(full, pos, content, i)
            ended = finish_reasons is None or turn >= len(finish_reasons) or finish_reasons[turn] != "length"
            turn += 1
            if dropped and i == len(messages) - 1:
                spliced = self._splice_last(full, tmsgs[:i], start, content, content_end, end, reasoning, spans)
                if spliced is not None:
                    full, span, rspan = spliced
                    spans.append(span if ended else (span[0], span[1] - (0 if end is None else end - content_end)))
                    kept.append(rspan)
                    note("reasoning_spliced")
                    if end is None:
                        note("turns_without_end_token")
                    break
            if dropped:
                note("reasoning_dropped_by_template")
            if end is None:
                note("turns_without_end_token")
            spans.append((start, end if (end is not None and ended) else content_end))
        inside = sum(1 for a, b in kept if any(s <= a and b <= e for s, e in spans))
        if inside:
            notes["reasoning_kept"] = inside
        ids, mask, how = self._tokenize(full, spans)
        if how:
            notes[how] = 1
        return Encoded(ids, mask, assistant_turns=turn, notes=notes)

    def _turn_start(self, full: str, prefix: str, before: list[dict], i: int) -> int:
        """Where assistant message i starts in `full`: after its generation prompt, or, for a template
        whose generation prompt holds text its history never shows (DeepSeek-R1's "<think>\\n" after
        "<｜Assistant｜>"), where the two part (only ever inside the generation prompt itself)."""
        if full.startswith(prefix):
            return len(prefix)
        base = self._render(before, False)
        same = len(os.path.commonprefix([full, prefix]))
        if prefix.startswith(base) and same >= len(base):
            return same
        raise TemplateProblem(
            f"the chat template of {self.target} renders the conversation before assistant message "
            f"{i + 1} differently once later messages are added, so its tokens cannot be located")

    def _splice_last(self, full: str, before: list[dict], start: int, content: str, content_end: int, end: int | None,
                     reasoning: str, spans: list[tuple[int, int]]):
        """The conversation as the target produced its last turn, for a template that drops that turn's
        reasoning: (text, the turn's span, the reasoning's range), or None when it cannot be built."""
        try:
            prompt = self._render(before, True, **THINKING_KWARGS)
        except TemplateProblem:
            return None
        same = len(os.path.commonprefix([full, prompt]))
        if any(e > same for _, e in spans):  # the earlier turns must stay as the template renders them
            return None
        content_start = content_end - len(content)
        gap = full[start:content_start]  # what the template puts between its header and the answer
        if prompt.endswith("<think>\n"):  # DeepSeek-R1: the prompt opens the block
            head, tail_sep = "", "\n</think>\n\n"
        elif prompt.endswith("<think>"):  # DeepSeek-V3.1 in thinking mode
            head, tail_sep = "", "</think>"
        elif "<think>" in gap and "</think>" in gap.split("<think>", 1)[1]:  # the template's own empty block (Kimi)
            a = gap.index("<think>") + len("<think>")
            b = gap.index("</think>", a)
            nl = "\n" if "\n" in gap[a:b] else ""
            head, tail_sep = gap[:a] + nl, nl + gap[b:]
        else:
            head, tail_sep = gap + "<think>\n", "\n</think>\n\n"
        r0 = len(prompt) + len(head)
        body = head + reasoning + tail_sep + content
        text = prompt + body + full[content_end:]
        stop = len(prompt) + len(body) + ((end - content_end) if end is not None else 0)
        return text, (len(prompt), stop), (r0, r0 + len(reasoning))

    def _locate_content(self, full: str, pos: int, content: str, i: int) -> tuple[int, int | None]:
        """(end of the content, end of the end-of-turn token after it or None) in `full`."""
        window_end = pos + MAX_GAP + len(content)
        first = None
        k = full.find(content, pos, window_end)
        while k >= 0:
            first = k if first is None else first
            stop = self._end_token_after(full, k + len(content))
            if stop is not None:
                return k + len(content), stop
            if not content:
                break
            k = full.find(content, k + 1, window_end)
        if first is None:
            raise TemplateProblem(
                f"the chat template of {self.target} drops or rewrites the content of assistant message {i + 1} "
                f"(it does not start with {content[:40]!r}), so prepare cannot tell which tokens to train on")
        return first + len(content), None

    def _end_token_after(self, full: str, j: int) -> int | None:
        """End of the end-of-turn token that follows position j (whitespace between allowed)."""
        n, j0 = len(full), j
        while j < n and full[j].isspace() and j - j0 < MAX_GAP:
            j += 1
        for t in self.end_tokens:
            if full.startswith(t, j):
                return j + len(t)
        return None

    def _tokenize(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int], str | None]:
        """Token ids and mask for `text`; the third value names the boundary fix used, if any."""
        if not getattr(self.tok, "is_fast", False):
            return self._tokenize_by_spans(text, spans)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offs = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [T, 2] character ranges
        a, b = offs[:, 0], offs[:, 1]
        bounds = np.asarray(sorted({x for s in spans for x in s}), dtype=np.int64)
        # A token that covers a boundary strictly inside itself mixes header and model output.
        straddle = bool(len(bounds)) and bool(((a[:, None] < bounds[None, :]) & (bounds[None, :] < b[:, None])).any())
        if straddle:
            cuts = sorted({0, len(text), *bounds.tolist()})
            piece_ids: list[int] = []
            piece_mask: list[int] = []
            span_set = set(spans)
            for x, y in zip(cuts[:-1], cuts[1:]):
                seg = self.tok(text[x:y], add_special_tokens=False)["input_ids"]
                inside = any(s <= x and y <= e for s, e in span_set)
                piece_ids += seg
                piece_mask += [int(inside)] * len(seg)
            # Piecewise tokenization must spell the same text (a tokenizer that adds a prefix space
            # to every call would not); otherwise keep the whole-text tokens and mask by overlap.
            if self.tok.decode(piece_ids) == self.tok.decode(ids):
                return piece_ids, piece_mask, "boundary_retokenized"
        mask = np.zeros(len(ids), dtype=bool)
        for s, e in spans:
            mask |= (a < e) & (b > s) & (b > a)
        return ids, mask.astype(np.int64).tolist(), ("boundary_overlap" if straddle else None)

    def _tokenize_by_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int], str | None]:
        """The same for a tokenizer without offsets (a Python tokenizer, e.g. Kimi's tiktoken one: transformers
        silently drops `return_offsets_mapping` there): the text is tokenized piece by piece between the span
        boundaries and each piece masked whole. Where the pieces give the whole text's ids, that is exactly the
        offsets path's answer; where a merge straddles a boundary they differ, and the pieces are kept when they
        spell the same text, as the offsets path does ("boundary_retokenized")."""
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        cuts = sorted({0, len(text), *(x for s in spans for x in s)})
        piece_ids: list[int] = []
        piece_mask: list[int] = []
        for x, y in zip(cuts[:-1], cuts[1:]):
            seg = self.tok(text[x:y], add_special_tokens=False)["input_ids"]
            piece_ids += seg
            piece_mask += [int(any(s <= x and y <= e for s, e in spans))] * len(seg)
        if piece_ids == ids:
            return ids, piece_mask, None
        if self.tok.decode(piece_ids) != self.tok.decode(ids):
            raise TemplateProblem(f"the tokenizer of {self.target} has no offsets, and its tokens of the turns one by "
                                  "one do not spell the conversation, so the assistant's tokens cannot be located")
        return piece_ids, piece_mask, "boundary_retokenized"


def end_of_turn_tokens(tokenizer, identity) -> list[str]:
    """Tokens the target stops generating at: the tokenizer's eos plus the target's stop token ids
    (target.identity: Llama 3 ends turns with <|eot_id|>, Gemma with <end_of_turn>)."""
    ids = identity.stop_token_ids()
    tokens = {tokenizer.eos_token} if tokenizer.eos_token else set()
    for i in ids:
        t = tokenizer.convert_ids_to_tokens(i)
        if isinstance(t, str):
            tokens.add(t)
    return sorted(tokens)


# -------------------------------------------------------------------------------------------------
# Reading generate's samples


def _check_record(rec: Any, where: str) -> tuple[Any, list[dict], list[str] | None]:
    if not isinstance(rec, dict) or "id" not in rec:
        raise DraftsmithError(f"{where}: not a sample record (an object with 'id' and 'messages')")
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise DraftsmithError(f"{where}: 'messages' must be a non-empty list")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DraftsmithError(f"{where}: message {j + 1}: role must be one of {', '.join(ROLES)} "
                                  f"(got {m.get('role') if isinstance(m, dict) else m!r})")
        if not isinstance(m.get("content"), str):
            raise DraftsmithError(f"{where}: message {j + 1}: 'content' must be a string")
        if m.get("reasoning") is not None and not isinstance(m["reasoning"], str):
            raise DraftsmithError(f"{where}: message {j + 1}: 'reasoning' must be a string")
    if "group" in rec and not isinstance(rec["group"], str):
        raise DraftsmithError(f"{where}: 'group' must be a string")
    fr = rec.get("finish_reasons")
    return rec["id"], msgs, fr if isinstance(fr, list) else None


def _id_key(sample_id: Any) -> str:
    return json.dumps(sample_id, sort_keys=True)


def scan_generated(path: Path) -> list[str]:
    """Id keys of generate's records in file order; a bad line or a duplicate id is an error."""
    keys: list[str] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            sid, _, _ = _check_record(rec, f"{path}:{n}")
            key = _id_key(sid)
            if key in seen:
                raise DraftsmithError(f"{path}:{n}: duplicate sample id {sid!r} (first on line {seen[key]})")
            seen[key] = n
            keys.append(key)
    return keys


# -------------------------------------------------------------------------------------------------
# Resume


@dataclass
class PreparedTotals:
    """What the prepared samples add up to (the manifest's counts and the summary line)."""

    samples: int = 0
    assistant_turns: int = 0  # contiguous masked spans (a turn cut by truncation still counts)
    tokens: int = 0
    masked_tokens: int = 0
    truncated: int = 0
    grouped: int = 0  # samples with generate.group_by's group
    notes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in NOTE_KEYS})

    def add(self, ids: list[int], mask: list[int], truncated: bool, notes: dict[str, int],
            group: str | None = None) -> None:
        self.samples += 1
        self.grouped += int(group is not None)
        self.assistant_turns += sum(1 for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1]))
        self.tokens += len(ids)
        self.masked_tokens += sum(mask)
        self.truncated += int(truncated)
        for k, v in notes.items():
            self.notes[k] = self.notes.get(k, 0) + v


def read_prepared(path: Path, valid_keys: set[str]) -> tuple[set[str], PreparedTotals]:
    """Ids and totals of the samples already in prepare/samples.jsonl (after the tail repair)."""
    done: set[str] = set()
    totals = PreparedTotals()
    if not path.exists():
        return done, totals
    rerun = f"delete {path} and rerun"
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            rec = check_prepared_line(line, f"{path}:{n}", rerun)
            key = _id_key(rec["id"])
            if key not in valid_keys or key in done:
                raise DraftsmithError(f"{path}:{n}: sample {rec['id']!r} does not belong to this attempt; {rerun}")
            done.add(key)
            totals.add(rec["input_ids"], rec["loss_mask"], bool(rec.get("truncated")), rec.get("notes") or {},
                       rec.get("group"))
    return done, totals


# -------------------------------------------------------------------------------------------------
# The stage


@stage_run(STAGE)
def run_prepare(run: RunDir, cfg) -> dict:
    """Build prepare/samples.jsonl from generate/samples.jsonl; returns the manifest."""
    say = lambda msg: log(msg, stage=STAGE)  # noqa: E731 (before the progress journal opens)
    gen_manifest = upstream(run, "generate", by="draftsmith prepare")
    gen_path = run.stage_dir("generate", create=False) / "samples.jsonl"
    if not gen_path.is_file():
        raise DraftsmithError(f"{gen_path}: missing although generate completed; "
                              f"rerun `draftsmith generate --run {run.path}`")
    info = target_info(cfg.target, cfg.trust_remote_code, log=say)
    check_target(run, "generate", gen_manifest, info)
    gen_sha = file_sha256(gen_path)
    # The samples file's own hash too: a generate rerun that only added samples keeps its print.
    book = StageBook(run, STAGE, cfg, settings={**cfg.section(STAGE), "version": PREPARE_VERSION},
                     upstream={"generate": gen_manifest}, target=info,
                     fingerprint_extra={"generate_samples_sha256": gen_sha})
    out_path = run.stage_dir(STAGE) / SAMPLES
    if (old := book.skip_or_begin(outputs_ok=out_path.is_file(),
                                  said=lambda m: f"{m['counts'].get('done')} samples")) is not None:
        return old

    tok = load_tokenizer(info, cfg.trust_remote_code)
    encoder = ChatEncoder.for_target(tok, info)
    keys = scan_generated(gen_path)
    done_keys, tally = _resume(run, book, keys, say)
    with book.progress(total=len(keys), unit="samples", done=len(done_keys)) as prog:
        prog.log(f"target {info.name}; {len(keys)} generated samples, {len(done_keys)} already prepared; "
                 f"max_length {cfg.prepare.max_length} ({cfg.prepare.overflow}); reasoning "
                 + (f"via the template's '{encoder.reasoning_key}' field" if encoder.reasoning_key else
                    "spliced into the template's own think block (last turns)" if encoder.think_slot else
                    "written as <think> blocks"))
        counts, dropped_examples = _encode_samples(gen_path, out_path, keys, done_keys, encoder, tally,
                                                   cfg.prepare, prog)
        _log_summary(prog, gen_path, tally, counts, dropped_examples)
        manifest_counts = {
            "done": tally.samples, "total": tally.samples, "unit": "samples",
            "input_samples": len(keys), "samples": tally.samples, "assistant_turns": tally.assistant_turns,
            "tokens": tally.tokens, "masked_tokens": tally.masked_tokens, "truncated": tally.truncated,
            "grouped": tally.grouped,
            "dropped": counts["dropped_too_long"] + counts["dropped_empty_mask"], **counts,
            **{k: tally.notes.get(k, 0) for k in NOTE_KEYS},
            "reasoning_capture_rate": capture_rate(tally.notes),
        }
        manifest = book.finish(counts=manifest_counts, outputs=[SAMPLES],
                               inputs={"generate_samples_sha256": gen_sha},
                               extra={"reasoning_key": encoder.reasoning_key, "think_slot": encoder.think_slot,
                                      "end_tokens": encoder.end_tokens,
                                      "chat_template_sha256": chat_template_sha256(tok)})
        prog.end(samples=tally.samples, tokens=tally.tokens, masked_tokens=tally.masked_tokens)
    return manifest


def _resume(run: RunDir, book: StageBook, keys: list, say) -> tuple[set, "PreparedTotals"]:
    """The keys already in prepare/samples.jsonl and their tally. Only a partial file built with
    this very fingerprint is resumed; anything else starts afresh."""
    d = run.stage_dir(STAGE)
    out_path, state_path = d / SAMPLES, d / "state.json"
    state = None
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text())
        except ValueError:
            state = None
    if out_path.exists() and not (isinstance(state, dict) and state.get("fingerprint") == book.fingerprint):
        say(f"{out_path.name} was built with other inputs or settings; starting it afresh")
        out_path.unlink()
    atomic_write_json(state_path, {"fingerprint": book.fingerprint, "started": book.started})
    repair_jsonl_tail(out_path, say)
    return read_prepared(out_path, set(keys))


def _encode_samples(gen_path: Path, out_path: Path, keys: list, done_keys: set, encoder: "ChatEncoder",
                    tally: "PreparedTotals", pcfg, prog) -> tuple[dict[str, int], list[str]]:
    """Append one prepared line per generated sample not yet done; (drop counts, a few examples)."""
    counts = {"dropped_too_long": 0, "dropped_empty_mask": 0}
    dropped_examples: list[str] = []
    last_sync = time.time()
    # one os.write per line on an O_APPEND descriptor (rundir.append_bytes): a kill cuts at most the
    # last line, and a full disk cuts the line back and names the file
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        with open(gen_path, encoding="utf-8") as src:
            n = 0
            for lineno, line in enumerate(src, 1):
                if not line.strip():
                    continue
                key = keys[n]
                n += 1
                if key in done_keys:
                    continue
                gen_rec = json.loads(line)
                sid, msgs, finish = _check_record(gen_rec, f"{gen_path}:{lineno}")
                group = gen_rec.get("group")  # generate.group_by's (draftsmith/heldout.py), carried as it is
                try:
                    enc = encoder.encode(msgs, finish)
                except TemplateProblem as e:
                    raise TemplateProblem(f"{gen_path}:{lineno}: sample {sid!r}: {e}") from None
                ids, mask, truncated = enc.input_ids, enc.loss_mask, False
                reason = None
                if len(ids) > pcfg.max_length:
                    if pcfg.overflow == "drop":
                        reason = "dropped_too_long"
                    else:
                        ids, mask, truncated = ids[: pcfg.max_length], mask[: pcfg.max_length], True
                if reason is None and not any(mask):
                    reason = "dropped_empty_mask"
                if reason is not None:
                    counts[reason] += 1
                    if len(dropped_examples) < 5:
                        why = ("too long" if reason == "dropped_too_long" else
                               "no assistant token within max_length" if truncated else "no assistant token")
                        dropped_examples.append(f"{sid} ({why}, {len(enc.input_ids)} tokens)")
                    # Dropped samples leave no line: shrink the total so that done == lines on disk.
                    prog.set_total(prog.total - 1)
                    continue
                rec = prepared_record(sid, ids, mask, truncated, enc.notes, group)
                append_bytes(out, jsonl_text([rec]).encode(), out_path)
                tally.add(ids, mask, truncated, enc.notes, group)
                prog.advance(1)
                if time.time() - last_sync > 10:
                    with naming_full_disk(out_path):
                        os.fsync(out)
                    last_sync = time.time()
            with naming_full_disk(out_path):
                os.fsync(out)
    finally:
        os.close(out)
    return counts, dropped_examples


def capture_rate(notes: dict[str, int]) -> float | None:
    """Share of the assistant turns with reasoning whose reasoning is in the prepared ids, inside the
    loss mask; None when no turn had any."""
    turns = notes.get("reasoning_turns", 0)
    return round(notes.get("reasoning_kept", 0) / turns, 4) if turns else None


def _log_summary(prog, gen_path: Path, tally: "PreparedTotals", counts: dict[str, int],
                 dropped_examples: list[str]) -> None:
    """What was kept and dropped, as log lines; no sample kept is an error."""
    dropped = counts["dropped_too_long"] + counts["dropped_empty_mask"]
    if tally.samples == 0:
        raise DraftsmithError(f"{gen_path}: no sample kept ({dropped} dropped: {', '.join(dropped_examples)})")
    share = tally.masked_tokens / max(1, tally.tokens)
    prog.log(f"prepared {tally.samples} samples: {fmt_count(tally.tokens)} tokens, {fmt_count(tally.masked_tokens)} "
             f"loss-masked ({share:.1%}); truncated {tally.truncated}; dropped {counts['dropped_too_long']} too long, "
             f"{counts['dropped_empty_mask']} with no assistant tokens")
    if dropped_examples:
        prog.log("dropped, e.g.: " + "; ".join(dropped_examples))
    if tally.notes.get("reasoning_turns"):
        turns, kept = tally.notes["reasoning_turns"], tally.notes.get("reasoning_kept", 0)
        prog.log(f"reasoning: {turns} assistant turns had reasoning; {kept} of them ({kept / turns:.0%}) kept in the "
                 f"prepared ids and the loss mask"
                 + (f" ({tally.notes['reasoning_spliced']} last turns spliced after the generation prompt: the "
                    "template drops their reasoning)" if tally.notes.get("reasoning_spliced") else ""))
    for k, msg in (("reasoning_dropped_by_template",
                    "assistant turns whose reasoning the template leaves out (it keeps only the last turn's)"),
                   ("turns_without_end_token", "assistant turns with no end-of-turn token after them in the template"),
                   ("generation_prompt_not_in_history",
                    "assistant turns whose generation prompt the template's history does not show "
                    "(e.g. DeepSeek-R1's '<think>\\n'): masked from where the two part"),
                   ("boundary_retokenized", "samples tokenized piecewise because a token straddled a turn boundary"),
                   ("boundary_overlap", "samples where a token straddles a turn boundary (masked as assistant)")):
        if tally.notes.get(k):
            prog.log(f"note: {tally.notes[k]} {msg}")
