"""What an eval engine is given and what it must yield; the files engines share.

An engine is a function `engine(ctx: EngineContext) -> Iterator[dict]` (local.py, vllm.py; the
table is eval.stage.ENGINES) that decodes ctx.todo and yields one record per prompt, holding at least
RECORD_KEYS; eval/stage.py appends each to RUN/eval/answers.jsonl as it comes. What an engine
says about itself for the report (its servers, their versions) it writes to engine.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.rundir import RunDir, atomic_write_json, atomic_write_text, jsonl_text, read_json_object, read_jsonl

ENGINE_INFO = "engine.json"  # what the engine reports about itself (server args, versions)

# what every engine's per-prompt record holds (more keys are welcome)
RECORD_KEYS = ("id", "index", "prompt_tokens", "output_tokens", "token_ids", "text", "finish_reason",
               "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos", "seconds")


@dataclass
class EngineContext:
    run: RunDir
    cfg: Any  # draftsmith.config.Config
    export_dir: Path
    todo: list[tuple[int, Any]]  # (index in the prompt list, Prompt) still to decode
    prog: Any  # draftsmith.progress.Progress
    warmup: bool = True
    fingerprint: str = ""  # the records' fingerprint (an engine's own resumable files carry it too)
    folder: str = "eval"  # the stage folder under the run (the demo's second engine writes eval-vllm/)

    @property
    def stage_dir(self) -> Path:
        return self.run.stage_dir(self.folder)


def prompt_seed(seed: int, index: int) -> int:
    """One seed per prompt (eval.seed, the prompt's index): a resumed run samples what an
    uninterrupted one would, and both engines sample prompt i alike."""
    return seed * 1_000_003 + index


def resume_records(path: Path, fingerprint: str, keep: set[str] | None = None) -> dict[str, dict]:
    """The records of an eval JSONL file (answers.jsonl, the vLLM baseline's) made with
    `fingerprint` (and, with `keep`, of those ids), by id. The file is rewritten to hold exactly
    those when it held anything else (other settings, other prompts: `status` counts its lines);
    a line cut by a crash is gone either way."""
    records = read_jsonl(path)
    done = {r["id"]: r for r in records if r.get("fingerprint") == fingerprint and "id" in r
            and (keep is None or r["id"] in keep)}
    if len(done) != len(records):
        atomic_write_text(path, jsonl_text(done.values()))
    return done


def read_engine_info(d: Path, fingerprint: str) -> dict:
    """What the engine wrote about itself for records of `fingerprint` ({} when none)."""
    try:
        info = read_json_object(d / ENGINE_INFO)
    except (DraftsmithError, OSError):  # missing or damaged: the report then says less, nothing depends on it
        return {}
    return info if info.get("fingerprint") == fingerprint else {}


def write_engine_info(d: Path, fingerprint: str, info: dict) -> None:
    atomic_write_json(d / ENGINE_INFO, {**info, "fingerprint": fingerprint})
