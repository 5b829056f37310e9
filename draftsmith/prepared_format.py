"""The prepared samples' file, without torch: prepare/samples.jsonl (docs/run-directory.md, "prepare/"), one
JSON object per line, {"id", "input_ids": [T] token ids, "loss_mask": [T] 0/1, "truncated": bool, "notes"?:
{counter: n}, "group"?: generate.group_by's group}, in generate's order. prepare.py writes it (prepared_record);
vocab, extract and train read it through the one reader here.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftsmith import DraftsmithError
from draftsmith.rundir import RunDir

STAGE = "prepare"
SAMPLES = "samples.jsonl"


def prepared_record(sample_id, input_ids: list[int], loss_mask: list[int], truncated: bool,
                    notes: dict[str, int] | None, group: str | None = None) -> dict:
    """One line's record as prepare writes it (`notes` only when there are any; `group`, generate.group_by's,
    only when the generated sample has one)."""
    rec = {"id": sample_id, "input_ids": input_ids, "loss_mask": loss_mask, "truncated": truncated}
    if notes:
        rec["notes"] = notes
    if group is not None:
        rec["group"] = group
    return rec


def check_prepared_line(line: bytes | str, where: str, rerun: str = "rerun `draftsmith prepare`",
                        vocab_size: int | None = None) -> dict:
    """The record of one line of prepare/samples.jsonl, checked: an object with an id and
    non-empty, equally long input_ids and loss_mask (token ids inside `vocab_size` when given).
    Anything else is a one-line error naming `where` (file:line) and what to do (`rerun`)."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise DraftsmithError(f"{where}: invalid JSON ({getattr(e, 'msg', e)}); {rerun}") from None
    ids = rec.get("input_ids") if isinstance(rec, dict) else None
    mask = rec.get("loss_mask") if isinstance(rec, dict) else None
    if not isinstance(ids, list) or not isinstance(mask, list) or "id" not in rec:
        raise DraftsmithError(f"{where}: not a prepared sample "
                              f"(expected {{\"id\", \"input_ids\", \"loss_mask\"}}); {rerun}")
    if not ids or len(ids) != len(mask):
        raise DraftsmithError(f"{where}: input_ids ({len(ids)}) and loss_mask ({len(mask)}) must be non-empty and "
                              f"equally long; {rerun}")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = max(ids) if max(ids) >= vocab_size else min(ids)
        raise DraftsmithError(f"{where}: token id {bad} is outside the target's vocabulary (size {vocab_size}); "
                              "was prepare run with another tokenizer?")
    return rec


def prepared_path(run: RunDir, by: str) -> Path:
    """prepare/samples.jsonl of a completed prepare stage (else a one-line error naming what to run)."""
    run.require_manifest(STAGE, by=by)
    path = run.path / STAGE / SAMPLES
    if not path.is_file():
        raise DraftsmithError(f"{path}: missing although prepare/manifest.json exists; rerun prepare")
    return path


def iter_prepared(run: RunDir, by: str = "reading prepared samples"):
    """Yield (index, record, input_ids int64 [T], loss_mask bool [T]) of prepare/samples.jsonl in
    order, streamed; the stage must have completed. A malformed line is a one-line error naming it."""
    path = prepared_path(run, by)
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            rec = check_prepared_line(line, f"{path}:{i + 1}")
            yield i, rec, np.asarray(rec["input_ids"], dtype=np.int64), np.asarray(rec["loss_mask"], dtype=bool)


def prepared_groups(run: RunDir) -> dict[str, str]:
    """{sample id: group} of the prepared samples that carry generate.group_by's group (draftsmith/heldout.py);
    the file is read only when prepare's manifest counts grouped samples."""
    if not ((run.read_manifest(STAGE) or {}).get("counts") or {}).get("grouped"):
        return {}
    return {str(rec["id"]): str(rec["group"]) for _, rec, _, _ in iter_prepared(run) if "group" in rec}


@dataclass
class Prepared:
    """prepare/samples.jsonl indexed by byte offset, so that a big file never sits in memory."""
    path: Path
    offsets: list[int]  # byte offset of each line
    lengths: list[int]  # tokens per sample
    ids: list[str]  # each sample's id

    def __len__(self) -> int:
        return len(self.lengths)

    def read(self, indices: list[int]) -> dict[int, dict]:
        out = {}
        with open(self.path, "rb") as f:
            for i in sorted(indices):
                f.seek(self.offsets[i])
                out[i] = json.loads(f.readline())
        return out


def index_prepared(run: RunDir, vocab_size: int, by: str) -> Prepared:
    """Scan prepare/samples.jsonl once: every line checked (ids inside the target's vocabulary,
    no id twice), its offset and length kept."""
    path = prepared_path(run, by)
    offsets, lengths, ids = [], [], []
    seen: set[str] = set()
    pos = 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            where = f"{path}:{n}"
            start, pos = pos, pos + len(line)
            if not line.strip():
                raise DraftsmithError(f"{where}: empty line; rerun `draftsmith prepare`")
            rec = check_prepared_line(line, where, vocab_size=vocab_size)
            sid = str(rec["id"])
            if sid in seen:
                raise DraftsmithError(f"{where}: duplicate sample id {sid!r}")
            seen.add(sid)
            ids.append(sid)
            offsets.append(start)
            lengths.append(len(rec["input_ids"]))
    return Prepared(path=path, offsets=offsets, lengths=lengths, ids=ids)
