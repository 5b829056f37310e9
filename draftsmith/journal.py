"""The progress journal: its format, its writer's one primitive, and its reader.

`RUN/<stage>/progress.jsonl` (`progress.rank{r}.jsonl` for rank r of several) holds one JSON
object per line: a `start` line (pid, host, time, total, unit, stall threshold, log path, the
launch's attempt id), `p` lines with the count done (`t`: time of the line, `pt`: time of the
last progress), then `end` or `error`. progress.py writes it; status.py reads it; neither imports
the other, and nothing here imports torch (`status` must answer in well under a second).
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.bounds import env_int
from draftsmith.rundir import append_json_line

TAIL_BYTES = 64 * 1024
RATE_WINDOW_S = 60.0
# ... stretched back, when that minute holds fewer units, to cover the last RATE_MIN_UNITS units (at most
# RATE_MAX_WINDOW_S): a window of a few units jumps by a large share each time one enters or leaves it,
# and the log line printed a few seconds earlier would then disagree with `status` (issue 28).
RATE_MIN_UNITS = 20
RATE_MAX_WINDOW_S = 300.0
# A journal on another host is only judged by its heartbeats: this many stall thresholds
# without one and it counts as dead rather than stalled.
REMOTE_DEAD_FACTOR = 3.0


def journal_name(rank: int, world_size: int) -> str:
    return "progress.jsonl" if world_size <= 1 else f"progress.rank{rank}.jsonl"


def env_rank() -> tuple[int, int]:
    """(rank, world_size) from torchrun's environment, (0, 1) otherwise. Variables that torchrun
    cannot have set (not integers, WORLD_SIZE below 1, RANK outside it, several ranks without the
    rendezvous address torchrun gives each) are a one-line error naming them, before any stage
    starts, instead of a traceback from deep in torch.distributed."""
    def integer(name: str, default: int) -> int:
        return env_int(name, default, -(1 << 20), 1 << 20, " (torchrun sets it; unset it outside torchrun)")

    rank, world = integer("RANK", 0), integer("WORLD_SIZE", 1)
    integer("LOCAL_RANK", 0)
    if world < 1:
        raise DraftsmithError(f"$WORLD_SIZE={world}: must be 1 or more (unset it outside torchrun)")
    if not 0 <= rank < world:
        raise DraftsmithError(f"$RANK={rank}: must be in 0..{world - 1} for $WORLD_SIZE={world}")
    if world > 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise DraftsmithError(f"$WORLD_SIZE={world} without $MASTER_ADDR and $MASTER_PORT: start the ranks with "
                              "torchrun (torchrun --nproc-per-node N -m draftsmith -- ...), or use train.processes")
    return rank, world


def attempt_id() -> str | None:
    """What all ranks of one launch share and the next launch does not: torchrun's run id (a fresh uuid
    under --standalone, which draftsmith's own launches use) with its restart count; this process's pid
    outside torchrun. None under a torchrun whose run id is the default "none" (not unique)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None and "RANK" not in os.environ:
        return f"{socket.gethostname()}:{os.getpid()}"
    if run_id in (None, "", "none"):
        return None
    return f"{run_id}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def append_event(path: Path, ev: dict[str, Any]) -> None:
    """Append one event line (rundir.append_json_line: lines of the heartbeat thread and the stage
    never interleave)."""
    append_json_line(path, ev)


# What each field of an event may hold; a line with anything else (edited by hand, garbage, a
# writer of another version) is skipped and counted, never trusted: `status` must survive any line.
_NUMBERS = ("t", "pt", "done", "total", "stall_after_s")
_INTS = ("pid", "rank", "world_size")
_TEXTS = ("ev", "phase", "error", "unit", "host", "log", "attempt", "stage")
MAX_TAIL_BYTES = 64 << 20  # how far back the reader looks for the last good event past a huge line


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def valid_event(ev: Any) -> bool:
    """Whether a parsed line is an event this reader can use: an object with `ev` and a time `t`,
    every known field of its type (counts and times finite numbers, ids ints, names text)."""
    if not isinstance(ev, dict) or not isinstance(ev.get("ev"), str) or not _is_number(ev.get("t")):
        return False
    return (all(ev.get(k) is None or _is_number(ev[k]) for k in _NUMBERS)
            and all(ev.get(k) is None or (isinstance(ev[k], int) and not isinstance(ev[k], bool)) for k in _INTS)
            and all(ev.get(k) is None or isinstance(ev[k], str) for k in _TEXTS))


def _parse_lines(blob: bytes) -> tuple[list[dict], int]:
    """(the valid events of `blob`, how many lines were skipped as not valid)."""
    out, skipped = [], 0
    for line in blob.split(b"\n"):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except ValueError:  # a line cut by a crash, a partial first line of the tail, garbage
            ev = None
        if valid_event(ev):
            out.append(ev)
        else:
            skipped += 1
    return out, skipped


def read_journal(path: Path) -> tuple[dict | None, list[dict]]:
    """(start event, tail events) of a journal; tolerant of a cut last line and of any bad line."""
    start, events, _ = read_journal_counted(path)
    return start, events


def read_journal_counted(path: Path) -> tuple[dict | None, list[dict], int]:
    """read_journal's (start, tail events) and the lines of the tail that were skipped as not valid.
    The tail reaches back past lines too long for TAIL_BYTES (a 1 MB garbage line at the end must
    not hide the stage's last real event), up to MAX_TAIL_BYTES."""
    try:
        with open(path, "rb") as f:
            first = f.readline(TAIL_BYTES)
            f.seek(0, os.SEEK_END)
            size = f.tell()
            window = TAIL_BYTES
            while True:
                f.seek(max(0, size - window))
                tail = f.read()
                events, skipped = _parse_lines(tail)
                if any(e["ev"] != "start" for e in events) or window >= min(size, MAX_TAIL_BYTES):
                    break
                window *= 4
    except OSError:
        return None, [], 0
    if size > window:
        skipped -= 1  # the tail's first line is a piece of a line, not a bad one
    # an attempt's journal ends with its end or error event: what follows it, other than the start
    # of a new attempt, was not written by that attempt and must not reopen it
    closed_at = next((i for i in range(len(events) - 1, -1, -1) if events[i]["ev"] in ("end", "error")), None)
    if closed_at is not None:
        after = events[closed_at + 1:]
        kept = after[next((i for i, e in enumerate(after) if e["ev"] == "start"), len(after)):]
        skipped += len(after) - len(kept)
        events = events[:closed_at + 1] + kept
    start = next((e for e in _parse_lines(first)[0] if e["ev"] == "start"), None)
    if start is None:
        start = next((e for e in events if e["ev"] == "start"), None)
    return start, events, max(0, skipped)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped by its parent) is not alive.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def recent_rate(points: list[tuple], start_done: float) -> tuple[float | None, bool]:
    """(units per second, warming up) from (time, done[, in work]) points of one attempt, oldest first:
    the one rate rule of both the log lines and `status`, so that the two agree.

    The rate is taken over the last RATE_WINDOW_S seconds of work, or over the last RATE_MIN_UNITS
    units when that minute holds fewer (at most RATE_MAX_WINDOW_S back), never over the start-up
    before the first unit (loading a model, starting a server), which would stretch the ETA for
    hours. A point written inside a work phase (journal `w`: a batch being decoded, whose answers all
    land at its end) is the units' own time, not start-up: the first batch's rate is its answers over
    its time. While less than a whole window of work lies behind, the rate is marked as warming up."""
    if not points:
        return None, True
    last_t, last_done = points[-1][0], points[-1][1]
    # Work began at the last point that still had nothing done in this attempt, outside a work phase.
    began = max((p[0] for p in points if p[1] <= start_done and not (len(p) > 2 and p[2])), default=points[0][0])
    usable = [(p[0], p[1]) for p in points if p[0] >= max(began, last_t - RATE_MAX_WINDOW_S)] or [points[-1][:2]]
    first_t, first_done = next(((t, d) for t, d in usable if t >= last_t - RATE_WINDOW_S), usable[-1])
    if last_done - first_done < RATE_MIN_UNITS:
        # the latest point at least RATE_MIN_UNITS units back, else the oldest usable one
        first_t, first_done = max(((t, d) for t, d in usable if d <= last_done - RATE_MIN_UNITS),
                                  default=usable[0], key=lambda p: p[0])
    # from when the count reached first_done, not a later heartbeat with the same count: units that
    # land in bursts would otherwise be credited to less time than they took
    first_t = min(t for t, d in usable if d == first_done)
    if last_t - first_t < 2.0 or last_done <= first_done:
        return None, True
    return (last_done - first_done) / (last_t - first_t), last_t - began < RATE_WINDOW_S


def rate_and_eta(points: list[tuple], start_done: float, total: float | None,
                 now: float) -> tuple[float | None, bool, float | None]:
    """(units per second, warming up, seconds left): the one ETA rule of the log and `status`.

    Units often land in bursts (a decoded batch, an extracted group), so a rate taken up to now sinks
    between bursts and the ETA climbs, then drops when the burst lands (the demo's extract read 15 s,
    1m44s, 2m53s, 4m03s, 50 s within 37 s). Instead the rate is taken up to the last completion and
    the ETA counts down from it: at a steady pace it reaches the next burst as that burst lands, and
    after it the new estimate starts where the count-down was. Only a burst later than the pace said
    (the count-down spent) takes the rate up to now, as recent_rate alone does."""
    if not points:
        return None, True, None
    done = points[-1][1]
    t_last = next(p[0] for p in points if p[1] >= done)  # when the count reached what it is now
    rate, warming = recent_rate([p for p in points if p[0] <= t_last], start_done)
    left = None if total is None else max(0.0, total - done)
    if rate and left is not None:
        eta = left / rate - max(0.0, now - t_last)
        if eta >= 0:
            return rate, warming, eta
    rate, warming = recent_rate(list(points) + [(now, done)], start_done)
    return rate, warming, (left / rate if rate and left is not None else None)


def journal_state(path: Path, now: float, host: str) -> dict[str, Any] | None:
    start, events, skipped = read_journal_counted(path)
    if start is None:
        return None
    last = events[-1] if events else start
    row: dict[str, Any] = {
        "rank": start.get("rank", 0),
        "world_size": start.get("world_size", 1),
        "attempt": start.get("attempt"),
        "done": last.get("done", start.get("done", 0)),
        "total": last.get("total", start.get("total")),
        "unit": start.get("unit"),
        "pid": start.get("pid"),
        "host": start.get("host"),
        "started": start.get("t"),
        "heartbeat_age_s": round(max(0.0, now - last.get("t", now)), 1),
        "phase": last.get("phase"),
        "error": None,
        "log": start.get("log"),
        "rate_per_s": None,
        "eta_s": None,
        # every rank counts the same steps (journals of train written before the flag existed are too)
        "shared": bool(start.get("shared", start.get("stage") == "train" and start.get("unit") == "steps")),
        "bad_journal_lines": skipped,  # lines of the tail skipped as not valid events
    }
    stall = float(start.get("stall_after_s") or 300.0)
    kind = last.get("ev")
    row["elapsed_s"] = round(max(0.0, (float(last["t"]) if kind in ("end", "error") else now)
                                 - float(start.get("t", now))), 1)
    row["warming_up"] = False
    if kind == "end":
        row["state"] = "done"
        # how fast the finished attempt went, over its whole time (what the next run is planned from)
        work = (row["done"] or 0) - (start.get("done") or 0)
        row["rate_per_s"] = round(work / row["elapsed_s"], 4) if work > 0 and row["elapsed_s"] > 0 else None
    elif kind == "error":
        # stopped on purpose (Ctrl-C, SIGTERM) is not a failure: the same command resumes it
        row["state"] = "interrupted" if last.get("interrupted") else "failed"
        row["error"] = last.get("error")
    else:
        same_host = start.get("host") == host
        alive = pid_alive(int(start["pid"])) if same_host and start.get("pid") else None
        hb_age = row["heartbeat_age_s"]
        progress_age = now - float(last.get("pt") or last["t"])
        if alive is False:
            row["state"] = "dead"
        elif hb_age > stall * (REMOTE_DEAD_FACTOR if alive is None else 1.0) and alive is None:
            row["state"] = "dead"
        elif hb_age > stall or (progress_age > stall and not last.get("phase")):
            row["state"] = "stalled"
        else:
            row["state"] = "running"
        if row["state"] in ("running", "stalled"):
            points = [(float(e["t"]), float(e["done"]), bool(e.get("w"))) for e in events
                      if e.get("t") is not None and e.get("done") is not None
                         and float(e["t"]) >= float(start.get("t", 0))]
            r, row["warming_up"], eta = rate_and_eta(points, float(start.get("done") or 0), row["total"], now)
            row["rate_per_s"] = round(r, 4) if r else None
            if eta is not None and row["total"] and row["done"] is not None:
                row["eta_s"] = round(eta, 1)
    return row


# Formatting shared by log lines and `status`


def fmt_duration(s: float | None) -> str:
    if s is None or s != s or s == float("inf"):
        return "?"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def fmt_rate(r: float | None) -> str:
    if r is None:
        return "?"
    return f"{r:.3g}" if r < 100 else f"{r:,.0f}"


def fmt_count(n: float) -> str:
    """1234567 -> '1.2M': counts in log lines."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(int(n))
