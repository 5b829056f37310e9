"""generate's files (listed in generate/stage.py's doc; schema in docs/run-directory.md): the record
of one sample, and the store of samples.jsonl and failures.jsonl that keeps the stage's promises."""

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from draftsmith import DraftsmithError
from draftsmith.rundir import append_bytes, append_text, atomic_write_text, jsonl_text, read_jsonl

STAGE = "generate"
SAMPLES = "samples.jsonl"
FAILURES = "failures.jsonl"
UNSELECTED = "unselected.jsonl"
STATE = "state.json"
SAMPLING = "sampling"  # a resampled answer's {temperature, seed} (generate.answers_per_prompt > 1)
RESAMPLED_ID = re.compile(r"#\d+@T[^#]*$")  # a resampled answer's id: its prompt's, then #k@T<temperature>


def resampled_id(prompt_id: str, k: int, temperature: float) -> str:
    """The id of a prompt's k-th answer (k >= 2) sampled at `temperature` (prompt_id_of reads it back)."""
    return f"{prompt_id}#{k}@T{temperature:g}"


def prompt_id_of(sample_id: str) -> str:
    """The id of the prompt a sample answers: its own, or a resampled answer's prompt's."""
    return RESAMPLED_ID.sub("", str(sample_id))


@dataclass
class TurnResult:
    """One assistant turn as a backend decoded it."""
    content: str
    reasoning: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


def measured_lengths(path: Path, most: int = 2000) -> tuple[int, int, int] | None:
    """(mean prompt tokens, mean completion tokens, answers read) over the first `most` records of a samples.jsonl
    (each record's `prompt_tokens`, `completion_tokens`: reasoning included), or None when it holds none yet. Reads
    at most `most` lines: an estimate's answer length, not an audit of a multi-GB file."""
    prompt = completion = n = 0
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            if n >= most:
                break
            with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):  # a torn or foreign line
                rec = json.loads(line)
                p, c = int(rec["prompt_tokens"]), int(rec["completion_tokens"])
                prompt, completion, n = prompt + p, completion + c, n + 1
    return (round(prompt / n), max(1, round(completion / n)), n) if n else None


def build_record(prompt, turns: list[TurnResult], backend: str, model: str) -> dict:
    """The samples.jsonl record of a conversation regenerated turn by turn."""
    messages = prompt.system_messages()
    for user, t in zip(prompt.turns, turns):
        messages.append({"role": "user", "content": user})
        msg = {"role": "assistant", "content": t.content}
        if t.reasoning:
            msg["reasoning"] = t.reasoning
        messages.append(msg)
    finish = [t.finish_reason for t in turns]
    return {
        "id": prompt.id,
        "messages": messages,
        "finish_reasons": finish,
        "truncated": any(f == "length" for f in finish),
        "reasoning": any(t.reasoning for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "completion_tokens": sum(t.completion_tokens for t in turns),
        "backend": backend,
        "model": model,
        **({SAMPLING: prompt.meta[SAMPLING]} if SAMPLING in prompt.meta else {}),
        **({"group": prompt.group} if prompt.group is not None else {}),
    }


def read_records(path: Path, log: Callable[[str], None] | None = None) -> list[dict]:
    """The records of one of generate's JSONL files, each with an id (see rundir.read_jsonl)."""
    return read_jsonl(path, log, require=("id",))


class SampleStore:
    """samples.jsonl + failures.jsonl of one run, with the invariants the stage promises.

    Each sample is appended with a single os.write on an O_APPEND descriptor, so a crash can
    only cut the last line (repaired on the next open). A failure that later succeeds is removed
    from failures.jsonl by an atomic rewrite (at most once a second, and at close); a crash before
    that rewrite is healed on the next open (a finished id wins over a failure).
    """

    def __init__(self, d: Path, log: Callable[[str], None]):
        self.d, self.log = d, log
        self.samples_path, self.failures_path = d / SAMPLES, d / FAILURES
        self.done: dict[str, dict] = {}  # id -> short summary of the finished sample
        self.failures: dict[str, dict] = {}  # id -> failure record
        self._fd: int | None = None
        self._failures_dirty = False
        self._failures_written_t = 0.0

    @staticmethod
    def summary(rec: dict) -> dict:
        out = {k: rec.get(k) for k in ("completion_tokens", "prompt_tokens", "reasoning", "truncated")}
        answers = [m for m in rec.get("messages") or [] if isinstance(m, dict) and m.get("role") == "assistant"]
        out["answers"], out["reasoning_answers"] = len(answers), sum(1 for m in answers if m.get("reasoning"))
        return out

    def open(self) -> "SampleStore":
        seen_twice = 0
        for rec in read_records(self.samples_path, self.log):
            if rec["id"] in self.done:
                seen_twice += 1
            self.done[rec["id"]] = self.summary(rec)
        if seen_twice:
            raise DraftsmithError(f"{self.samples_path}: {seen_twice} ids appear more than once (edited by hand?)")
        for rec in read_records(self.failures_path, self.log):
            self.failures[rec["id"]] = rec  # the last line of an id is its latest state
        healed = [i for i in self.failures if i in self.done]
        for i in healed:
            del self.failures[i]
        if healed:
            self._rewrite_failures()
        self._fd = os.open(self.samples_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return self

    def add_sample(self, rec: dict) -> None:
        append_bytes(self._fd, jsonl_text([rec]).encode(), self.samples_path)
        self.done[rec["id"]] = self.summary(rec)
        if self.failures.pop(rec["id"], None) is not None:
            self._failures_dirty = True
            self.flush_failures(force=False)

    def add_failure(self, rec: dict) -> None:
        prev = self.failures.get(rec["id"])
        if prev:
            rec["attempts"] = rec["attempts"] + int(prev.get("attempts", 0))
        self.failures[rec["id"]] = rec
        # Append (not rewrite): the last line of an id wins when the file is read back.
        append_text(self.failures_path, jsonl_text([rec]))

    def forget_failures(self, keep: set[str]) -> None:
        """Failures of prompts no longer selected (not in `keep`): nothing to retry (rewritten at the next
        flush). A selected one left here is an answer cut for time, counted as lost."""
        gone = [i for i in self.failures if i not in keep]
        for i in gone:
            del self.failures[i]
        if gone:
            self._failures_dirty = True

    def _rewrite_failures(self) -> None:
        if self.failures:
            atomic_write_text(self.failures_path, jsonl_text(self.failures.values()))
        else:
            with contextlib.suppress(FileNotFoundError):
                self.failures_path.unlink()
        self._failures_dirty = False
        self._failures_written_t = time.time()

    def flush_failures(self, force: bool = True) -> None:
        if self._failures_dirty and (force or time.time() - self._failures_written_t >= 1.0):
            self._rewrite_failures()

    def rewrite_samples(self, keep: set[str]) -> list[dict]:
        """Keep only the ids in `keep` in samples.jsonl (atomic rewrite); return the others."""
        kept, dropped = [], []
        for rec in read_records(self.samples_path):
            (kept if rec["id"] in keep else dropped).append(rec)
        if dropped:
            atomic_write_text(self.samples_path, jsonl_text(kept))
            os.close(self._fd)
            self._fd = os.open(self.samples_path, os.O_WRONLY | os.O_APPEND)
            for r in dropped:
                self.done.pop(r["id"], None)
        return dropped

    def close(self) -> None:
        self.flush_failures(force=True)
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
